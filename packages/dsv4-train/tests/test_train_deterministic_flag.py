"""``dsv4 train --deterministic``: the environment rules (cuBLAS workspace, NCCL algorithms), the switches it sets
for the lifetime of a run (and restores), and — on the GPU — bitwise-identical runs, eager and ``--cuda-graph``."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dsv4_train.cli import build_parser, train_config_from_args
from dsv4_train.determinism import (
    prepare_deterministic_environment,
    use_deterministic_training,
)


def test_environment_defaults_and_user_values():
    env: dict[str, str] = {}
    prepare_deterministic_environment(env)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "^NVLS,NVLSTree"}
    kept = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Ring"}
    prepare_deterministic_environment(kept)  # the user's deterministic choices stay
    assert kept == {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Ring"}
    for algo in ("Tree,Ring", "^nvls,nvlstree", "CollnetDirect"):
        env = {"NCCL_ALGO": algo}
        prepare_deterministic_environment(env)
        assert env["NCCL_ALGO"] == algo


@pytest.mark.parametrize(
    "algo, completed",
    [("^NVLS", "^NVLS,NVLSTree"), ("^nvlstree", "^nvlstree,NVLS"), ("^Ring", "^Ring,NVLS,NVLSTree")],
)
def test_exclusion_list_completed_with_a_note(algo, completed, capsys):
    """A cluster's ``NCCL_ALGO=^NVLS`` (it leaves NVLSTree allowed) is narrowed, not refused: the run still excludes
    what the user excluded, and the note names both values."""
    env = {"NCCL_ALGO": algo}
    prepare_deterministic_environment(env)
    assert env["NCCL_ALGO"] == completed
    assert f"using NCCL_ALGO={completed!r}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "env, match",
    [
        ({"CUBLAS_WORKSPACE_CONFIG": ":0:0"}, r"CUBLAS_WORKSPACE_CONFIG=':0:0' makes cuBLAS GEMMs"),
        ({"NCCL_ALGO": "NVLS"}, r"NCCL_ALGO='NVLS' .*it allows nvls"),
        ({"NCCL_ALGO": "Ring,NVLSTree"}, r"it allows nvlstree"),
    ],
)
def test_environment_refusals(env, match):
    before = dict(env)
    with pytest.raises(ValueError, match=match):
        prepare_deterministic_environment(env)
    assert env == before  # nothing half-set


def test_cli_flag(capsys):
    args = build_parser().parse_args(["train", "--deterministic"])
    assert train_config_from_args(args).precision.deterministic is True
    assert train_config_from_args(build_parser().parse_args(["train"])).precision.deterministic is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    assert "--deterministic" in capsys.readouterr().out


def test_switches_and_restore(monkeypatch):
    import torch.utils.deterministic as det

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        det.fill_uninitialized_memory,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    restore = use_deterministic_training(torch.device("cpu"), seed=7)
    try:
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # strict: no silent fallback
        assert det.fill_uninitialized_memory is False
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        a = torch.rand(4)
        torch.manual_seed(7)
        assert torch.equal(a, torch.rand(4))  # seeded
    finally:
        restore()
    after = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        det.fill_uninitialized_memory,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    assert after == before


def test_cpu_run_is_strict_and_uses_megatron_deterministic_mode(tmp_path, monkeypatch):
    """A short CPU run with ``deterministic=True``: strict deterministic algorithms while it trains (every op of the
    step has a deterministic implementation, or this raises), megatron's ``deterministic_mode`` on the config and
    the embedding, finite falling-or-not metrics, and the previous settings back after ``close``."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    from dsv4_train.config import TrainConfig
    from dsv4_train.trainer import Trainer

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    data = tmp_path / "corpus.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    tc = TrainConfig.from_flat(
        steps=2, seq_len=32, global_batch_size=2, micro_batch_size=2, warmup_steps=0, data=[str(data)],
        out=str(tmp_path / "run"), progress=False, save_final=False, deterministic=True,
    )  # fmt: skip
    trainer = Trainer(tc)
    try:
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert trainer.config.deterministic_mode
        embeddings = [m for m in trainer.core.modules() if isinstance(m, VocabParallelEmbedding)]
        assert embeddings and all(m.deterministic_mode for m in embeddings)
        metrics = trainer.run()
    finally:
        trainer.close()
    assert len(metrics) == 2 and all(torch.isfinite(torch.tensor(m["lm_loss"])) for m in metrics)
    assert (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    ) == (before)


_GPU_RUNNER = textwrap.dedent(
    """
    import hashlib, json, sys
    import torch
    from dsv4_train.config import TrainConfig
    from dsv4_train.trainer import Trainer

    if __name__ == "__main__":
        out, results = sys.argv[1], {}
        for name, graph in (("eager_a", False), ("eager_b", False), ("graph_a", True), ("graph_b", True)):
            tc = TrainConfig.from_flat(
                preset="tiny", steps=6, seq_len=128, global_batch_size=4, micro_batch_size=2, warmup_steps=0,
                cuda_graph=graph, out=f"{out}/{name}", progress=False, save_final=False, deterministic=True,
                mtp_loss_weight_decay=None,
            )
            trainer = Trainer(tc)
            metrics = trainer.run()
            digest = hashlib.sha256()
            for k, v in sorted(trainer.core.state_dict().items()):
                if isinstance(v, torch.Tensor):
                    digest.update(k.encode() + v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            keys = ("lm_loss", "mtp_loss", "balance_loss", "indexer_loss", "grad_norm")
            results[name] = {"metrics": [[m.get(k) for k in keys] for m in metrics], "weights": digest.hexdigest()}
            trainer.close()
        print("RESULTS " + json.dumps(results))
    """
)


@pytest.mark.gpu
def test_deterministic_runs_are_bitwise_identical_on_gpu(tmp_path):
    """Two eager runs and two ``--cuda-graph`` runs with ``--deterministic`` and the same seed: every loss, the
    gradient norm of every step and the final weights (a hash of every byte) agree bit for bit; the graphed runs
    equal the eager runs too (the replay is the eager arithmetic)."""
    script = tmp_path / "run.py"
    script.write_text(_GPU_RUNNER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)  # the Trainer sets it before the first cuBLAS call
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env, timeout=900
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert line, (proc.stdout + proc.stderr)[-4000:]
    r = json.loads(line[0][len("RESULTS ") :])
    assert r["eager_a"] == r["eager_b"]
    assert r["graph_a"] == r["graph_b"]
    assert r["eager_a"] == r["graph_a"]
