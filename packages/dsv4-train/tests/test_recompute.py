"""Activation recompute (``--recompute-*``): every module choice and full uniform/block give the gradients of a run
without recompute bit for bit on CPU (deterministic kernels), run their side effects once, and keep fewer bytes
for backward (counted with ``torch.autograd.graph.saved_tensors_hooks``)."""

import pytest
import torch

from dsv4_primitives.recompute import SELECTIVE_MODULES, RecomputeConfig
from dsv4_train.recompute import LONG_CONTEXT_SELECTIVE
from hybrid_model.presets import get_preset

SETTINGS = {
    **{m: RecomputeConfig("selective", (m,)) for m in SELECTIVE_MODULES},
    "mhc-groups-of-2": RecomputeConfig("selective", ("mhc",), mhc_layer_num=2),
    "all-selective": RecomputeConfig(
        "selective",
        ("mhc", "layernorm", "mla_up_proj", "compressor", "indexer", "core_attn", "moe_act"),
        mhc_layer_num=3,
    ),
    "full-uniform-3": RecomputeConfig("full", method="uniform", num_layers=3),
    "full-block-5": RecomputeConfig("full", method="block", num_layers=5),
}


def _step(recompute, ids, *, count_saved=False):
    """One forward + backward of the tiny model (same init every call): loss, gradients, side effects, and the
    bytes of the distinct storages saved for backward."""
    from dsv4_attention import get_indexer_loss_tracker
    from hybrid_model.model import build_model

    get_indexer_loss_tracker().reset()
    torch.manual_seed(0)
    model = build_model(get_preset("tiny"), recompute=recompute).train()
    labels = torch.roll(ids, -1, 1)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, None, None, labels=labels).mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    loads = [
        m.router.local_tokens_per_expert.clone() for m in model.decoder.moe_layers() if not m.is_hash_layer
    ]
    return loss.detach(), grads, loads, get_indexer_loss_tracker().values.clone(), sum(saved.values())


@pytest.fixture(scope="module", autouse=True)
def _deterministic_cpu_kernels():
    """As ``dsv4 train`` on CPU: the threaded ``index_put_`` accumulation of the reference kernels' backward would
    change the summation order from run to run (:mod:`dsv4_train.determinism`)."""
    from dsv4_train.determinism import use_deterministic_cpu_kernels

    restore = use_deterministic_cpu_kernels(torch.device("cpu"))
    yield
    restore()


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, get_preset("tiny").vocab_size, (1, 160), generator=g)  # > 128: HCA/CSA entries


@pytest.fixture(scope="module")
def reference(ids):
    from dsv4_testkit.megatron_cpu import megatron_cpu_context

    with megatron_cpu_context():
        return _step(None, ids)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_gradients_equal_no_recompute_bitwise(megatron_cpu, ids, reference, name):
    loss, grads, loads, indexer_losses, saved = _step(SETTINGS[name], ids)
    ref_loss, ref_grads, ref_loads, ref_indexer, ref_saved = reference
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    differ = [n for n in grads if grads[n] is None or not torch.equal(grads[n], ref_grads[n])]
    assert differ == []
    # side effects ran once: expert-load counters (bias update) and the indexer-loss tracker
    assert all(torch.equal(a, b) for a, b in zip(loads, ref_loads, strict=True))
    assert torch.equal(indexer_losses, ref_indexer)
    # every setting keeps fewer bytes for backward than no recompute
    assert saved < ref_saved, (name, saved, ref_saved)


def _mtp_saved_bytes(recompute, ids) -> tuple[int, int, tuple[int, int]]:
    """(bytes of the storages saved for backward while an MTP depth's sub-layers run, all bytes saved, (checkpoint
    chunks the MTP depths opened, sub-layers + 2 per depth)) in one forward."""
    from hybrid_model import mtp as mtp_module
    from hybrid_model.model import build_model

    torch.manual_seed(0)
    model = build_model(get_preset("tiny"), recompute=recompute).train()
    inside = [False]
    for depth in model.mtp.depths():
        for part in (*depth.block, depth.enorm, depth.hnorm, depth.e_proj, depth.h_proj, depth.hyper_head):
            part.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
            part.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    mtp, everything = {}, {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        everything[key] = t.untyped_storage().nbytes()
        if inside[0]:
            mtp[key] = t.untyped_storage().nbytes()
        return t

    chunks = [0]
    checkpoint = mtp_module.checkpoint_layers

    def counted(fn, *args):
        chunks[0] += 1
        return checkpoint(fn, *args)

    mtp_module.checkpoint_layers = counted
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, None, None, labels=torch.roll(ids, -1, 1)).mean()
    finally:
        mtp_module.checkpoint_layers = checkpoint
    loss.backward()  # outside the hooks: a recompute's own saves are not kept across the step
    expected = sum(len(depth.block) + 2 for depth in model.mtp.depths())  # the chunks full recompute opens
    return sum(mtp.values()), sum(everything.values()), (chunks[0], expected)


