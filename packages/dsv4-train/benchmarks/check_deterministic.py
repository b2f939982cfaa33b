"""``dsv4 train --deterministic`` on one GPU at flash-smoke shapes: two runs with the same seed must agree bit for
bit (every loss, every step's gradients, the final weights), eager and ``--cuda-graph``; and what it costs
(training tokens/s of the deterministic runs — the default with CUDA — against the atomic kernels of
``--no-deterministic``, same batches).

    PYTHONPATH=<all packages/*/src> python3 packages/dsv4-train/benchmarks/check_deterministic.py --out DIR

Six runs of the Trainer, each in its own process (``--steps`` 20 at ``--seq-len`` 4096, one sequence per step, sparse attention
from step 0, the MTP-weight recapture at the end of the 10-step warm-up): atomic eager (``--no-deterministic``),
deterministic eager twice (``--deterministic``, explicit), atomic graphed, deterministic graphed twice. Gradients are compared through an exact fingerprint of every
gradient buffer taken just before each optimizer step (two int64 sums over the fp32 bit patterns: the plain sum
and a position-weighted one; integer sums are exact, so any changed bit changes them). The weights after the last
step are fingerprinted the same way. Writes ``check_deterministic.json`` to --out (and prints a table). Exit 1 when
a deterministic pair differs. About 3-4 minutes on an H200 (Triton compiles included).

``CUBLAS_WORKSPACE_CONFIG=:4096:8`` is set for the whole process before torch loads (cuBLAS reads it once); the
atomic runs therefore use the same cuBLAS workspace as the deterministic ones (the timing compares the kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

from csa_kernels.ops.sparse_attn import launch_config

_DEV = (
    "cuda" if torch.cuda.is_available() else "cpu"
)  # CPU: a dry run of the script (--preset tiny --modes eager)
_PAIR_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_CHUNK = 1 << 26  # elements per fingerprint slice (bounds the int64 temporaries to ~1.5 GiB)


def _fingerprint(tensors) -> list[int]:
    """Exact fingerprint of the bits of ``tensors`` (any dtype): ``[Σ bits, Σ bits · (i mod 65521 + 1)]`` in int64
    over every element (wrap-around is fine: integer addition in any order gives the same bits)."""
    plain = torch.zeros((), dtype=torch.int64, device=_DEV)
    weighted = torch.zeros((), dtype=torch.int64, device=_DEV)
    views = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
    for t in tensors:
        if t is None:
            continue
        flat = t.detach().contiguous().reshape(-1).view(views[t.element_size()])
        for c0 in range(0, flat.numel(), _CHUNK):
            bits = flat[c0 : c0 + _CHUNK].to(device=_DEV, dtype=torch.int64)
            w = torch.arange(c0, c0 + bits.numel(), device=_DEV, dtype=torch.int64) % 65521 + 1
            plain += bits.sum()
            weighted += (bits * w).sum()
    return [int(plain), int(weighted)]


def _run(name: str, out: Path, args, *, deterministic: bool, graph: bool) -> dict:
    from dsv4_train.config import TrainConfig
    from dsv4_train.trainer import Trainer

    tc = TrainConfig.from_flat(
        preset=args.preset,
        steps=args.steps,
        seq_len=args.seq_len,
        global_batch_size=1,
        micro_batch_size=1,
        lr=3e-4,
        min_lr=3e-5,
        warmup_steps=10,
        seed=args.seed,
        cuda_graph=graph,
        deterministic=deterministic,
        out=str(out / name),
        overwrite=True,
        progress=False,
        save_final=False,
    )
    t0 = time.perf_counter()
    trainer = Trainer(tc)
    grads: list[list[int]] = []
    fingerprint_s: list[float] = []  # taken out of the step times below
    params = [p for p in trainer.core.parameters() if p.requires_grad]
    step = trainer.optimizer.step

    def fingerprinted_step(
        *a, **kw
    ):  # the gradients of this step, after finalize_model_grads, before the update
        if _DEV == "cuda":
            torch.cuda.synchronize()
        f0 = time.perf_counter()
        grads.append(_fingerprint(getattr(p, "main_grad", p.grad) for p in params))
        fingerprint_s.append(time.perf_counter() - f0)
        return step(*a, **kw)

    trainer.optimizer.step = fingerprinted_step
    try:
        metrics = trainer.run()
        weights = _fingerprint(v for v in trainer.core.state_dict().values() if isinstance(v, torch.Tensor))
    finally:
        trainer.close()
    wall = time.perf_counter() - t0
    skip = 3 if graph else 2  # warm-up / capture steps are not timed
    tps = [
        m["tokens_per_s"] * m["step_time_s"] / (m["step_time_s"] - f)
        for m, f in zip(metrics[skip:], fingerprint_s[skip:], strict=True)
        if not graph or m.get("cuda_graph_replayed")
    ]
    keys = ("lm_loss", "mtp_loss", "balance_loss", "indexer_loss", "grad_norm")
    row = {
        "losses": [[m.get(k) for k in keys] for m in metrics],
        "grads": grads,
        "weights": weights,
        "tokens_per_s": statistics.median(tps) if tps else None,
        "wall_s": wall,
        "fingerprint_ms_per_step": 1e3 * statistics.median(fingerprint_s) if fingerprint_s else None,
    }
    print(
        f"{name:>16}: {len(metrics)} steps, lm loss {metrics[0]['lm_loss']:.4f} -> {metrics[-1]['lm_loss']:.4f}, "
        f"median {row['tokens_per_s'] or float('nan'):,.0f} tok/s, {wall:.0f} s",
        flush=True,
    )
    return row


def _run_child(name: str, args, *, deterministic: bool, graph: bool) -> dict:
    """:func:`_run` in a fresh process: each run starts from an empty GPU (a Trainer's memory is not all returned
    to the allocator in-process, and the second flash-smoke run of one process ran out of memory on the H200) and
    from a fresh cuBLAS / Triton state, as two separate ``dsv4 train`` invocations would."""
    cmd = [
        sys.executable,
        __file__,
        "--out",
        args.out,
        "--steps",
        str(args.steps),
        "--seq-len",
        str(args.seq_len),
    ]
    cmd += [
        "--seed",
        str(args.seed),
        "--preset",
        args.preset,
        "--pair-dtype",
        args.pair_dtype,
        "--child",
        f"{name}:{int(deterministic)}:{int(graph)}",
    ]
    subprocess.run(cmd, check=True)
    return json.loads((Path(args.out) / name / "row.json").read_text())


def _first_difference(a: dict, b: dict) -> str | None:
    for key in ("losses", "grads"):
        for i, (x, y) in enumerate(zip(a[key], b[key], strict=True)):
            if x != y:
                return f"{key} differ first at step {i + 1}: {x} vs {y}"
    if a["weights"] != b["weights"]:
        return "final weights differ"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--preset", default="flash-smoke")
    ap.add_argument("--modes", nargs="+", choices=("eager", "graph"), default=["eager", "graph"])
    ap.add_argument(
        "--pair-dtype",
        choices=tuple(_PAIR_DTYPES),
        default="fp32",
        help="the deterministic sparse-attention dkv's pair rows (csa-kernels launch_config.PAIR_DTYPE)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)  # NAME:DETERMINISTIC:GRAPH, one run in this process
    args = ap.parse_args()
    launch_config.PAIR_DTYPE = _PAIR_DTYPES[args.pair_dtype]
    if args.child:
        name, det, graph = args.child.split(":")
        row = _run(name, Path(args.out), args, deterministic=det == "1", graph=graph == "1")
        (Path(args.out) / name / "row.json").write_text(json.dumps(row) + "\n")
        return 0
    if not torch.cuda.is_available() and "graph" in args.modes:
        print(
            "check_deterministic: --cuda-graph needs a CUDA device (CPU dry run: --modes eager)",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for mode in args.modes:
        graph = mode == "graph"
        runs[f"{mode}_atomic"] = _run_child(f"{mode}_atomic", args, deterministic=False, graph=graph)
        for k in ("a", "b"):
            runs[f"{mode}_det_{k}"] = _run_child(f"{mode}_det_{k}", args, deterministic=True, graph=graph)
    verdict = {}
    for mode in args.modes:
        diff = _first_difference(runs[f"{mode}_det_a"], runs[f"{mode}_det_b"])
        atomic_vs_det = _first_difference(runs[f"{mode}_atomic"], runs[f"{mode}_det_a"])
        tps_d, tps_0 = runs[f"{mode}_det_a"]["tokens_per_s"], runs[f"{mode}_atomic"]["tokens_per_s"]
        verdict[mode] = {
            "bitwise_identical": diff is None,
            "difference": diff,
            "atomic_equals_deterministic": atomic_vs_det is None,
            "tokens_per_s_atomic": tps_0,
            "tokens_per_s_deterministic": tps_d,
            "deterministic_over_atomic": tps_d / tps_0 if tps_d and tps_0 else None,
        }
    both = len(args.modes) == 2
    eager_vs_graph = _first_difference(runs["eager_det_a"], runs["graph_det_a"]) if both else "not run"
    report = {
        "device": torch.cuda.get_device_name() if _DEV == "cuda" else "cpu",
        "torch": torch.__version__,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "pair_dtype": args.pair_dtype,
        "runs_compared": "atomic = --no-deterministic (csa-kernels' fp32-atomic dkv / dk); det = --deterministic",
        "verdict": verdict,
        "deterministic_eager_equals_graph": eager_vs_graph is None,
        "eager_vs_graph_difference": eager_vs_graph,
        "runs": runs,
    }
    (out / "check_deterministic.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{'mode':6} {'bitwise 2 runs':>15} {'atomic tok/s':>14} {'determ. tok/s':>14} {'ratio':>6}")
    nan = float("nan")  # no timed step (runs shorter than the warm-up)
    for mode, v in verdict.items():
        ratio = v["deterministic_over_atomic"]
        print(
            f"{mode:6} {'yes' if v['bitwise_identical'] else 'NO':>15} {v['tokens_per_s_atomic'] or nan:>14,.0f} "
            f"{v['tokens_per_s_deterministic'] or nan:>14,.0f} {ratio or nan:>6.3f}"
            + (f"   {v['difference']}" if v["difference"] else "")
        )
    print(f"deterministic eager == graphed: {eager_vs_graph is None} ({eager_vs_graph or 'every step'})")
    print(f"written: {out / 'check_deterministic.json'}")
    return 0 if all(v["bitwise_identical"] for v in verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
