"""The TP communication model (:mod:`hybrid_model.tp_comm`) against the collectives a gloo TP=2 run calls: one bf16
forward + backward of the tiny preset (DSv4 attention ``W C H``, MoE ``E`` with hash and learned routers, the
dense MLP ``-``, mHC, one MTP depth, the fused head; then megatron's ``*`` with the unfused head) on one sequence
of 64 tokens, both cases one after the other in one set of 2 gloo workers. Every ``torch.distributed`` collective
(and megatron-core's aliases of them) is recorded with the module that ran it (forward: the module's pre-hook;
backward: a hook on its output's gradient) and compared exactly, as a multiset of (op, elements of the full tensor,
bytes per element) per layer and phase, with the model. The parameters each layer holds on a rank (split /
replicated) are compared exactly with
:func:`~hybrid_model.tp_comm.head_split_params` / :func:`~hybrid_model.tp_comm.replicated_params`.

Counting only (shapes and dtypes, not values): no numerical tolerance applies; the collectives' values are checked
by ``test_tensor_parallel.py`` and dsv4-attention's ``test_tp_attention.py``.
"""

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
from tp_comm_workers import tp_comm_runs
from tp_cost_table import README, with_table

from dsv4_testkit import run_distributed
from hybrid_model.presets import get_preset
from hybrid_model.tp_comm import (
    attention_collectives,
    embedding_collectives,
    head_collectives,
    head_split_params,
    layer_collectives,
    replicated_params,
    total_bytes,
)

SEQ, TP = 64, 2


def _model_layers(cfg):
    """``{module name: (symbol, learned router, hashed)}`` of the built model's layers."""
    out = {}
    for li in cfg.layers():
        name = (
            f"mtp.block.{li.index - len(cfg.parsed_pattern.main)}"
            if li.mtp_depth
            else f"decoder.layers.{li.index}"
        )
        is_hashed = li.router == "hash"
        out[name] = (li.symbol, li.router == "learned", is_hashed)
    return out


def _expected(cfg, fused):
    """``{(module, phase): Counter of (op, elements, itemsize)}`` from the model."""
    want: dict = {}

    def add(name, collectives):
        for c in collectives:
            want.setdefault((name, c.phase), Counter())[(c.op, c.elements, c.itemsize)] += 1

    for name, (symbol, learned, _) in _model_layers(cfg).items():
        add(name, layer_collectives(cfg, symbol, SEQ, TP, learned=learned))
    depths = cfg.parsed_pattern.mtp_num_depths
    for _ in range(1 + depths):  # the main embedding and head, and each MTP depth's
        add("embedding", embedding_collectives(cfg, SEQ, TP))
        add("head", head_collectives(cfg, SEQ, TP, fused=fused))
    return want


CASES = [("WEC-HE/WE", True), ("*E-E/*E", False)]


@pytest.fixture(scope="module")
def recorded():
    """Per rank, ``{pattern: tp_comm_run result}`` of both cases, one after the other in one set of 2 gloo workers."""
    return run_distributed(tp_comm_runs, TP, CASES, SEQ, timeout=900)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("pattern,fused", CASES, ids=["dsv4-fused", "megatron-unfused"])
def test_tp2_collectives_equal_the_model(recorded, pattern, fused):
    cfg = get_preset("tiny").with_pattern(pattern)
    ranks = [r[pattern] for r in recorded]
    assert ranks[0]["log"] == ranks[1]["log"]  # every rank runs the same collectives
    got: dict = {}
    for (name, phase), op, elements, itemsize in ranks[0]["log"]:
        got.setdefault((name, phase), Counter())[(op, elements, itemsize)] += 1
    want = _expected(cfg, fused)
    assert set(got) == set(want), (sorted(got), sorted(want))
    for key in want:
        assert got[key] == want[key], (key, got[key], want[key])
    # the parameters each layer holds on a rank
    for name, (symbol, _, hashed) in _model_layers(cfg).items():
        split, rep = ranks[0]["params"][name]
        assert split * TP == head_split_params(cfg, symbol), name
        assert rep == replicated_params(cfg, symbol, hashed), name
    vd = cfg.vocab_size * cfg.hidden_size
    assert ranks[0]["params"]["embedding"] == (vd // TP, 0)
    assert ranks[0]["params"]["output_layer"] == (vd // TP, 0)


def test_bytes_per_rank_and_the_readme_table():
    """The ring bytes of one window layer at TP 4 (hand-derived from the module formula) and the generated TP cost
    table of dsv4-attention's README is current (``tools/tp_cost_table.py``)."""
    cfg = get_preset("v4-flash")
    d, c, dc, rows = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank, 4096
    halo = 4 * min(cfg.sliding_window - 1, rows // 4) * d
    elements = 2 * halo + 2 * rows * (dc + c) + 2 * rows * d  # each gathered and reduce-scattered once
    assert total_bytes(attention_collectives(cfg, "W", rows, 4), 4) == 3 / 4 * elements * 2
    text = README.read_text()
    assert with_table(text) == text, "run python3 packages/hybrid-model/tools/tp_cost_table.py"
