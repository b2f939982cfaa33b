"""``--optimizer-offload-overlap``: the pipelined host step of the offloaded optimizer
(:mod:`dsv4_train.offload_pipeline`) against megatron's hybrid optimizer as ``--optimizer-cpu-offload`` configures
it, on CPU under :func:`offload_sim.simulated_device` (CPU tensors play the GPU, pinned copies the host).

Both run torch's fused CPU AdamW on the host part, so the pipelined step must be *bitwise* the same: model params,
fp32 masters, both Adam moments and the step counts, with shards cut into several chunks (a 64-element chunk: the
toy's 128- and 256-element shards become 2 and 4 chunks, the 80-element one 64 + 16), bf16 and native FP32 params
mixed, offload fractions below 1 and gradient clipping on; and checkpoints written by one mode resume in the other.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from offload_sim import simulated_device
from test_optimizer_impl import _load, _save, _step
from test_optimizer_offload import _build, _check_offloaded, _hybrid_state, _model_params

from dsv4_train.offload import hybrid_optimizers
from dsv4_train.offload_pipeline import ALIGN, OffloadPipeline, chunk_ranges

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CHUNK = 64  # elements: splits the toy's shards (the default, 8 Mi, is for real models)


def _steps_of(opt):
    return [
        float(hdo.state[p]["step"])
        for hdo in hybrid_optimizers(opt)
        for g in hdo.param_groups
        for p in g["params"]
    ]


def _assert_same(run_a, run_b):
    (pa, sa, ka), (pb, sb, kb) = run_a, run_b
    for n, a in pa.items():
        assert a.dtype == pb[n].dtype and torch.equal(a, pb[n]), n
    for i, (a, b) in enumerate(zip(sa, sb, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), i
    assert ka == kb


def _run(mode, fraction, bf16, steps, *, chunk=None, **fields):
    ddp, opt = _build(True, fraction=fraction, bf16=bf16, offload_chunk_numel=chunk, **fields)
    for s in range(steps):
        _step(ddp, opt, s)
    _check_offloaded(opt, mode, fraction)
    return (_model_params(ddp), _hybrid_state(opt), _steps_of(opt)), opt


@pytest.mark.parametrize("fraction, bf16", [(1.0, True), (0.5, True), (0.3, False)])
def test_pipeline_bitwise_equals_megatron_step(megatron_cpu, fraction, bf16):
    """3 steps (clipping at 1.0, gradients over five decades): the pipelined step equals megatron's, and megatron's
    own overlap mode (``overlap_cpu_optimizer_d2h_h2d=True``, per-shard host optimizers) equals it too."""
    from dsv4_primitives.megatron import cuda_as_cpu

    with cuda_as_cpu(), simulated_device() as mode:
        ref, _ = _run(mode, fraction, bf16, 3)
        got, opt = _run(mode, fraction, bf16, 3, chunk=CHUNK)
        overlap, _ = _run(mode, fraction, bf16, 3, overlap_cpu_optimizer_d2h_h2d=True)
        (hdo,) = hybrid_optimizers(opt)
        assert hdo.pipeline is not None and hdo.pipeline.chunk_numel == CHUNK
        sizes = [p.numel() for p in hdo.gpu_params_map_cpu_copy]
        assert max(sizes) > CHUNK, sizes  # the pipeline did cut a shard into chunks
        if fraction < 1.0:
            assert hdo.gpu_optimizer is not None
    assert ref[2] == [3.0] * len(ref[2])
    _assert_same(ref, got)
    _assert_same(ref, overlap)


@pytest.mark.parametrize("save_chunk, load_chunk", [(CHUNK, None), (None, CHUNK), (CHUNK, CHUNK)])
def test_pipeline_checkpoint_round_trip(megatron_cpu, tmp_path, save_chunk, load_chunk):
    """Save from one mode, resume in the other (fraction 0.5: host and device state): the resumed run's next step
    is bitwise the uninterrupted run's, and the pipeline is still on after the load (megatron rebuilds its host
    copies there)."""
    from dsv4_primitives.megatron import cuda_as_cpu
    from dsv4_train.checkpoint import sync_saver_queue

    sync_saver_queue()
    with cuda_as_cpu(), simulated_device() as mode:
        ddp, opt = _build(True, fraction=0.5, offload_chunk_numel=save_chunk)
        for s in range(3):
            _step(ddp, opt, s)
        _save(ddp, opt, tmp_path / "ckpt", True)
        ddp2, opt2 = _build(True, fraction=0.5, offload_chunk_numel=load_chunk)
        _load(ddp2, opt2, tmp_path / "ckpt", True)
        _step(ddp, opt, 3)
        _step(ddp2, opt2, 3)
        (hdo2,) = hybrid_optimizers(opt2)
        assert (hdo2.pipeline is not None) == (load_chunk is not None)
        _check_offloaded(opt2, mode, 0.5)
    _assert_same(
        (_model_params(ddp), _hybrid_state(opt), _steps_of(opt)),
        (_model_params(ddp2), _hybrid_state(opt2), _steps_of(opt2)),
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_dp2_pipeline():
    """DP2 on gloo: each rank pipelines the host step of its own half of the shards; both ranks' params equal the
    non-offloaded fused run bitwise (per-rank gradients differ; the DP average is applied) and each other."""
    from offload_sim import dp_rank_offload_vs_fused

    from dsv4_testkit import run_distributed

    results = run_distributed(dp_rank_offload_vs_fused, 2, 1.0, CHUNK)
    for r in results:
        host, total = r["shard"]
        assert r["pipelined"] == [True] and host == total and 0 < total < r["numel"]
        for n, p in r["ref"].items():
            assert torch.equal(p, r["offload"][n]), n
    for n, p in results[0]["offload"].items():
        assert torch.equal(p, results[1]["offload"][n]), n


def test_chunk_ranges_and_refusals():
    assert chunk_ranges(200, 64) == [(0, 64), (64, 128), (128, 192), (192, 200)]
    assert chunk_ranges(64, 64) == [(0, 64)] and chunk_ranges(0, 64) == []
    for bad in (0, -ALIGN, ALIGN + 1):
        with pytest.raises(ValueError, match="positive multiple of 64"):
            OffloadPipeline(bad)


def test_cli_flag():
    from dsv4_train.cli import build_parser, train_config_from_args
    from dsv4_train.config import TrainConfig

    def tc_of(*argv):
        return train_config_from_args(build_parser().parse_args(["train", *argv]))

    assert tc_of("--optimizer-cpu-offload", "--optimizer-offload-overlap").optimizer.optimizer_offload_overlap
    assert tc_of("--optimizer-cpu-offload").optimizer.optimizer_offload_overlap is False
    with pytest.raises(ValueError, match="only applies with --optimizer-cpu-offload"):
        tc_of("--optimizer-offload-overlap")
    with pytest.raises(ValueError, match="only applies with --optimizer-cpu-offload"):
        TrainConfig.from_flat(optimizer_offload_overlap=True)