def test_mtp_inside_full_recompute(megatron_cpu, ids):
    """Full recompute whose stage's last layer is checkpointed (uniform) also recomputes the MTP depths, one chunk
    per sub-layer (input projections, each block layer, HyperHead + norm: a backward holds one sub-layer's
    activations at a time): nothing is saved inside them (their gradients are bitwise those of no recompute:
    ``full-uniform-3`` above); block recompute that leaves the last layers alone keeps the MTP activations."""
    none_mtp, none_all, none_chunks = _mtp_saved_bytes(None, ids)
    full_mtp, full_all, full_chunks = _mtp_saved_bytes(SETTINGS["full-uniform-3"], ids)
    block_mtp, _, block_chunks = _mtp_saved_bytes(SETTINGS["full-block-5"], ids)
    assert none_mtp > 0 and full_mtp == 0 and block_mtp == none_mtp
    assert full_all <= none_all - none_mtp  # the MTP activations are all gone from what full recompute keeps
    assert none_chunks[0] == block_chunks[0] == 0
    assert (
        full_chunks[0] == full_chunks[1] >= 4
    )  # one per sub-layer (tiny: one depth, W + E) + projections + head


@pytest.mark.slow
@pytest.mark.distributed
def test_pp2_recompute_gradients_bitwise(tmp_path):
    """PP2 (gloo, fp32): selective (every module, mHC groups of 2) and full block recompute give the first step's
    gradients and the losses of the run without recompute, bit for bit; each stage recomputes its own layers (the
    stage-boundary streams are group ends)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from parallel_runs import merge_rank_grads, train_layouts

    from dsv4_testkit import run_distributed

    base = dict(
        seq_len=160, global_batch_size=2, micro_batch_size=1, steps=1, pp=2, bf16=False, save_final=False
    )
    settings = {
        "none": {},
        "selective": dict(LONG_CONTEXT_SELECTIVE),
        "full": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    }
    runs = [(name, dict(base, out=str(tmp_path / name), **kw)) for name, kw in settings.items()]
    per_rank = run_distributed(train_layouts, 2, runs, timeout=1200)
    ref_grads = merge_rank_grads([r["none"]["grads"] for r in per_rank])
    ref_metrics = per_rank[-1]["none"]["metrics"]
    for name in ("selective", "full"):
        grads = merge_rank_grads([r[name]["grads"] for r in per_rank])
        assert grads.keys() == ref_grads.keys()
        assert [n for n in grads if not torch.equal(grads[n], ref_grads[n])] == [], name
        assert per_rank[-1][name]["metrics"] == ref_metrics, name


def test_cli_flags_and_errors():
    from dsv4_train.cli import build_parser, train_config_from_args
    from dsv4_train.config import TrainConfig
    from dsv4_train.recompute import recompute_config

    args = ["train", "--recompute-granularity", "selective", "--recompute-modules", "mhc", "moe_act"]
    tc = train_config_from_args(build_parser().parse_args([*args, "--mhc-recompute-layer-num", "2"]))
    assert recompute_config(tc) == RecomputeConfig("selective", ("mhc", "moe_act"), mhc_layer_num=2)
    full = [
        "train",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        "3",
    ]
    assert recompute_config(train_config_from_args(build_parser().parse_args(full))).full_chunks(4)[-1] == (
        3,
        4,
        False,
    )
    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "--recompute-modules" in help_text and "--mhc-recompute-layer-num" in help_text
    with pytest.raises(ValueError, match="--recompute-"):
        TrainConfig.from_flat(recompute_granularity="full")  # no method / num_layers
    with pytest.raises(ValueError, match="need granularity 'selective'"):
        TrainConfig.from_flat(recompute_modules=["mhc"])
