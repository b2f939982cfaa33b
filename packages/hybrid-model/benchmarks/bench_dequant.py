"""GPU dequantization of the released checkpoints' FP8 / FP4 weights: our Triton kernel, our fp32 reference on the
GPU, and transformers' ``Fp8Dequantize`` (the peer: the op transformers runs when it loads an FP8/FP4 checkpoint
with ``dequantize=True``), side by side in one run.

Shapes are DeepSeek-V4's: FP8 block-scaled linears (128 x 128 blocks, ue8m0 scales, an edge block in one case) and
FP4 routed-expert weights (groups of 32 along the input, ue8m0 scales), all to bf16. Each row: median ms
(``triton.testing.do_bench``), GB/s counting bytes read (codes + scales) and written (bf16), and the max |diff| of
each path against our reference (the kernel must be exact: the products ``code * 2**k`` are exact in bf16).

    python packages/hybrid-model/benchmarks/bench_dequant.py --out /tmp/bench_dequant
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers
import triton.testing

from hybrid_model.hf.quant.formats import scale_from_float
from hybrid_model.hf.quant.ops import dequantize_fp4, dequantize_fp8
from hybrid_model.hf.quant.reference import dequantize_fp4_ref, dequantize_fp8_ref

RESULTS = Path(__file__).parent / "results"

# (name, [out, in]) of block-scaled FP8 linears and FP4 experts (V4-Flash / V4-Pro sizes; one FP8 edge block)
FP8_SHAPES = [("wq_b V4-Flash", (32768, 1024)), ("wo_b V4-Pro", (7168, 16384)), ("edge", (4100, 4000))]
FP4_SHAPES = [("expert w1 V4-Flash", (2048, 4096)), ("64 experts w1 V4-Flash", (64 * 2048, 4096))]


def _ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=100, quantiles=[0.5])[0])


def _peer():
    """transformers' dequantize op (``Fp8Dequantize._dequantize_one``), or None where this transformers lacks it."""
    try:
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    except ImportError:
        return None
    op = Fp8Dequantize.__new__(Fp8Dequantize)
    return lambda q, s: op._dequantize_one(q, s, torch.bfloat16)


def _fp8_case(shape, dev):
    q = (torch.randn(shape, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = (-(-shape[0] // 128), -(-shape[1] // 128))
    s = scale_from_float(torch.exp2(torch.randint(-12, -4, grid, device=dev).float()), torch.float8_e8m0fnu)
    return q, s


def _fp4_case(shape, dev):
    packed = torch.randint(0, 256, (shape[0], shape[1] // 2), dtype=torch.uint8, device=dev)
    s = scale_from_float(torch.exp2(torch.randint(-12, -4, (shape[0], shape[1] // 32), device=dev).float()),
                         torch.float8_e8m0fnu)  # fmt: skip
    return packed.view(torch.int8), s


def _row(kind, name, shape, bytes_moved, paths, ref):
    row = {"kind": kind, "tensor": name, "shape": list(shape)}
    for label, fn in paths.items():
        if fn is None:
            row[label] = "unavailable"
            continue
        try:
            out = fn()
        except Exception as e:  # the peer's own limits (shapes its scale grid rule rejects)
            row[label] = f"failed: {type(e).__name__}: {str(e)[:120]}"
            continue
        ms = _ms(fn)
        row[label] = {
            "ms": round(ms, 4),
            "GB/s": round(bytes_moved / ms / 1e6, 1),
            "max_abs_diff_vs_ref": float((out.float() - ref.float()).abs().max()),
        }
    return row


def _fp8_paths(q, s, peer) -> dict:
    sf = s.view(torch.uint8)  # the peer reads E8M0 exponent bytes as uint8
    return {
        "ours_triton": lambda: dequantize_fp8(q, s, (128, 128), torch.bfloat16, backend="triton"),
        "ours_reference": lambda: dequantize_fp8_ref(q, s, (128, 128), torch.bfloat16),
        "transformers": None if peer is None else (lambda: peer(q, sf)),
    }


def _fp4_paths(p, s, peer) -> dict:
    sf = s.view(torch.uint8)
    return {
        "ours_triton": lambda: dequantize_fp4(p, s, 32, torch.bfloat16, backend="triton"),
        "ours_reference": lambda: dequantize_fp4_ref(p, s, 32, torch.bfloat16),
        "transformers": None if peer is None else (lambda: peer(p, sf)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench_dequant"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    peer = _peer()
    rows = []
    for name, shape in FP8_SHAPES:
        q, s = _fp8_case(shape, dev)
        moved = q.numel() + s.numel() + 2 * q.numel()
        rows.append(
            _row("fp8", name, shape, moved, _fp8_paths(q, s, peer), dequantize_fp8_ref(q, s, (128, 128)))
        )
    for name, shape in FP4_SHAPES:
        p, s = _fp4_case(shape, dev)
        moved = p.numel() + s.numel() + 2 * shape[0] * shape[1]
        rows.append(_row("fp4", name, shape, moved, _fp4_paths(p, s, peer), dequantize_fp4_ref(p, s, 32)))
        torch.cuda.empty_cache()
    payload = {
        "benchmark": "bench_dequant",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rows": rows,
    }
    print(
        f"{'kind':4} {'tensor':24} {'shape':>16} | {'ours triton':>20} | {'ours reference':>20} | {'transformers':>20}"
    )
    for r in rows:
        cells = []
        for k in ("ours_triton", "ours_reference", "transformers"):
            v = r[k]
            cells.append(f"{v['ms']:8.3f} ms {v['GB/s']:7.0f} GB/s" if isinstance(v, dict) else str(v)[:20])
        print(f"{r['kind']:4} {r['tensor']:24} {r['shape']!s:>16} | " + " | ".join(f"{c:>20}" for c in cells))
    for d in (args.out, RESULTS):
        d.mkdir(parents=True, exist_ok=True)
    gpu = "h200" if "H200" in payload["device"] else "h100"
    text = json.dumps(payload, indent=1)
    (args.out / f"bench_dequant_{gpu}.json").write_text(text)
    (RESULTS / f"bench_dequant_{gpu}.json").write_text(text)


if __name__ == "__main__":
    main()
