"""bf16 on CPU (gloo): the distributed optimizer with keep-in-fp32 params under DP2, and checkpoint resume at another
layout: DP2 -> DP1 (``dp_reshardable``, the default format) and PP2 -> PP1 (``--ckpt-format fully_reshardable``).

Each 2-process run trains 4 steps in bf16 and saves at step 2 (bf16 weights, fp32 keep-in-fp32 params, fp32 main
params and Adam moments). One process then resumes the step-2 checkpoint and trains steps 3 and 4. (Other layout
changes are refused before loading, see ``dsv4_train.checkpoint.check_resume_layout`` and
``test_resume_layout_check.py``.) PP2's first and last stages hold the word embedding (MTP's copy on the last) in a
bucket of its own: the layout where megatron 0.19.2's ``fully_reshardable`` save shifted the optimizer state
(fixed in dsv4-primitives' ``DistributedOptimizerWithNativeFP32Params``).

* Step 3 (the next step after the resume) runs its forward on the restored weights and the same micro-batches: its
  LM and MTP losses are bitwise those of the uninterrupted run (DP and PP change no forward arithmetic: the mHC
  streams cross stages in fp32).
* Step 4 follows an update from the restored Adam moments. The step-3 gradients of the two layouts differ only in
  the fp32 order of the DP reduction vs the micro-batch accumulation (and so the grad norm), so the updated fp32
  main params differ by fp32 rounding and at most a few bf16 weights by one ulp. Bound: ``|ΔL| <= u·|L|`` with
  ``u = 2**-8`` the bf16 unit roundoff: the loss may move by less than one bf16 rounding of itself.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_runs import train_layouts
from warm_workers import run_warm

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

_BASE = dict(
    seq_len=160,
    global_batch_size=4,
    micro_batch_size=1,
    warmup_steps=1,
    lr=3e-3,
    steps=4,
    bf16=True,
    save_interval=2,
)
_BF16_U = 2.0**-8
LAYOUTS = {"dp2": dict(), "pp2": dict(pp=2, ckpt_format="fully_reshardable")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    saved = run_warm(
        train_layouts,
        2,
        [(name, dict(_BASE, out=str(tmp / name)) | lay) for name, lay in LAYOUTS.items()],
        timeout=1200,
    )
    for name in LAYOUTS:  # the step-2 checkpoint as the newest one of a fresh run directory
        dst = tmp / f"{name}-to-1" / "checkpoints"
        shutil.copytree(tmp / name / "checkpoints" / "iter_0000002", dst / "iter_0000002")
        (dst / "latest").write_text("iter_0000002")
    (resumed,) = run_warm(
        train_layouts,
        1,
        [(name, dict(_BASE, out=str(tmp / f"{name}-to-1"), resume=True)) for name in LAYOUTS],
    )
    return saved, resumed


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_at_one_process_gives_the_same_next_step_loss(runs, layout):
    saved, resumed = runs
    full = saved[-1][layout]["metrics"]  # the last rank is on the last stage
    got = resumed[layout]["metrics"]
    assert [m["step"] for m in full] == [1, 2, 3, 4] and [m["step"] for m in got] == [3, 4]
    for key in ("lm_loss", "mtp_loss", "lr"):
        assert got[0][key] == full[2][key], (layout, key, got[0][key], full[2][key])
    assert got[1]["lr"] == full[3]["lr"]
    for key in ("lm_loss", "mtp_loss"):
        assert abs(got[1][key] - full[3][key]) <= _BF16_U * abs(full[3][key]), (layout, key, got[1], full[3])
    assert got[1]["grad_norm"] == pytest.approx(full[3]["grad_norm"], rel=_BF16_U)


def test_distributed_optimizer_keeps_fp32_params_in_fp32_across_dp_ranks(runs):
    saved, _ = runs
    ranks = [r["dp2"] for r in saved]
    for r in ranks:
        assert r["other_param_dtypes"] == ["torch.bfloat16"]
        init, final = r["keep_fp32_init"], r["keep_fp32_final"]
        for part in (".fn", ".base", ".scale", "attn_sink", ".ape"):  # mHC, sinks, compressor position biases
            assert any(part in n for n in final), part
        assert {str(p.dtype) for p in final.values()} == {"torch.float32"}
        # every keep-in-fp32 param was updated in fp32 by the sharded optimizer (each rank owns part of them)
        assert [n for n in final if torch.equal(final[n], init[n])] == []
    # the distributed optimizer's all-gather gives every DP rank the same fp32 values, not bf16-rounded ones
    for name, p in ranks[0]["keep_fp32_final"].items():
        assert torch.equal(p, ranks[1]["keep_fp32_final"][name]), name
        assert not torch.equal(p, p.bfloat16().float()), name
