"""Layout-independent initialisation (``hybrid_model.seeded_init``): the rule of every parameter is the distribution
megatron gave it at construction, and the values depend on ``(seed, global name)`` only, not on the random stream
the model was built from. (The layouts themselves — PP, VPP, EP, DP, CP starting from the one-process model — are
checked end to end in dsv4-train's ``test_parallel_matrix.py`` / ``test_train_context_parallel.py``.)

Sample-std bound: for ``n`` draws of ``normal(0, σ)`` the sample std ``s`` has relative standard error
``1/sqrt(2n)``; ``|s/σ - 1| <= 6/sqrt(2n)`` fails with probability < 1e-8 per tensor, while the two stds a rule can
confuse (``σ`` and ``σ/sqrt(2L)``, L the layer count) differ by a factor >= 2.
"""

import functools
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tp_draw_workers import tp_shards
from tp_model_workers import tp_model_params

from dsv4_testkit import run_distributed
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset
from hybrid_model.seeded_draw import parameter_seed
from hybrid_model.seeded_init import expected_std, normal_std, seed_parameters

# the DSv4 symbols (C/H/W, hash + learned E, mHC, MTP) and megatron's '-' / '+' / 'D' (local modules)
PATTERNS = ("WEC-HE/WE", "W+D-E/+E")


def _std_ok(t: torch.Tensor, std: float) -> bool:
    s = float(t.double().std(correction=0)) if t.numel() > 1 else abs(float(t))
    return abs(s / std - 1) <= 6 / math.sqrt(2 * t.numel())


@pytest.mark.parametrize("pattern", PATTERNS)
def test_rules_are_megatrons_and_values_depend_on_seed_and_name_only(megatron_cpu, pattern):
    torch.manual_seed(0)
    model = build_model(get_preset("tiny").with_pattern(pattern))
    constructed = {n: p.detach().clone() for n, p in model.named_parameters()}
    # the rule of each parameter is the distribution megatron built it with
    random = 0
    for name, p in constructed.items():
        std = expected_std(model, name)
        if std is None:  # kept: built constant (norms, biases, sinks, mHC base / scale)
            assert bool((p == p.reshape(-1)[0]).all()), name
            continue
        random += 1
        assert abs(float(p.double().mean())) <= 6 * std / math.sqrt(p.numel()), name
        assert _std_ok(p, std), (name, float(p.std()), std)
    assert random > 15
    # re-drawn: a function of (seed, name), whatever the global stream
    assert seed_parameters(model, 11) == []  # no GDN / Mamba layer kept as built
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(123)
    seed_parameters(model, 11)
    for name, p in model.named_parameters():
        assert torch.equal(p, first[name]), name
        std = expected_std(model, name)
        if std is None:
            assert torch.equal(p, constructed[name]), name  # constants untouched
        else:
            assert not torch.equal(p, constructed[name]), name
            assert _std_ok(p.detach(), std), (name, float(p.std()), std)
    seed_parameters(model, 12)
    assert all(
        not torch.equal(p, first[n])
        for n, p in model.named_parameters()
        if expected_std(model, n) is not None
    )


def test_experts_are_drawn_per_global_expert(megatron_cpu):
    """EP rank r holds global experts r·G .. r·G+G-1: each expert's slice comes from its own seed, so the EP=1
    tensor is the concatenation of the EP ranks' tensors."""
    from hash_moe.megatron import ClampedSwiGLUExperts

    model = build_model(get_preset("tiny").with_pattern("WE/WE"))
    seed_parameters(model, 5)
    experts = next(m for m in model.modules() if isinstance(m, ClampedSwiGLUExperts))
    name = next(n for n, m in model.named_modules() if m is experts)
    for e in range(experts.gate_up_proj.shape[0]):
        gen = torch.Generator().manual_seed(parameter_seed(5, f"{name}.gate_up_proj", e))
        want = torch.empty(experts.gate_up_proj.shape[1:]).normal_(0.0, 0.02, generator=gen)
        assert torch.equal(experts.gate_up_proj[e].detach(), want)


def test_parameter_seed_is_stable_and_distinct():
    assert parameter_seed(11, "output_layer.weight") == parameter_seed(11, "output_layer.weight")
    seeds = {parameter_seed(s, n, i) for s in (0, 1) for n in ("a", "b") for i in (None, 0, 1)}
    assert len(seeds) == 12 and all(0 <= s < 2**63 for s in seeds)


def test_non_normal_initialiser_is_refused():
    assert normal_std(functools.partial(torch.nn.init.normal_, mean=0.0, std=0.5), "x") == 0.5
    with pytest.raises(ValueError, match="init_method_normal"):
        normal_std(torch.nn.init.xavier_uniform_, "config.init_method")
    with pytest.raises(ValueError, match="normal"):
        normal_std(functools.partial(torch.nn.init.normal_, mean=1.0, std=0.5), "x")


@pytest.mark.distributed
def test_tp_shards_are_slices_of_the_tp1_tensor():
    """Two gloo ranks as one TP group: each rank's shard of a column- (dim 0) or row-parallel (dim 1) weight is its
    slice of the TP=1 tensor drawn from the same key."""
    shards = run_distributed(tp_shards, 2, timeout=300)
    whole = torch.empty(6, 4).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(99))
    for dim in (0, 1):
        assert torch.equal(torch.cat([shards[r][dim] for r in (0, 1)], dim=dim), whole)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("pattern", "splits"),
    [
        ("*-/*-", 10),  # embedding, head, and per layer QKV, output, fc1, fc2 (main + MTP)
        ("WC-/H-", 18),  # embedding, head, per DSv4 attention q_up, attn_sink, wo_a, wo_b, per MLP fc1, fc2
    ],
)
def test_tp2_model_shards_are_parts_of_the_tp1_model(pattern, splits):
    """megatron's own TP layers (``*`` fused QKV and output, ``-`` fused SwiGLU ``linear_fc1`` of stride 2 and
    ``linear_fc2``, the vocab-parallel embedding and head) and DSv4 attention's head split (``W C H``:
    ``dsv4_attention.tp.params``) built at TP=2: each rank's shard is its part of the TP=1 model's tensor by
    megatron's stride rule (chunks of ``shard / stride`` rows, rank r holding r, r + 2, ...), and every replicated
    parameter equals the TP=1 one, bit for bit."""
    ranks = run_distributed(tp_model_params, 2, pattern, 7, timeout=900)
    tp1 = ranks[0][1]
    split = 0
    for name, (whole, _) in tp1.items():
        (s0, part), (s1, _) = ranks[0][2][name], ranks[1][2][name]
        if part is None:
            assert torch.equal(s0, whole) and torch.equal(s1, whole), name
            continue
        dim, stride = part
        c0, c1 = s0.chunk(stride, dim), s1.chunk(stride, dim)
        rebuilt = torch.cat([c for j in range(stride) for c in (c0[j], c1[j])], dim=dim)
        assert torch.equal(rebuilt, whole), name
        split += 1
    assert split == splits
