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

Launches: the PP2 x VPP2 run is a real ``torchrun``; the one-process runs of both tests share one process and the
cut-pattern PP2 run runs in one set of 2 gloo workers (:func:`cli_runs.train_in_workers`: the CLI's ``main`` as
torchrun runs it, bitwise like a launch, one thread each; ``test_train_tensor_parallel_combos.py`` checks that
equality); the refused cut runs the CLI's ``main`` in the test process (refused before any work).

Bounds (fp32):

* LM and MTP losses: bitwise. PP changes no forward arithmetic: the same micro-batches through the same layers,
  the mHC streams crossing stages in fp32 (their dtype), the micro-batch mean in the same order.
* grad norm: ``sqrt(Σ_p ||g_p||²)`` over the parameter tensors, summed per stage and then across stages, i.e. in
  another order, and the word embedding's gradient (main head + MTP on two stages) summed in another order: the
  sum of ``N`` non-negative fp32 terms in any order is within ``N·u`` relative (``u = 2**-24``), the embedding
  term within ``u`` of its own; ``N < 256`` tensors in the tiny preset, so ``|Δ| <= 257·u·norm``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import torchrun, train_in_workers, train_metrics
from warm_workers import run_warm

from dsv4_train.__main__ import main

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

_ARGS = [
    "--preset", "tiny", "--seed", "11", "--no-bf16", "--steps", "1", "--seq-len", "64", "--global-batch-size", "4",
    "--micro-batch-size", "1", "--no-progress", "--no-save-final",
]  # fmt: skip
_FP32_U = 2.0**-24
_NORM_REL = 257 * _FP32_U
_CUT = "WEC-E|HE/WE"  # the custom pattern cut for PP2; without the cut for one process


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """Step 1 of the one-process runs of both tests (the preset's pattern, ``_CUT`` uncut), in one process."""
    tmp = tmp_path_factory.mktemp("one")
    runs = [
        ("preset", [*_ARGS, "--out", str(tmp / "preset")]),
        ("pattern", [*_ARGS, "--pattern", _CUT.replace("|", ""), "--out", str(tmp / "pattern")]),
    ]
    (metrics,) = run_warm(train_in_workers, 1, runs, timeout=900)
    return {name: rows[0] for name, rows in metrics.items()}


def test_pp2_vpp2_from_the_cli_starts_like_one_process(one, tmp_path):
    pp = train_metrics(torchrun(2), tmp_path / "pp", *_ARGS, "--pp", "2", "--vpp", "2")[0]
    assert one["preset"]["step"] == pp["step"] == 1
    assert (pp["lm_loss"], pp["mtp_loss"]) == (one["preset"]["lm_loss"], one["preset"]["mtp_loss"])
    assert abs(pp["grad_norm"] - one["preset"]["grad_norm"]) <= _NORM_REL * one["preset"]["grad_norm"]


def test_a_cut_pattern_under_pp2_starts_like_its_uncut_pattern(one, tmp_path, capsys):
    """A custom pattern with megatron's MLP (``-``), cut for PP2, builds the one-process model of the same pattern
    without the cut (the tiny preset's two hash-routed MoE layers are its first two ``E`` in both); a cut that
    leaves a hash layer past the first stage is refused before any work, in one line (it once built a model whose
    second hash layer was routed by a learned router under PP only: step-1 LM loss 2.7e-5 relative off one process,
    balance loss 1.4e-3)."""
    runs = [("pp", [*_ARGS, "--pattern", _CUT, "--pp", "2", "--out", str(tmp_path / "pp")])]
    per_rank = run_warm(train_in_workers, 2, runs, timeout=900)
    assert per_rank[0] == per_rank[1]  # both ranks read the same metrics.jsonl
    pp, ref = per_rank[0]["pp"][0], one["pattern"]
    assert pp["step"] == ref["step"] == 1
    assert (pp["lm_loss"], pp["mtp_loss"]) == (ref["lm_loss"], ref["mtp_loss"])
    assert abs(pp["grad_norm"] - ref["grad_norm"]) <= _NORM_REL * ref["grad_norm"]

    capsys.readouterr()
    code = main(["train", *_ARGS, "--pattern", "WEC-|HE/WE", "--pp", "2", "--out", str(tmp_path / "no")])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "first pipeline stage" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "no").exists()
