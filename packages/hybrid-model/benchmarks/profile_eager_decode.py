"""Where an EAGER decode step's host time goes (issue 37), with hash-moe's routed-expert kernels on and off.

flash-smoke (bf16, random weights) on one GPU: a 4,096-token prefill at batch 1, 6 untimed ``CachedDecoder.step``
calls, 16 timed ones (``eager_ms_per_step``), for ``routed_max_rows`` = 0 (grouped GEMM) and 256 (routed kernels),
each twice in alternation (the spread between the two runs of one setting is the noise); the second run of each
setting then profiles 4 more steps under ``torch.profiler`` (CPU + CUDA) and prints the top ops by self CPU time
and by total CPU time::

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 packages/hybrid-model/benchmarks/profile_eager_decode.py

Result of 2026-12-07 (H100): ``results/profile_eager_decode_h100_2026-12-07.log``. CUDA only.
"""

from __future__ import annotations

import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hybrid_model.generation import CachedDecoder
from hybrid_model.hf.runtime import ensure_single_stage_parallel_state
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset

PROMPT, WARMUP, TIMED, PROFILED = 4096, 6, 16, 4


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("profile_eager_decode: needs a CUDA device")
    torch.cuda.set_device(0)
    ensure_single_stage_parallel_state()
    torch.manual_seed(0)
    model = build_model(get_preset("flash-smoke"), bf16=True, params_dtype=torch.bfloat16).cuda().eval()
    experts = [m for m in model.modules() if hasattr(m, "routed_max_rows")]
    print("routed expert modules:", len(experts))
    prompt = torch.randint(0, model.model_config.vocab_size, (1, PROMPT)).tolist()
    runs: dict[int, int] = {}
    with torch.no_grad():
        for rows in (0, 256, 0, 256):
            for m in experts:
                m.routed_max_rows = rows
            dec = CachedDecoder(model, 1, PROMPT + WARMUP + TIMED + PROFILED + 1)
            last = torch.cat(dec.extend(prompt, last_only=True))  # [1, V]
            for _ in range(WARMUP):
                last = dec.step(last.argmax(-1), ids_checked=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(TIMED):
                last = dec.step(last.argmax(-1), ids_checked=True)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / TIMED * 1e3
            print(json.dumps({"routed_max_rows": rows, "eager_ms_per_step": round(ms, 2)}), flush=True)
            runs[rows] = runs.get(rows, 0) + 1
            if runs[rows] == 2:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(PROFILED):
                        last = dec.step(last.argmax(-1), ids_checked=True)
                    torch.cuda.synchronize()
                averages = prof.key_averages()
                print(f"=== routed_max_rows={rows}: top ops by self CPU time ({PROFILED} steps)")
                print(averages.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
                print(f"=== routed_max_rows={rows}: top by CPU total")
                print(averages.table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))
            del dec


if __name__ == "__main__":
    main()
