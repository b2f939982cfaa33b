"""Streamed conversion of a released-format checkpoint: peak memory against the stated bound, and GB/s.

Builds a synthetic DeepSeek-V4 checkpoint (the ``tiny`` preset widened: ``--hidden``, ``--experts``, ``--vocab``)
tensor by tensor (random bf16 weights, never the whole model in memory), exports it to the released FP8 / FP4
format with ``quantize_checkpoint``, then runs ``dequantize_checkpoint`` (released -> bf16) and the export back
(bf16 -> released, ``like=`` the source) each in a fresh process, measuring its peak resident memory above the
process's memory right before the conversion, next to the checkpoint sizes and the bound (3 x 4 bytes x the
largest tensor's elements, per worker). Writes ``results/stream_convert.json``.

    .venv/bin/python packages/hybrid-model/benchmarks/bench_stream_convert.py --out /tmp/bench_stream
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from dsv4_testkit.megatron_cpu import megatron_cpu_context
from hybrid_model.hf.config_map import hf_config_from_model_config
from hybrid_model.hf.released import expected_shapes
from hybrid_model.hf.safetensors_io import SafetensorsWriter
from hybrid_model.hf.stream import quantize_checkpoint
from hybrid_model.presets import get_preset

RESULTS = Path(__file__).parent / "results" / "stream_convert.json"


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.glob("*.safetensors"))


def write_synthetic_plain(root: Path, cfg, shard_bytes: int) -> tuple[Path, int]:
    """A bf16 plain checkpoint of ``cfg`` written tensor by tensor; returns (dir, largest tensor elements)."""
    with megatron_cpu_context():
        shapes = expected_shapes(cfg)
    plain = root / "plain"
    plain.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    names = sorted(shapes)
    shards, cur, size = [], [], 0
    for n in names:
        b = 2 * int(torch.tensor(shapes[n]).prod()) if shapes[n] else 2
        if cur and size + b > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += b
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        plan = {}
        for n in shard:
            dt = torch.int64 if n.endswith("tid2eid") else torch.bfloat16
            plan[n] = (dt, shapes[n])
        w = SafetensorsWriter(plain / fname, plan)
        for n in shard:
            if n.endswith("tid2eid"):
                t = torch.stack(
                    [
                        torch.randperm(cfg.n_routed_experts, generator=g)[: shapes[n][1]]
                        for _ in range(shapes[n][0])
                    ]
                )
            else:
                t = (torch.randn(shapes[n], generator=g) * 0.05).bfloat16()
            w.write(n, t)
            weight_map[n] = fname
        w.close()
    (plain / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (plain / "config.json").write_text(json.dumps(hf_config_from_model_config(cfg)))
    largest = max(int(torch.tensor(s).prod()) for s in shapes.values() if s)
    return plain, largest


_CHILD = """
import json, resource, sys, time
from pathlib import Path
from dsv4_testkit.megatron_cpu import megatron_cpu_context
from hybrid_model.hf.stream import dequantize_checkpoint, quantize_checkpoint
mode, src, dst, like, workers = sys.argv[1:6]
with megatron_cpu_context():
    base = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
    t = time.perf_counter()
    if mode == "dequantize":
        rep = dequantize_checkpoint(src, dst, workers=int(workers))
    else:
        rep = quantize_checkpoint(src, dst, like=like, workers=int(workers))
    dt = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base_rss": base, "peak_rss": peak, "seconds": dt, "bytes_read": rep.bytes_read}))
"""


def run_child(mode: str, src: Path, dst: Path, like: Path | None, workers: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(src), str(dst), str(like or ""), str(workers)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/bench_stream")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--shard-mb", type=int, default=64)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--reuse", action="store_true", help="reuse OUT/plain and OUT/released of an earlier run")
    a = ap.parse_args()
    root = Path(a.out)
    cfg = get_preset("tiny").replace(
        name="bench",
        hidden_size=a.hidden,
        moe_intermediate_size=a.hidden,
        n_routed_experts=a.experts,
        vocab_size=a.vocab,
    )
    t = time.perf_counter()
    if a.reuse and (root / "released" / "config.json").is_file():
        with megatron_cpu_context():
            largest = max(int(torch.tensor(s).prod()) for s in expected_shapes(cfg).values() if s)
        for d in ("bf16", "back"):
            shutil.rmtree(root / d, ignore_errors=True)
    else:
        shutil.rmtree(root, ignore_errors=True)
        plain, largest = write_synthetic_plain(root, cfg, a.shard_mb << 20)
        with megatron_cpu_context():
            quantize_checkpoint(plain, root / "released", max_shard_bytes=a.shard_mb << 20)
        print(f"synthetic checkpoint built in {time.perf_counter() - t:.1f} s")
    bound = 3 * 4 * largest * a.workers
    rows = []
    for mode, src, dst, like in (
        ("dequantize", root / "released", root / "bf16", None),
        ("quantize", root / "bf16", root / "back", root / "released"),
    ):
        r = run_child(mode, src, dst, like, a.workers)
        r.update(
            mode=mode,
            src_bytes=_dir_bytes(src),
            dst_bytes=_dir_bytes(dst),
            peak_above_base=r["peak_rss"] - r["base_rss"],
            bound=bound,
            gb_per_s=r["bytes_read"] / r["seconds"] / 1e9,
            workers=a.workers,
        )
        rows.append(r)
    print(
        f"{'mode':<11} {'src GB':>8} {'dst GB':>8} {'shard MB':>8} {'peak-base MB':>13} {'bound MB':>9} {'GB/s':>7}"
    )
    for r in rows:
        print(
            f"{r['mode']:<11} {r['src_bytes'] / 1e9:8.3f} {r['dst_bytes'] / 1e9:8.3f} {a.shard_mb:8d} "
            f"{r['peak_above_base'] / 2**20:13.1f} {r['bound'] / 2**20:9.1f} {r['gb_per_s']:7.3f}"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": "2 shared CPU cores, no GPU",
                "config": vars(a),
                "largest_tensor_elements": largest,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
