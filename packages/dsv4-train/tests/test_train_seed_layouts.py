"""One ``--seed``, one model, from the CLI as users run it (issue 31): ``torchrun --nproc-per-node 2 -m dsv4_train
train --pp 2 --vpp 2`` (gloo, CPU) starts from the single process's model and batches, so its first step is the
single process's first step.

Before the layout-independent initialisation (``hybrid_model.seeded_init``) this case measured step-1 LM loss
6.2468 in one process and 6.2192 under PP2 x VPP2 (``--seed 11``, fp32): every later PP stage and VPP chunk drew
its weights from a fresh random stream. The batches never differed (the parallel matrix compares the first step
bitwise when both runs load the same weights). The other layouts (DP2, PP2, EP2, CP2, fp32 and bf16) are checked
the same way, and their initial parameters bitwise, by ``test_parallel_matrix.py`` and
``test_train_context_parallel.py`` without ``init_from``.

Both runs use one thread per process (torchrun's default; the single process is given ``OMP_NUM_THREADS=1`` too:
the CPU GEMMs' blocking, and so their rounding, depends on the thread count).

Bounds (fp32):

* LM and MTP losses: bitwise. PP changes no forward arithmetic: the same micro-batches through the same layers,
  the mHC streams crossing stages in fp32 (their dtype), the micro-batch mean in the same order.
* grad norm: ``sqrt(Σ_p ||g_p||²)`` over the parameter tensors, summed per stage and then across stages, i.e. in
  another order, and the word embedding's gradient (main head + MTP on two stages) summed in another order: the
  sum of ``N`` non-negative fp32 terms in any order is within ``N·u`` relative (``u = 2**-24``), the embedding
  term within ``u`` of its own; ``N < 256`` tensors in the tiny preset, so ``|Δ| <= 257·u·norm``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import ONE_PROCESS, torchrun, train_metrics

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

_ARGS = [
    "--preset", "tiny", "--seed", "11", "--no-bf16", "--steps", "1", "--seq-len", "64", "--global-batch-size", "4",
    "--micro-batch-size", "1", "--no-progress", "--no-save-final",
]  # fmt: skip
_FP32_U = 2.0**-24
_NORM_REL = 257 * _FP32_U


def test_pp2_vpp2_from_the_cli_starts_like_one_process(tmp_path):
    one = train_metrics(ONE_PROCESS, tmp_path / "one", *_ARGS)[0]
    pp = train_metrics(torchrun(2), tmp_path / "pp", *_ARGS, "--pp", "2", "--vpp", "2")[0]
    assert one["step"] == pp["step"] == 1
    assert (pp["lm_loss"], pp["mtp_loss"]) == (one["lm_loss"], one["mtp_loss"])
    assert abs(pp["grad_norm"] - one["grad_norm"]) <= _NORM_REL * one["grad_norm"]


def test_a_cut_pattern_under_pp2_starts_like_its_uncut_pattern(tmp_path):
    """A custom pattern with megatron's MLP (``-``), cut for PP2, builds the one-process model of the same pattern
    without the cut (the tiny preset's two hash-routed MoE layers are its first two ``E`` in both); a cut that
    leaves a hash layer past the first stage is refused before any work, in one line (it once built a model whose
    second hash layer was routed by a learned router under PP only: step-1 LM loss 2.7e-5 relative off one process,
    balance loss 1.4e-3)."""
    one = train_metrics(ONE_PROCESS, tmp_path / "one", *_ARGS, "--pattern", "WEC-EHE/WE")[0]
    pp = train_metrics(torchrun(2), tmp_path / "pp", *_ARGS, "--pattern", "WEC-E|HE/WE", "--pp", "2")[0]
    assert (pp["lm_loss"], pp["mtp_loss"]) == (one["lm_loss"], one["mtp_loss"])
    assert abs(pp["grad_norm"] - one["grad_norm"]) <= _NORM_REL * one["grad_norm"]

    refused = subprocess.run(
        [*ONE_PROCESS, "train", *_ARGS, "--pattern", "WEC-|HE/WE", "--pp", "2", "--out", str(tmp_path / "no")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "first pipeline stage" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "no").exists()
