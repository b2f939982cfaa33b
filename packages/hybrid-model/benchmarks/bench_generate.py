"""Cached generation on one GPU (issue 37): prefill and decode tokens/s, cache bytes per token and peak memory of
``hybrid_model.generation`` on flash-smoke shapes (bf16, random weights), side by side with Hugging Face
transformers' ``generate`` measured in the same process (``/work/shared/anchors/hf_generate.py``: its ``run`` and
``cfg``, imported from the folder given by ``--hf-anchors``).

    PYTHONPATH=<all packages/*/src> python3 packages/hybrid-model/benchmarks/bench_generate.py \
        --hf-anchors .bench/anchors --out DIR            # full: prefill 4K / 32K, decode batch 1 / 8 / 32
    ... --quick                                          # smoke: prefill 4K, decode batch 1 / 8, 16 tokens
    ... --device cpu --preset tiny --quick               # the script's logic on CPU (no HF, no CUDA graph)

Rows (ours): ``prefill`` = one ``CachedDecoder.extend`` of a batch-1 prompt (tokens/s = prompt tokens / time to the
prompt's logits, the median of 3; after an untimed prefill of the same length); ``decode`` = greedy steps after a prefill of ``--decode-prompt`` tokens per sequence (tokens/s =
new tokens of the whole batch per second; argmax on the device included), per decode mode: ``eager`` (host plans),
``static`` (``StaticDecodeStep``), ``graph`` (the static step as a CUDA graph, capture excluded). HF rows: its
``run(model, prompt_len, batch)`` (prefill = ``generate(max_new_tokens=1)``, decode = 64 tokens). Cache bytes per
token: ours (``generation_cache_bytes``, the marginal bytes of one more token at the prompt length) vs a dense
MLA-style cache (every attention layer keeps its ``c = head_dim`` shared K = V row for every token). Writes
``bench_generate.json`` to ``--out``.

``--speculative``: MTP speculative decoding against plain decoding, side by side in one table per batch and decode
mode (``--modes``; ``graph``: plain graph decode next to the static speculative step's CUDA graphs): greedy
``generate(..., decode=mode)`` and ``generate(..., decode=mode, speculative="mtp")`` of ``--new-tokens`` tokens
after a ``--decode-prompt`` prompt (decode-phase time: a whole ``generate`` minus a 4-token run's, which holds the
prefills and the graph capture), tokens/s, speed-up and the acceptance rate. With random weights the MTP head's drafts are almost never accepted:
that row is the worst case (the overhead of one 2-row verify + one MTP depth per token). ``--checkpoint DIR`` (an
HF DeepSeek-V4 directory, e.g. ``dsv4 convert`` output of a trained run) benchmarks a trained model instead of
random weights of ``--preset`` (prompts: random token ids either way). ``--accept-all`` zeroes the output head (shared
by the main model and the MTP depth): every logit is 0, both argmaxes are token 0, so every draft is accepted and the
speculative row shows the speed-up at 100% acceptance with the same kernels (the upper end; random weights give the
lower end). ``--speculative-only`` runs only the speculative rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from hybrid_model.generation import (
    CachedDecoder,
    SpeculationStats,
    StaticDecodeStep,
    generate,
    generation_cache_bytes,
)
from hybrid_model.hf import load_hf_checkpoint
from hybrid_model.hf.runtime import ensure_single_stage_parallel_state
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None


def dense_mla_bytes_per_token(cfg, itemsize: int) -> int:
    """Bytes per token of a dense MLA-style cache of ``cfg``: every attention layer keeps one ``c``-wide row."""
    return cfg.num_layers * cfg.head_dim * itemsize


def cache_rows(cfg, lengths: list[int], itemsize: int) -> list[dict]:
    """Per prompt length: our cache bytes per token (marginal, and total / length) vs the dense MLA-style cache."""
    dense = dense_mla_bytes_per_token(cfg, itemsize)
    rows = []
    for n in lengths:
        total = generation_cache_bytes(cfg, n, itemsize=itemsize)
        block = 128  # one HCA block: the marginal bytes of every layer kind are whole here
        marginal = (generation_cache_bytes(cfg, n + block, itemsize=itemsize) - total) / block
        rows.append(
            {
                "length": n,
                "ours_total_bytes": total,
                "ours_bytes_per_token": round(total / n, 1),
                "ours_marginal_bytes_per_token": round(marginal, 1),
                "dense_mla_bytes_per_token": dense,
                "dense_over_ours": round(dense * n / total, 2),
            }
        )
    return rows


#: timed prefills per length; the row reports their median (one prefill of 4K tokens is tens of ms: single samples
#: varied 3x between calls on one H100)
PREFILL_REPEATS = 3


def measure_prefill(model, length: int, device: torch.device, repeats: int = PREFILL_REPEATS) -> dict:
    ids = torch.randint(0, model.model_config.vocab_size, (length,)).tolist()
    _reset_peak(device)
    times = []
    for _ in range(repeats):
        dec = CachedDecoder(model, 1, length + 1)
        _sync(device)
        t0 = time.perf_counter()
        dec.extend([ids], last_only=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
        del dec
    dt = statistics.median(times)
    return {
        "prompt_len": length,
        "prefill_ms": round(dt * 1e3, 1),
        "prefill_ms_all": [round(t * 1e3, 1) for t in times],
        "prefill_tokens_per_s": round(length / dt, 1),
        "peak_gib": _peak_gib(device),
    }


#: untimed decode steps: they pass one CSA block completion ((n + 1) mod 4 = 0), so an eager step's first pooling
#: (Triton compilation / launch-config warm-up of the compressor kernels at decode shapes) is not timed (a static step
#: pools every step, so its warm-up always covered it)
WARMUP_STEPS = 4


def measure_decode(
    model, batch: int, prompt: int, new: int, mode: str, device: torch.device, warmup: int = WARMUP_STEPS
) -> dict:
    """Greedy decode of ``new`` tokens after a batch prefill; the first ``warmup`` steps (graph capture, warm-up)
    untimed. The steps are ``generate``'s: the argmax stays on the device (no host copy per step, ids not
    range-checked: sampled over the vocabulary)."""
    vocab = model.model_config.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt)).tolist()
    dec = CachedDecoder(model, batch, prompt + new + warmup)
    _reset_peak(device)
    last = torch.cat(dec.extend(prompts, last_only=True))  # [B, V]
    step = None if mode == "eager" else StaticDecodeStep(dec, cuda_graph=mode == "graph")

    def one(logits):
        tok = logits.argmax(-1)  # [B] on the device
        if step is not None:
            return step(tok, ids_checked=True)
        return dec.step(tok, ids_checked=True)  # [B, V] (what generate's eager steps run)

    for _ in range(warmup):
        last = one(last)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(new):
        last = one(last)
    _sync(device)
    dt = time.perf_counter() - t0
    return {
        "mode": mode,
        "batch": batch,
        "prompt_len": prompt,
        "decode_tokens_per_s": round(batch * new / dt, 1),
        "ms_per_step": round(dt / new * 1e3, 2),
        "warmup_steps": warmup,
        "peak_gib": _peak_gib(device),
    }


#: tokens of the short run whose time is subtracted from a speculative row's (prefill, drafter prefill, capture)
SPEC_BASE_TOKENS = 4


def measure_speculative(
    model, batch: int, prompt: int, new: int, device: torch.device, mode: str = "eager"
) -> dict:
    """Plain greedy vs MTP speculative greedy ``generate(..., decode=mode)`` on the same prompts: decode-phase
    tokens/s of each, ``batch (new - 4) / (t(new) - t(4))`` (a 4-token run's time subtracted: the prefill, the
    drafter's prefill and, for ``graph``, the capture), speed-up, acceptance rate, same tokens."""
    vocab = model.model_config.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt)).tolist()
    base = SPEC_BASE_TOKENS

    def timed(n: int, **kw):
        _sync(device)
        t0 = time.perf_counter()
        out = generate(model, prompts, n, decode=mode, **kw)
        _sync(device)
        return out, time.perf_counter() - t0

    # warm-up at the timed prompts' shapes (Triton compilation and autotuning of the prefill and decode kernels,
    # cached tables): a warm-up on shorter prompts left the prefill's compilation inside the 4-token base run, whose
    # time then exceeded the whole run's (negative decode time, H100 12-07)
    for spec_mode in (None, "mtp"):
        generate(model, prompts, base, decode=mode, speculative=spec_mode)
    t_base_plain = timed(base)[1]
    plain, t_plain = timed(new)
    t_base_spec = timed(base, speculative="mtp")[1]
    stats = SpeculationStats()
    spec, t_spec = timed(new, speculative="mtp", stats=stats)
    if t_plain <= t_base_plain or t_spec <= t_base_spec:
        raise RuntimeError(
            f"speculative row batch {batch}: a {base}-token run took longer than the {new}-token run "
            f"(plain {t_base_plain:.3f} vs {t_plain:.3f} s, mtp {t_base_spec:.3f} vs {t_spec:.3f} s): not warmed up"
        )
    plain_tps = batch * (new - base) / (t_plain - t_base_plain)
    spec_tps = batch * (new - base) / (t_spec - t_base_spec)
    return {
        "batch": batch,
        "prompt_len": prompt,
        "mode": mode,
        "plain_tokens_per_s": round(plain_tps, 1),
        "mtp_tokens_per_s": round(spec_tps, 1),
        "speedup": round(spec_tps / plain_tps, 3),
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "tokens_per_verify_step": round(sum(map(len, spec)) / max(stats.steps + 1, 1) / batch, 3),
        "same_tokens": spec == plain,
    }


