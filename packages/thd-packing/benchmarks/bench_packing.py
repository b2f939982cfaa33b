"""Data-side throughput and DP balance of the packing pipeline (host code: runs the same on the GPU box's CPU).

Measures, per configuration:
- the DP load imbalance ``max / mean`` of per-DP-rank ``sum len^2`` (attention work) for the dp-balanced assignment
  vs upstream's round-robin dealing (``balance='none'``), averaged over iterations of lognormal mock lengths;
- scheduler time per iteration;
- ``PackedBatchIterator`` throughput (real tokens per second of built THD microbatches, static shapes, one rank).

Correctness first: every schedule is checked to cover each document exactly once before anything is timed.
Runs with ``torch.set_num_threads(1)``, as in a DataLoader worker: the pipeline's tensors are small and OpenMP
fan-out only adds overhead (badly so on a shared, oversubscribed host).
Usage: ``python3 packages/thd-packing/benchmarks/bench_packing.py --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from thd_packing import (
    BatchConfig,
    DpBalancedScheduler,
    MockVarlenConfig,
    MockVarlenDataset,
    PackedBatchIterator,
    SchedulerConfig,
    default_corpus_dataset,
)

CONFIGS = [
    dict(name="L4k-cp1-dp8", L=4096, cp=1, dp=8, seq=4096, gbs=256),
    dict(name="L8k-cp2-dp4", L=8192, cp=2, dp=4, seq=16384, gbs=128),
    dict(name="L16k-cp4-dp8", L=16384, cp=4, dp=8, seq=65536, gbs=128),
]


def _check(schedule, lengths) -> None:
    seen = np.zeros(len(lengths), dtype=np.int64)
    for rank in schedule.microbatches:
        assert len(rank) == schedule.num_microbatches
        for pack in rank:
            assert pack.num_padded_tokens <= schedule.config.capacity
            for p in pack.pieces:
                seen[p.doc] += p.length
    assert np.array_equal(seen, np.asarray(lengths)), "schedule does not cover every token exactly once"


def _imbalance(schedule) -> float:
    loads = [sum(p.seqlen_squared_sum for p in rank) for rank in schedule.microbatches]
    return max(loads) / (sum(loads) / len(loads))


def bench_scheduler(cfg: dict, iterations: int) -> dict:
    lengths_all = MockVarlenDataset(
        MockVarlenConfig(
            seq_length=cfg["seq"], min_len=64, mean_len=cfg["seq"] / 4, num_samples=100_000, seed=0
        )
    ).lengths
    out = {}
    for balance in ("seqlen_squared", "none"):
        sc = SchedulerConfig(
            max_seqlen_per_dp_cp_rank=cfg["L"], cp_size=cfg["cp"], dp_size=cfg["dp"], balance=balance
        )
        sched = DpBalancedScheduler(sc)
        imb, times = [], []
        for it in range(iterations):
            lengths = lengths_all[it * cfg["gbs"] : (it + 1) * cfg["gbs"]].tolist()
            t0 = time.perf_counter()
            s = sched.schedule(lengths)
            times.append(time.perf_counter() - t0)
            _check(s, lengths)
            imb.append(_imbalance(s))
        out[balance] = dict(imbalance=float(np.mean(imb)), ms_per_iter=1e3 * float(np.median(times)))
    return out


def bench_iterator(dataset, cfg: dict, iterations: int) -> float:
    bc = BatchConfig(global_batch_size=cfg["gbs"], max_seqlen_per_dp_cp_rank=cfg["L"], cp_size=cfg["cp"])
    it = PackedBatchIterator(dataset, bc)
    next(it)  # warm-up
    tokens, t0 = 0, time.perf_counter()
    for _ in range(iterations):
        tokens += next(it).num_real_tokens
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--iterations", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for cfg in CONFIGS:
        res = bench_scheduler(cfg, args.iterations)
        rows.append(dict(config=cfg["name"], **{f"{k}_{m}": v for k, r in res.items() for m, v in r.items()}))
    corpus = default_corpus_dataset(4096)
    mock = MockVarlenDataset(MockVarlenConfig(seq_length=8192, num_samples=10_000))
    thr = {
        "default_corpus_L4k_cp1": bench_iterator(corpus, dict(gbs=32, L=4096, cp=1), 5),
        "mock_L8k_cp2": bench_iterator(mock, dict(gbs=32, L=8192, cp=2), 5),
    }
    print(f"{'config':<16} {'imbalance balanced':>19} {'imbalance round-robin':>22} {'sched ms/iter':>14}")
    for r in rows:
        print(
            f"{r['config']:<16} {r['seqlen_squared_imbalance']:>19.3f} {r['none_imbalance']:>22.3f} "
            f"{r['seqlen_squared_ms_per_iter']:>14.2f}"
        )
    for k, v in thr.items():
        print(f"iterator {k:<26} {v / 1e6:8.2f} M real tokens/s (one rank, static shapes)")
    result = dict(
        bench="packing",
        host=platform.node(),
        python=platform.python_version(),
        scheduler=rows,
        iterator_tokens_per_s=thr,
    )
    for d in (args.out, Path(__file__).parent / "results"):
        d.mkdir(parents=True, exist_ok=True)
        (d / "bench_packing.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
