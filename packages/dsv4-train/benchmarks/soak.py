"""Long-run soak of ``dsv4 train`` (issue 29): many tiny steps in one process with an evaluation and a checkpoint
save every ``--interval`` steps; resident memory (RSS), open file descriptors and threads are sampled after each
save, and their slopes after the warm-up are reported (a table and JSON).

    python packages/dsv4-train/benchmarks/soak.py --steps 2000 --interval 100 --out /tmp/soak \
        --json packages/dsv4-train/benchmarks/results/soak_cpu_DATE.json [--pattern W-]

CPU by default (the tiny preset; ``--pattern W-`` keeps one window-attention layer and MTP for a faster step);
``--keep-checkpoints`` keeps every ``iter_XXXXXXX`` (default: the script deletes all but the newest two after each
save, as a user with limited disk would, so that the directory listing does not grow). The slope is a
least-squares line through the samples from ``--warmup`` steps on, per 1,000 steps; ``flat`` means RSS grows less
than ``--rss-bound-mb`` per 1,000 steps and the fd and thread counts do not grow.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path


def rss_mb() -> float:
    """Resident memory of this process (MB, from /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def slope_per_1000(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``, per 1,000 of ``xs`` (0 for fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--interval", type=int, default=100, help="evaluate and save every N steps")
    p.add_argument("--warmup", type=int, default=500, help="steps before the slope is measured")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--pattern", default=None, help="layer pattern replacing tiny's (e.g. W- for a fast step)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", required=True, help="run directory (replaced)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--rss-bound-mb", type=float, default=5.0, help="RSS growth per 1,000 steps called flat")
    args = p.parse_args()

    from dsv4_train.config import TrainConfig
    from dsv4_train.trainer import Trainer

    samples: list[dict] = []
    started = time.perf_counter()

    class Sampled(Trainer):
        def save_checkpoint(self):
            path = super().save_checkpoint()
            if not args.keep_checkpoints:
                for old in sorted(self.checkpointer.dir.glob("iter_*"))[:-2]:
                    shutil.rmtree(old)
            if not samples or samples[-1]["step"] != self.step:
                s = dict(step=self.step, rss_mb=rss_mb(), fds=open_fds(), threads=threads())
                s["elapsed_s"] = time.perf_counter() - started
                samples.append(s)
                print(
                    f"soak: step {s['step']:>6} | rss {s['rss_mb']:8.1f} MB | fds {s['fds']:4d} | "
                    f"threads {s['threads']:3d} | {s['elapsed_s']:7.1f} s",
                    flush=True,
                )
            return path

    overrides = {"hybrid_layer_pattern": args.pattern} if args.pattern else {}
    tc = TrainConfig.from_flat(
        model_overrides=overrides,
        seq_len=args.seq_len,
        global_batch_size=1,
        micro_batch_size=1,
        warmup_steps=10,
        lr=args.lr,
        max_loss_growth=0,  # resources are measured here, not convergence: a loss spike must not stop the soak
        steps=args.steps,
        save_interval=args.interval,
        eval_interval=args.interval,
        eval_iters=2,
        progress=False,
        overwrite=True,
        out=args.out,
    )
    trainer = Sampled(tc)
    try:
        trainer.run()
    finally:
        trainer.close()

    late = [s for s in samples if s["step"] >= args.warmup]
    xs = [s["step"] for s in late]
    slopes = {k: slope_per_1000(xs, [s[k] for s in late]) for k in ("rss_mb", "fds", "threads")}
    growth = {k: late[-1][k] - late[0][k] for k in ("rss_mb", "fds", "threads")} if late else {}
    flat = (
        bool(late) and slopes["rss_mb"] < args.rss_bound_mb and growth["fds"] <= 0 and growth["threads"] <= 0
    )
    print(f"\n{'step':>6} {'RSS MB':>9} {'fds':>5} {'threads':>8} {'elapsed s':>10}")
    for s in samples:
        print(f"{s['step']:>6} {s['rss_mb']:>9.1f} {s['fds']:>5} {s['threads']:>8} {s['elapsed_s']:>10.1f}")
    print(
        f"after step {args.warmup}: RSS {slopes['rss_mb']:+.2f} MB per 1,000 steps, fds {slopes['fds']:+.2f}, "
        f"threads {slopes['threads']:+.2f} per 1,000 steps -> {'flat' if flat else 'GROWING'}"
    )
    result = {
        "benchmark": "dsv4-train soak",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores (shared)",
        "python": sys.version.split()[0],
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "json")},
        "samples": samples,
        "slope_per_1000_steps_after_warmup": slopes,
        "growth_after_warmup": growth,
        "flat": flat,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
