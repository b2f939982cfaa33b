"""Bytes read and wall time of ``dsv4 convert --to megatron --tp 1 | 2 | 4`` (issue 32: each TP rank's piece reads
only its box of a source tensor, so a TP N conversion reads the source once, not N times per split tensor).

Builds a synthetic DeepSeek-V4 checkpoint (the ``tiny`` preset widened so that TP 4 splits it: ``--hidden``,
``--vocab``, ``--ffn``; 8 heads, 4 output groups) with ``bench_stream_convert.write_synthetic_plain`` and exports it
to the released FP8 / FP4 format, then converts it into the megatron layouts TP1, TP2, TP4, each in a fresh
process: wall and CPU time of ``stream_to_megatron`` and the bytes it read (the process's ``rchar`` from
``/proc/self/io``, every ``read``/``pread`` counted). ``--baseline SRC`` runs the same conversions with another
checkout's ``hybrid_model`` first on ``PYTHONPATH`` (the code before issue 32) for comparison, alternating with
this code ``--repeat`` times per TP size (the 2 shared CPU cores' load varies). Writes
``results/tp_convert.json``.

    .venv/bin/python packages/hybrid-model/benchmarks/bench_tp_convert.py --out /tmp/bench_tp \
        [--baseline /path/to/old/packages/hybrid-model/src]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_stream_convert import write_synthetic_plain

from dsv4_testkit.megatron_cpu import megatron_cpu_context
from hybrid_model.hf.stream import quantize_checkpoint
from hybrid_model.presets import get_preset

RESULTS = Path(__file__).parent / "results" / "tp_convert.json"

_CHILD = """
import json, resource, sys, time
from dsv4_testkit.megatron_cpu import megatron_cpu_context
from hybrid_model.hf.megatron_layout import TargetLayout
from hybrid_model.hf.stream_megatron import stream_to_megatron

def rchar():
    return int(open("/proc/self/io").read().split("rchar:")[1].split()[0])

src, dst, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
with megatron_cpu_context():
    u = resource.getrusage(resource.RUSAGE_SELF)
    r0, t = rchar(), time.perf_counter()
    rep = stream_to_megatron(src, dst, TargetLayout(tp=tp))
    dt, r1, v = time.perf_counter() - t, rchar(), resource.getrusage(resource.RUSAGE_SELF)
cpu = v.ru_utime + v.ru_stime - u.ru_utime - u.ru_stime
print(json.dumps({"seconds": dt, "cpu_seconds": cpu, "rchar": r1 - r0, "planned_read": rep.bytes_read}))
"""


def run_child(src: Path, dst: Path, tp: int, pythonpath: str | None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    shutil.rmtree(dst, ignore_errors=True)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(dst), str(tp)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    shutil.rmtree(dst, ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/bench_tp")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--shard-mb", type=int, default=64)
    ap.add_argument("--baseline", help="hybrid-model src directory of the code to compare with")
    ap.add_argument("--repeat", type=int, default=2, help="runs per code and TP (wall times vary under load)")
    ap.add_argument("--reuse", action="store_true", help="reuse OUT/released of an earlier run")
    a = ap.parse_args()
    root = Path(a.out)
    cfg = get_preset("tiny").replace(
        name="bench-tp",
        hidden_size=a.hidden,
        num_attention_heads=8,
        head_dim=128,
        q_lora_rank=a.hidden // 2,
        o_groups=4,
        o_lora_rank=a.hidden // 4,
        moe_intermediate_size=a.ffn,
        vocab_size=a.vocab,
    )
    if not (a.reuse and (root / "released" / "config.json").is_file()):
        shutil.rmtree(root, ignore_errors=True)
        t = time.perf_counter()
        plain, _ = write_synthetic_plain(root, cfg, a.shard_mb << 20)
        with megatron_cpu_context():
            quantize_checkpoint(plain, root / "released", max_shard_bytes=a.shard_mb << 20)
        shutil.rmtree(plain)
        print(f"synthetic checkpoint built in {time.perf_counter() - t:.1f} s")
    src = root / "released"
    src_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    rows = []
    codes = [("baseline", a.baseline)] if a.baseline else []
    codes.append(("this", None))
    for tp in (1, 2, 4):
        for rep in range(a.repeat):  # the codes alternate, so both see the same load
            for code, path in codes:
                r = run_child(src, root / "mg", tp, path)
                r.update(
                    code=code, tp=tp, repeat=rep, src_bytes=src_bytes, read_x_source=r["rchar"] / src_bytes
                )
                rows.append(r)
                print(
                    f"{code:<9} TP{tp}: read {r['rchar'] / 1e6:8.1f} MB ({r['read_x_source']:.2f} x source "
                    f"{src_bytes / 1e6:.1f} MB), {r['seconds']:6.1f} s wall, {r['cpu_seconds']:6.1f} s CPU",
                    flush=True,
                )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {"machine": "2 shared CPU cores, no GPU", "config": vars(a), "rows": rows},
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
