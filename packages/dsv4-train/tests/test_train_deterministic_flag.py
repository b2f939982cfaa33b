"""``dsv4 train --deterministic`` (the default with CUDA) / ``--no-deterministic``: the resolution of the default, the
environment rules (cuBLAS workspace, NCCL algorithms), the switches it sets for the lifetime of a run (and restores;
csa-kernels' default included), and — on the GPU — bitwise-identical runs, eager and ``--cuda-graph``."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import csa_kernels
from dsv4_train import trainer as trainer_module
from dsv4_train.cli import build_parser, train_config_from_args
from dsv4_train.config import TrainConfig, effective_config
from dsv4_train.determinism import (
    prepare_deterministic_environment,
    use_deterministic_training,
    use_run_determinism,
)
from dsv4_train.trainer import Trainer


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


def _flag(*argv: str) -> bool | None:
    return train_config_from_args(build_parser().parse_args(["train", *argv])).precision.deterministic


def test_cli_flag_and_default(capsys):
    """``--deterministic`` / ``--no-deterministic`` / unset (``None``: on with CUDA, off on CPU when the run starts;
    the machine is a parameter of the resolution, so both sides run without a GPU)."""
    assert (_flag("--deterministic"), _flag("--no-deterministic"), _flag()) == (True, False, None)
    unset = TrainConfig.from_flat(steps=2)
    assert effective_config(unset, cuda_available=True).precision.deterministic is True
    assert effective_config(unset, cuda_available=False).precision.deterministic is False
    for explicit in (True, False):
        tc = TrainConfig.from_flat(steps=2, deterministic=explicit)
        for cuda in (True, False):
            assert effective_config(tc, cuda_available=cuda).precision.deterministic is explicit
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = capsys.readouterr().out
    assert "--deterministic" in out and "--no-deterministic" in out and "on with CUDA" in out


@pytest.mark.parametrize("deterministic", [False, True])
def test_run_determinism_sets_and_restores_the_kernel_default(deterministic, monkeypatch):
    """The run's choice reaches csa-kernels (``--no-deterministic``: its atomic kernels for ``deterministic=None``)
    and is restored with everything else; on CPU ``--no-deterministic`` keeps PyTorch's deterministic kernels
    (``warn_only``, the CPU behaviour before the default changed), ``--deterministic`` makes them strict."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    assert csa_kernels.deterministic_default() is True
    restore = use_run_determinism(torch.device("cpu"), 3, deterministic)
    try:
        assert csa_kernels.deterministic_default() is deterministic
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled() is (not deterministic)
    finally:
        restore()
    assert csa_kernels.deterministic_default() is True
    assert (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    ) == before


def test_trainer_no_deterministic_tells_csa_kernels(tmp_path, monkeypatch):
    """A Trainer built with ``deterministic=False`` sets csa-kernels' default to the atomic kernels for the run and
    puts it back in ``close`` (and when its build fails); on CPU the default run resolves to
    ``deterministic=False`` (not strict)."""
    data = tmp_path / "corpus.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    kw = dict(steps=1, seq_len=32, global_batch_size=2, micro_batch_size=2, warmup_steps=0, data=[str(data)],
              progress=False, save_final=False)  # fmt: skip
    trainer = Trainer(TrainConfig.from_flat(out=str(tmp_path / "run"), deterministic=False, **kw))
    try:
        assert csa_kernels.deterministic_default() is False
        assert trainer.tc.precision.deterministic is False
    finally:
        trainer.close()
    assert csa_kernels.deterministic_default() is True

    def no_data(*a, **k):
        raise RuntimeError("no data")

    monkeypatch.setattr(trainer_module, "build_data", no_data)  # a build that fails after the switch
    with pytest.raises(RuntimeError, match="no data"):
        Trainer(TrainConfig.from_flat(out=str(tmp_path / "run1"), deterministic=False, **kw))
    assert csa_kernels.deterministic_default() is True
    monkeypatch.undo()
    if not torch.cuda.is_available():
        trainer = Trainer(TrainConfig.from_flat(out=str(tmp_path / "run2"), **kw))
        try:
            assert (
                trainer.tc.precision.deterministic is False
            )  # CPU: resolved off, PyTorch's kernels warn_only
            assert torch.is_deterministic_algorithms_warn_only_enabled()
        finally:
            trainer.close()


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
                cuda_graph=graph, out=f"{out}/{name}", progress=False, save_final=False,
                mtp_loss_weight_decay=None,
            )  # deterministic unset: the default, on with CUDA
            trainer = Trainer(tc)
            assert trainer.tc.precision.deterministic is True
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
    """Two eager runs and two ``--cuda-graph`` runs with the default (``--deterministic`` with CUDA) and the same seed: every loss, the
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
