"""``dsv4 train --cuda-graph``: the whole forward+backward of a step captured in one CUDA graph (megatron-core's
``FullCudaGraphWrapper``) and replayed. CPU: the configuration checks (clear errors for what cannot be captured).
GPU: the tiny preset trained with and without graphs gives the same losses, the steps after the warm-up are
replays, and a change of a captured host-side value (the dense -> sparse attention switch) recaptures."""

import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from graph_runs import run_results_script

from dsv4_train.cli import build_parser, train_config_from_args
from dsv4_train.config import TrainConfig
from dsv4_train.setup import check_run


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-device error is a CPU case")
def test_needs_a_cuda_device():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        check_run(TrainConfig.from_flat(cuda_graph=True))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"pp": 2}, "one model-parallel rank"),
        ({"ep": 2}, "one model-parallel rank"),
        ({"cuda_graph_warmup_steps": 0}, "warmup-steps must be >= 1"),
        ({"bf16": False}, "needs bf16"),
    ],
)
def test_rejects_what_cannot_be_captured(fake_cuda, kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_run(TrainConfig.from_flat(**{"cuda_graph": True, "bf16": True, **kwargs}))


def test_data_parallel_is_accepted_model_parallel_is_not(fake_cuda, monkeypatch):
    """Several processes are data parallel (the DP gradient reduction runs beside the graph:
    test_train_graph_dp.py); PP, EP and CP stay refused with their reasons."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    # the world comes from torchrun's WORLD_SIZE only while no default group exists: an in-process trainer run by an
    # earlier test of the same process may have left its one-process group initialised
    monkeypatch.setattr("dsv4_train.setup.dist.is_initialized", lambda: False)
    assert check_run(TrainConfig.from_flat(cuda_graph=True, bf16=True)).graphs.cuda_graph
    for kwargs, match in (({"pp": 2}, "one model-parallel rank"), ({"ep": 2}, "one model-parallel rank")):
        with pytest.raises(ValueError, match=match):
            check_run(TrainConfig.from_flat(cuda_graph=True, bf16=True, **kwargs))
    with pytest.raises(ValueError, match="--cuda-graph with --cp 2"):
        check_run(TrainConfig.from_flat(cuda_graph=True, bf16=True, cp=2))
    with pytest.raises(ValueError, match=r"--cuda-graph --packed runs on one process \(DP=2\)"):
        check_run(TrainConfig.from_flat(cuda_graph=True, bf16=True, packed=True))


def test_cli_flags(fake_cuda):
    args = build_parser().parse_args(["train", "--cuda-graph", "--cuda-graph-warmup-steps", "3"])
    tc = train_config_from_args(args)
    assert tc.graphs.cuda_graph and tc.graphs.cuda_graph_warmup_steps == 3
    assert not train_config_from_args(build_parser().parse_args(["train"])).graphs.cuda_graph


_RUNNER = textwrap.dedent(
    """
    import json, sys
    from dsv4_train.config import TrainConfig
    from dsv4_train.trainer import Trainer

    if __name__ == "__main__":
        import torch

        # deterministic kernels (csa-kernels' key-major dkv / dk instead of fp32 atomics): the graphed run must then
        # reproduce the eager run's arithmetic, not only drift within bf16 noise
        torch.use_deterministic_algorithms(True, warn_only=True)
        out, results = sys.argv[1], {}
        for name, graph, dense in (("eager", False, 0), ("graph", True, 0), ("graph_dense", True, 3)):
            tc = TrainConfig.from_flat(
                preset="tiny", steps=8, seq_len=128, global_batch_size=4, micro_batch_size=2, warmup_steps=0,
                dense_steps=dense, cuda_graph=graph, out=f"{out}/{name}", progress=False, save_final=graph and not dense,
                mtp_loss_weight_decay=None,  # a constant MTP weight: no recapture at the LR-decay start
            )
            trainer = Trainer(tc)
            metrics = trainer.run()
            saved = (trainer.out / "checkpoints" / "latest").exists()
            results[name] = {
                "saved": saved,
                "lm": [m["lm_loss"] for m in metrics],
                "mtp": [m.get("mtp_loss") for m in metrics],
                "balance": [m.get("balance_loss") for m in metrics],
                "indexer": [m.get("indexer_loss") for m in metrics],
                "replayed": [m.get("cuda_graph_replayed", False) for m in metrics],
                "captures": trainer._graphed.captures if trainer._graphed is not None else 0,
            }
            trainer.close()
        print("RESULTS " + json.dumps(results))
    """
)


@pytest.mark.gpu
def test_graphed_training_matches_eager(tmp_path):
    r = run_results_script(tmp_path, _RUNNER)
    eager, graph, dense = r["eager"], r["graph"], r["graph_dense"]
    # two eager warm-up steps, then the capture step (replayed at once) and replays
    assert graph["replayed"] == [False, False] + [True] * 6 and graph["captures"] == 1
    assert graph["saved"]  # a dist checkpoint with the graph-safe RNG tracker's generator states
    assert all(v is not None for key in ("lm", "mtp", "balance") for v in graph[key])
    for key in (
        "lm",
        "mtp",
        "balance",
        "indexer",
    ):  # deterministic kernels: the replays are the eager arithmetic
        assert eager[key] == graph[key], (key, eager[key], graph[key])
    assert graph["lm"][-1] < graph["lm"][0]
    # dense steps 0-2 (eager warm-up 0-1, capture at 2), then the sparse phase: a new warm-up and capture
    assert dense["captures"] == 2
    assert dense["replayed"] == [False, False, True, False, False, True, True, True]


_RECOMPUTE_RUNNER = textwrap.dedent(
    """
    import json, sys
    from dsv4_train.config import TrainConfig
    from dsv4_train.trainer import Trainer

    if __name__ == "__main__":
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)
        out, results = sys.argv[1], {}
        settings = {
            "eager": ({}, False),
            "graph_selective": (dict(
                recompute_granularity="selective", mhc_recompute_layer_num=2,
                recompute_modules=["mhc", "layernorm", "mla_up_proj", "compressor", "indexer", "core_attn", "moe_act"],
            ), True),
            "eager_full": (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2), False),
            "graph_full": (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2), True),
        }
        for name, (kw, graph) in settings.items():
            tc = TrainConfig.from_flat(
                preset="tiny", steps=5, seq_len=256, global_batch_size=2, micro_batch_size=1, warmup_steps=0,
                cuda_graph=graph, out=f"{out}/{name}", progress=False, save_final=False, mtp_loss_weight_decay=None,
                **kw,
            )
            trainer = Trainer(tc)
            metrics = trainer.run()
            results[name] = {
                "lm": [m["lm_loss"] for m in metrics],
                "mtp": [m.get("mtp_loss") for m in metrics],
                "indexer": [m.get("indexer_loss") for m in metrics],
                "grad_norm": [m.get("grad_norm") for m in metrics],
                "replayed": [m.get("cuda_graph_replayed", False) for m in metrics],
            }
            trainer.close()
        print("RESULTS " + json.dumps(results))
    """
)


@pytest.mark.gpu
def test_graphed_recompute_matches_eager(tmp_path):
    """--cuda-graph with selective and with full recompute: the replayed steps (recompute inside the captured
    backward) train exactly like the eager run of the same recompute setting (deterministic kernels: same
    arithmetic). Selective recompute is also the plain eager run bit for bit; full recompute that covers the MTP
    depth is not, by one bf16 rounding of the word-embedding gradient per micro-batch (its main and MTP
    contributions reach the fp32 main_grad separately instead of summed in bf16 first:
    test_recompute_gpu.py::test_full_recompute_changes_only_the_shared_embedding_gradient), so the losses part after
    step 1."""
    r = run_results_script(tmp_path, _RECOMPUTE_RUNNER)
    for name, eager in (("graph_selective", "eager"), ("graph_full", "eager_full")):
        assert r[name]["replayed"] == [False, False, True, True, True], name
        for key in ("lm", "mtp", "indexer", "grad_norm"):
            assert r[name][key] == r[eager][key], (name, key, r[name][key], r[eager][key])
    assert r["eager_full"]["lm"][0] == r["eager"]["lm"][0]  # the first forward: the same arithmetic


def test_recompute_is_allowed_with_graphs(fake_cuda):
    """megatron allows selective and full recompute with a full-iteration graph (the DSv4 layers draw no random
    numbers): the flags combine."""
    tc = TrainConfig.from_flat(
        cuda_graph=True,
        bf16=True,
        recompute_granularity="full",
        recompute_method="block",
        recompute_num_layers=1,
    )
    assert tc.graphs.cuda_graph and tc.memory.recompute_granularity == "full"