def speculative_table(rows: list[dict]) -> str:
    head = ["batch", "prompt", "mode", "plain tok/s", "mtp tok/s", "speed-up", "acceptance", "same tokens"]
    cells = [head] + [
        [
            str(r.get("batch")),
            str(r.get("prompt_len")),
            str(r.get("mode")),
            *(
                [r.get("error", "")[:40], "", "", "", ""]
                if "error" in r
                else [
                    _fmt(r["plain_tokens_per_s"]),
                    _fmt(r["mtp_tokens_per_s"]),
                    f"{r['speedup']:.2f}x",
                    f"{100 * r['acceptance_rate']:.1f}%",
                    str(r["same_tokens"]),
                ]
            ),
        ]
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


def _guarded(fn, *args, **info) -> dict:
    try:
        return fn(*args)
    except Exception as e:  # a failed row is reported (OOM at 32K is a result), the rest still runs
        traceback.print_exc(limit=3)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {**info, "error": f"{type(e).__name__}: {str(e)[:300]}"}


def run_ours(args, device: torch.device) -> dict:
    torch.manual_seed(0)
    bf16 = device.type == "cuda"
    if args.checkpoint:
        model = load_hf_checkpoint(args.checkpoint, device)
        model = (model.bfloat16() if bf16 else model).eval()
    else:
        model = build_model(
            get_preset(args.preset), bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32
        )
        model = model.to(device).eval()
    cfg = model.model_config
    if args.accept_all:
        with torch.no_grad():
            model.output_layer.weight.zero_()  # every logit 0: main and MTP argmax both token 0
    measure_prefill(model, min(256, args.prefill_lens[0]), device, 1)  # warm-up (Triton compilation)
    out: dict = {"prefill": [], "decode": []}
    if args.speculative:
        out["speculative"] = []
        for b in args.batches:
            for mode in args.modes:
                row = _guarded(
                    measure_speculative,
                    model,
                    b,
                    args.decode_prompt,
                    args.new_tokens,
                    device,
                    mode,
                    batch=b,
                    mode=mode,
                )
                out["speculative"].append(
                    {"prompt_len": args.decode_prompt, "accept_all": args.accept_all, **row}
                )
                print(json.dumps({"speculative": row}), flush=True)
    if args.speculative_only:
        out["cache"] = []
        return out
    for n in args.prefill_lens:
        # untimed run at this length first: Triton kernels specialize on sizes (a compile must not be timed)
        _guarded(measure_prefill, model, n, device, 1, prompt_len=n)
        out["prefill"].append(_guarded(measure_prefill, model, n, device, prompt_len=n))
        print(json.dumps({"ours": out["prefill"][-1]}), flush=True)
    for b in args.batches:
        for mode in args.modes:
            row = _guarded(
                measure_decode,
                model,
                b,
                args.decode_prompt,
                args.new_tokens,
                mode,
                device,
                args.warmup_steps,
                mode=mode,
                batch=b,
            )
            out["decode"].append(row)
            print(json.dumps({"ours": row}), flush=True)
    out["cache"] = cache_rows(cfg, sorted({args.decode_prompt, *args.prefill_lens}), 2 if bf16 else 4)
    del model
    gc.collect()
    return out


def run_hf(args) -> dict:
    """HF transformers' ``generate`` from the anchors' ``run`` / ``cfg`` (same process, after ours is freed)."""
    folder = Path(args.hf_anchors).resolve()
    if not (folder / "hf_generate.py").is_file():
        raise SystemExit(f"--hf-anchors {folder}: no hf_generate.py there (copy /work/shared/anchors to it)")
    sys.path.insert(0, str(folder))
    import hf_generate  # the anchors' peer script (optional: only with --hf-anchors)
    from transformers import DeepseekV4ForCausalLM

    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(hf_generate.cfg()).to(device="cuda", dtype=torch.bfloat16).eval()
    rows = []
    for plen, batch in [(args.decode_prompt, b) for b in args.batches] + [
        (n, 1) for n in args.prefill_lens if n != args.decode_prompt
    ]:
        rows.append(_guarded(hf_generate.run, model, plen, batch, prompt_len=plen, batch=batch))
        print(json.dumps({"hf": rows[-1]}), flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"rows": rows}


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:,.1f}" if isinstance(v, float) else f"{v:,}")


