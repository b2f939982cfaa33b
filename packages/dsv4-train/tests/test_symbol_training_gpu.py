"""``dsv4 train`` on one GPU with megatron-core's own mixers: a ``+``/``D`` pattern and a ``G`` pattern (``[B, S]``
and packed THD) in bf16 on CUDA. Packed THD with ``G`` trains on fla's varlen kernels where they are trusted and is
refused elsewhere. The layers themselves are tested in hybrid-model's ``test_symbol_layers_gpu.py``."""

import importlib.util
import json

import pytest

from dsv4_train.cli import main


@pytest.mark.gpu
def test_mla_and_dsa_pattern_trains_in_bf16_on_cuda(tmp_path):
    """``dsv4 train --pattern W+D-E/+E`` on one GPU in bf16 (the local '+'/'D' specs without transformer-engine):
    finite losses that decrease, D's indexer loss logged."""
    run = tmp_path / "run"
    flags = ["--seq-len", "256", "--global-batch-size", "4", "--micro-batch-size", "2", "--warmup-steps", "0"]
    flags += ["--log-interval", "1", "--lr", "1e-2", "--bf16", "--steps", "10"]
    assert main(["train", *flags, "--pattern", "W+D-E/+E", "--out", str(run)]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["lm_loss"] for r in rows if "lm_loss" in r]
    assert len(losses) == 10 and all(x == x and x < 1e3 for x in losses), losses
    assert min(losses[-3:]) < losses[0], losses
    assert all(r.get("indexer_loss") is not None for r in rows if "lm_loss" in r)


def _needs_fla():
    if importlib.util.find_spec("fla") is None:
        pytest.skip("'G' needs fla (the hybrid-model[gdn] extra)")


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "packed"])
def test_gdn_pattern_trains_in_bf16_on_cuda(tmp_path, capsys, packed):
    """``dsv4 train --pattern WGE-/WE`` on one GPU in bf16: finite losses that decrease. Packed THD needs fla's
    varlen kernels; where they are not trusted (Hopper with Triton < 3.7.1: this H200) the run is refused
    before training with the reason, as megatron's torch rule would cross documents."""
    _needs_fla()
    from dsv4_train.cli import main
    from hybrid_model.gated_delta_net_layer import fla_chunk_kernels_correct

    run = tmp_path / "run"
    flags = ["--seq-len", "256", "--global-batch-size", "4", "--warmup-steps", "0"]
    flags += ["--log-interval", "1", "--lr", "1e-2", "--bf16", "--steps", "10"]
    flags += ["--packed"] if packed else ["--micro-batch-size", "2"]
    rc = main(["train", *flags, "--pattern", "WGE-/WE", "--out", str(run)])
    if packed and not fla_chunk_kernels_correct()[0]:
        assert rc == 2 and "cannot run packed THD batches here" in capsys.readouterr().err
        return
    assert rc == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["lm_loss"] for r in rows if "lm_loss" in r]
    assert len(losses) == 10 and all(x == x and x < 1e3 for x in losses), losses
    assert min(losses[-3:]) < losses[0], losses
