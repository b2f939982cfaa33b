"""The functional E2E case (D9): the CPU analogue of upstream's hybrid DSv4 functional test
(``hybrid_mr_mcore_te_tp1_pp2_dsv4_hybrid_mhc_mtp``), run through the ``dsv4`` CLI, and the comparison with its
committed golden values (``tests/data/functional_goldens.json``).

The case: the tiny preset (mHC n=4, CSA / HCA / window layers, hash-routed and learned MoE layers, one MTP depth),
mock variable-length data from the CLI (``--data mock:...``), packed THD batches through the dp-balanced scheduler,
a dense-attention warm-up step, evaluation on the separate mock stream, a checkpoint at step 2; then the run resumes
from that checkpoint and must repeat steps 3-4 bit for bit (the CPU kernels are deterministic). The per-step LM and
MTP losses and the evaluation losses are compared with the goldens within their relative tolerance.

Used by test_functional_goldens.py and ``tools/regen_functional_goldens.py`` (module-level code only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

GOLDENS = Path(__file__).parent / "data" / "functional_goldens.json"
#: the run; ``--out`` is appended
ARGV = [
    "train",
    "--preset",
    "tiny",
    "--data",
    "mock:docs=256,min=16,max=128,mean=64,sigma=1.0",
    "--packed",
    "--seq-len",
    "128",
    "--global-batch-size",
    "4",
    "--steps",
    "4",
    "--warmup-steps",
    "1",
    "--dense-steps",
    "1",
    "--lr",
    "3e-3",
    "--seed",
    "1234",
    "--save-interval",
    "2",
    "--no-save-final",
    "--eval-interval",
    "2",
    "--eval-iters",
    "1",
    "--no-progress",
]
TRAIN_KEYS = ("lm_loss", "mtp_loss")
EVAL_KEYS = ("eval_lm_loss", "eval_mtp_loss")

_RUNNER = """
import json, sys
from pathlib import Path
import torch
torch.set_num_threads(int(sys.argv[2]))
from dsv4_train.cli import main
from dsv4_train.outputs import read_metrics

out, argv = Path(sys.argv[1]), json.loads(sys.argv[3])
assert main([*argv, "--out", str(out)]) == 0
full = read_metrics(out / "metrics.jsonl")
(out / "checkpoints" / "latest").write_text("iter_0000002")
assert main([*argv, "--out", str(out), "--resume"]) == 0
resumed = read_metrics(out / "metrics.jsonl")
print("RESULT " + json.dumps({"full": full, "resumed": resumed}))
"""


def run_case(out: Path, threads: int) -> dict:
    """Run the case (and its resume) in a fresh process with ``threads`` intra-op threads; returns
    ``{"train": [{step, lm_loss, mtp_loss}], "eval": [{step, eval_lm_loss, eval_mtp_loss}], "resume_exact": bool}``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    script = out / "run_case.py"
    script.write_text(_RUNNER)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(
        [sys.executable, str(script), str(out / "run"), str(threads), json.dumps(ARGV)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the functional case failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT ") :])
    full, resumed = res["full"], res["resumed"]
    return {
        "train": [{"step": r["step"]} | {k: r[k] for k in TRAIN_KEYS} for r in full if not r.get("eval")],
        "eval": [{"step": r["step"]} | {k: r[k] for k in EVAL_KEYS} for r in full if r.get("eval")],
        "resume_exact": _strip_times(resumed) == _strip_times(full),
    }


def _strip_times(rows: list[dict]) -> list[dict]:
    """Rows without the wall-clock fields (throughput, MFU, step and evaluation times)."""
    drop = ("tokens_per_s", "mfu", "step_time_s", "eval_time_s")
    return [{k: v for k, v in r.items() if k not in drop} for r in rows]


def differences(golden: dict, got: dict, rel: float) -> list[str]:
    """One line per value of ``got`` outside ``rel`` of the golden (or missing / extra steps)."""
    lines = []
    for part, keys in (("train", TRAIN_KEYS), ("eval", EVAL_KEYS)):
        ref = {r["step"]: r for r in golden[part]}
        now = {r["step"]: r for r in got[part]}
        if sorted(ref) != sorted(now):
            lines.append(f"{part}: steps {sorted(now)} (golden: {sorted(ref)})")
            continue
        for step in sorted(ref):
            for k in keys:
                a, b = now[step][k], ref[step][k]
                err = abs(a - b) / max(abs(b), 1e-30)
                if err > rel:
                    lines.append(
                        f"{part} step {step} {k}: {a!r} (golden {b!r}, rel. diff {err:.2e} > {rel:.1e})"
                    )
    return lines


def max_relative_spread(a: dict, b: dict) -> float:
    """The largest relative difference between two runs' values (the run-to-run variation)."""
    spread = 0.0
    for part, keys in (("train", TRAIN_KEYS), ("eval", EVAL_KEYS)):
        for ra, rb in zip(a[part], b[part], strict=True):
            for k in keys:
                spread = max(spread, abs(ra[k] - rb[k]) / max(abs(rb[k]), 1e-30))
    return spread
