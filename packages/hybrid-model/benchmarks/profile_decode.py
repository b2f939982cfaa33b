"""Where the time of one decode step goes (issue 37): the static decode step (``StaticDecodeStep``, the math the CUDA
graph replays) of ``--preset`` (bf16, random weights) after a ``--prompt`` prefill at batch ``--batch``, run
eagerly under ``torch.profiler`` for ``--steps`` steps. Prints the GPU kernel time per step by module kind
(attention / MoE router, routed and shared experts, dispatch / mHC / norms / head / other: the innermost module
scope around the kernel's launch, see ``SCOPES``) and by kernel (top ``--top``), the kernels per step, and beside
it the replay time of the same step as a CUDA graph (wall ms per step) and the weight bytes one step must read
(every parameter but the embedding table, routed experts counted for the ``min(E, B * top_k)`` experts that can be
active) with the bandwidth that implies at the graph's step time::

    PYTHONPATH=<all packages/*/src> python3 packages/hybrid-model/benchmarks/profile_decode.py --out DIR

Without CUDA it runs ``--preset tiny`` on the CPU (a smoke test of the script: CPU op times, no graph).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from hybrid_model.generation import CachedDecoder, StaticDecodeStep
from hybrid_model.hf.runtime import ensure_single_stage_parallel_state
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset

SCOPES = {  # a module's last name -> its kind (the innermost scope around a kernel's launch wins)
    "embedding": "embedding",
    "self_attention": "attention",
    "mlp": "moe (dispatch, combine)",
    "router": "moe router",
    "experts": "moe routed experts",
    "shared_experts": "moe shared expert",
    "attn_hc": "mhc",
    "mlp_hc": "mhc",
    "expansion": "mhc",
    "hyper_head": "mhc",
    "input_layernorm": "norm",
    "pre_mlp_layernorm": "norm",
    "final_norm": "norm",
    "output_layer": "head",
}


def add_scopes(model) -> list:
    """Forward pre/post hooks that open a ``record_function("mod:KIND|NAME")`` around each module named in
    ``SCOPES``; returns the hook handles."""
    handles = []
    for name, module in model.named_modules():
        kind = SCOPES.get(name.rsplit(".", 1)[-1])
        if kind is None:
            continue
        scope = f"mod:{kind}|{name}"

        def pre(mod, args, scope=scope):
            mod._profile_scope = record_function(scope)
            mod._profile_scope.__enter__()

        def post(mod, args, out):
            mod._profile_scope.__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def kernels_by_scope(trace: dict) -> list[tuple[str, str, float]]:
    """``(kind, kernel name, µs)`` per GPU kernel of a chrome trace: the kernel's launch (the runtime or driver API event
    with the same correlation id: cuBLAS and aten launch through the runtime, Triton through the driver) lies in the innermost ``mod:`` annotation of its thread; ``other`` outside every scope."""
    events = trace["traceEvents"]
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e
    }
    scopes: dict = defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("mod:"):
            scopes[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"][4:].split("|")[0]))
    rows = []
    for e in events:
        if e.get("cat") != "kernel":
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        kind = "other"
        if launch is not None:
            inside = [s for s in scopes[launch["tid"]] if s[0] <= launch["ts"] <= s[1]]
            if inside:
                kind = min(inside, key=lambda s: s[1] - s[0])[2]
        rows.append((kind, e["name"], float(e["dur"])))
    return rows


def step_bytes(model, batch: int) -> int:
    """Bytes of weights one decode step reads at least: every parameter but the embedding table, with routed experts
    counted for ``min(E, batch * top_k)`` experts of each MoE layer instead of all ``E``."""
    cfg = model.model_config
    active = min(cfg.n_routed_experts, batch * cfg.num_experts_per_tok)
    total = 0
    for name, p in model.named_parameters():
        if "embedding" in name and "word_embeddings" in name:
            continue
        nbytes = p.numel() * p.element_size()
        if ".experts." in name and "shared" not in name:
            nbytes = nbytes * active // cfg.n_routed_experts
        total += nbytes
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None, help="default: flash-smoke on CUDA, tiny on CPU")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", help="folder for profile_decode.json")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    preset = args.preset or ("flash-smoke" if cuda else "tiny")
    if not cuda:
        args.prompt = min(args.prompt, 64)
    ensure_single_stage_parallel_state()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(get_preset(preset), bf16=cuda, params_dtype=dtype).to(device).eval()
    vocab = model.model_config.vocab_size
    prompts = torch.randint(0, vocab, (args.batch, args.prompt)).tolist()
    extra = 3 * args.steps + 8
    result: dict = {"preset": preset, "batch": args.batch, "prompt": args.prompt, "device": str(device)}
    if cuda:
        result["device"] = torch.cuda.get_device_name()

    # the eager static step under the profiler, every named module in a record_function scope
    dec = CachedDecoder(model, args.batch, args.prompt + extra)
    with torch.no_grad():
        last = torch.cat(dec.extend(prompts, last_only=True))  # [B, V]
        step = StaticDecodeStep(dec, cuda_graph=False)
        for _ in range(3):
            last = step(last.argmax(-1))
        handles = add_scopes(model)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                last = step(last.argmax(-1))
            if cuda:
                torch.cuda.synchronize()
        for h in handles:
            h.remove()
    if cuda:
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            rows = kernels_by_scope(json.loads(Path(f"{tmp}/trace.json").read_text()))
    else:  # no kernels: CPU self time of the aten ops, one row per op (the script's smoke test)
        rows = [
            ("cpu op", e.key, e.self_cpu_time_total)
            for e in prof.key_averages()
            if e.key.startswith("aten::")
        ]
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[tuple[str, str], float] = defaultdict(float)
    for kind, name, us in rows:
        by_kind[kind] += us / args.steps / 1e3  # ms per step
        by_name[(kind, name)] += us / args.steps / 1e3
    result["kernel_ms_per_step" if cuda else "cpu_op_ms_per_step"] = round(sum(by_kind.values()), 3)
    result["kernels_per_step"] = round(len(rows) / args.steps, 1)
    result["by_kind_ms"] = {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[: args.top]
    result["top"] = [{"kind": k, "name": n[:110], "ms": round(ms, 4)} for (k, n), ms in top]

    # the same step as a CUDA graph: wall time per replay
    if cuda:
        dec = CachedDecoder(model, args.batch, args.prompt + extra)
        with torch.no_grad():
            last = torch.cat(dec.extend(prompts, last_only=True))
            graph = StaticDecodeStep(dec, cuda_graph=True)
            for _ in range(3):
                last = graph(last.argmax(-1))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                last = graph(last.argmax(-1))
            torch.cuda.synchronize()
        result["graph_ms_per_step"] = round((time.perf_counter() - t0) / args.steps * 1e3, 3)
        nbytes = step_bytes(model, args.batch)
        result["weight_bytes_per_step"] = nbytes
        result["weight_gb_per_s_at_graph_time"] = round(nbytes / result["graph_ms_per_step"] / 1e6, 1)
    print(json.dumps({k: v for k, v in result.items() if k != "top"}, indent=1))
    print(f"{'ms/step':>9}  {'kind':24}  kernel")
    for row in result["top"]:
        print(f"{row['ms']:9.4f}  {row['kind']:24}  {row['name']}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile_decode.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