def table(ours: dict, hf: dict | None, modes: list[str]) -> str:
    """One side-by-side table: ours per decode mode, HF, and the best of ours / HF."""
    hf_rows = (hf or {}).get("rows", [])

    def hf_get(plen, batch, key):
        return next(
            (r.get(key) for r in hf_rows if r.get("prompt_len") == plen and r.get("batch") == batch), None
        )

    head = ["metric", *[f"ours {m}" for m in modes], "HF", "best/HF (cache: dense/ours)"]
    lines = []
    for r in ours["prefill"]:
        v = r.get("prefill_tokens_per_s")
        hf_ms = hf_get(r["prompt_len"], 1, "prefill_ms")
        hv = round(r["prompt_len"] / hf_ms * 1e3, 1) if hf_ms else None
        lines.append(
            [
                f"prefill tok/s, {r['prompt_len']} tokens (any mode)",
                v,
                *[None] * (len(modes) - 1),
                hv,
                v / hv if v and hv else None,
            ]
        )
    for b in sorted({r["batch"] for r in ours["decode"]}):
        vals = [
            next(
                (r.get("decode_tokens_per_s") for r in ours["decode"] if r["batch"] == b and r["mode"] == m),
                None,
            )
            for m in modes
        ]
        plen = ours["decode"][0]["prompt_len"]
        hv = hf_get(plen, b, "decode_tokens_per_s")
        best = max((v for v in vals if v), default=None)
        lines.append(
            [f"decode tok/s, batch {b} (prompt {plen})", *vals, hv, best / hv if best and hv else None]
        )
        peaks = [
            next((r.get("peak_gib") for r in ours["decode"] if r["batch"] == b and r["mode"] == m), None)
            for m in modes
        ]
        lines.append([f"peak GiB, decode batch {b}", *peaks, hf_get(plen, b, "peak_gib"), None])
    for c in ours["cache"]:
        dense = c["dense_mla_bytes_per_token"]
        lines.append(
            [
                f"cache B/token at {c['length']}: total / length (dense MLA {dense:,})",
                c["ours_bytes_per_token"],
            ]
            + [None] * (len(modes) - 1)
            + [None, c["dense_over_ours"]]
        )
        lines.append(
            [f"cache B/token at {c['length']}: one more token (dense MLA {dense:,})"]
            + [c["ours_marginal_bytes_per_token"]]
            + [None] * (len(modes) - 1)
            + [None, round(dense / c["ours_marginal_bytes_per_token"], 2)]
        )
    cells = [head] + [
        [row[0], *(_fmt(round(v, 2) if isinstance(v, float) else v) for v in row[1:])] for row in lines
    ]
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(head))]
    return "\n".join(
        "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in cells
    )


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="flash-smoke")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument(
        "--hf-anchors", help="folder holding hf_generate.py and hf_train_step.py (default: no HF rows)"
    )
    p.add_argument("--prefill-lens", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--decode-prompt", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=WARMUP_STEPS,
        help="untimed decode steps before the timed ones (2 before issue 37's eager fix: no CSA pooling untimed)",
    )
    p.add_argument(
        "--modes", nargs="+", default=["eager", "static", "graph"], choices=["eager", "static", "graph"]
    )
    p.add_argument(
        "--speculative",
        action="store_true",
        help="also compare MTP speculative decoding with plain decoding (table: speed-up, acceptance rate)",
    )
    p.add_argument("--checkpoint", help="an HF DeepSeek-V4 directory to benchmark instead of random weights")
    p.add_argument(
        "--accept-all",
        action="store_true",
        help="zero the output head: every MTP draft is accepted (the speculative speed-up at 100%% acceptance)",
    )
    p.add_argument("--speculative-only", action="store_true", help="only the --speculative rows")
    p.add_argument("--quick", action="store_true", help="smoke: prefill 4K, batches 1 8, 16 new tokens")
    p.add_argument("--out", help="folder for bench_generate.json")
    args = p.parse_args(argv)
    if args.speculative and args.new_tokens <= SPEC_BASE_TOKENS:
        p.error(
            f"--speculative times tokens after the first {SPEC_BASE_TOKENS}: pass --new-tokens > {SPEC_BASE_TOKENS}"
        )
    if args.speculative_only and not args.speculative:
        p.error("--speculative-only needs --speculative")
    if args.quick:
        args.prefill_lens, args.batches, args.new_tokens = args.prefill_lens[:1], args.batches[:2], 16
    if args.device == "cpu":
        if args.hf_anchors:
            p.error("--hf-anchors needs --device cuda (HF's run is CUDA only)")
        args.modes = [m for m in args.modes if m != "graph"]
    elif not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU, or pass --device cpu (with a small --preset, e.g. tiny)")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    ensure_single_stage_parallel_state()
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    print(json.dumps(env), flush=True)
    ours = run_ours(args, device)
    hf = run_hf(args) if args.hf_anchors else None
    print(table(ours, hf, args.modes), flush=True)
    if args.speculative:
        print("\nMTP speculative decoding vs plain (greedy, same prompts, per decode mode)", flush=True)
        print(speculative_table(ours["speculative"]), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {"env": env, "args": vars(args), "ours": ours, "hf": hf}
        (out / "bench_generate.json").write_text(json.dumps(result, indent=1))
        print(f"wrote {out / 'bench_generate.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
