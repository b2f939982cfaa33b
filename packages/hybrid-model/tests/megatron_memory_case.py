"""Peak memory of the streamed HF -> megatron conversion on a synthetic checkpoint many times the bound.

``write_many_layer_checkpoint`` writes a bf16 checkpoint of the ``tiny`` preset made ``blocks`` deep and wider
(hidden 128, vocab 2048: the largest tensors are the embedding and the head, 2048 x 128), tensor by tensor.
Run as a script (``python megatron_memory_case.py SRC OUT [PP EP]``) it converts ``SRC`` in this fresh process:
first a plan alone (imports, the meta model, the plan's objects: ``plan_bytes``, the RSS it added), then the
conversion with the peak resident memory reset just before (``/proc/self/clear_refs``), and prints JSON with
``stream_peak`` = the conversion's peak RSS above the memory right before it.

Bound: ``12 bytes x largest tensor elements`` (one source tensor: stored bytes, its fp32 copy, a cast copy) plus
the plan of the conversion (a few hundred bytes per source tensor: ``plan_bytes``) plus :data:`SLACK_BYTES` for
the allocator's and ``torch.save``'s buffers and page granularity.
"""

from __future__ import annotations

import gc
import json
import re
import sys
import time
from pathlib import Path

import torch

#: allocator arenas, torch.save's zip writer and page rounding: fixed, independent of the checkpoint's size
SLACK_BYTES = 4 << 20


def tall_config(blocks: int):
    from hybrid_model.presets import get_preset

    tiny = get_preset("tiny")
    main = [tiny.compress_ratios[i % tiny.num_layers] for i in range(blocks)]
    return tiny.replace(
        name="tall",
        num_layers=blocks,
        compress_ratios=tuple(main),
        num_nextn_predict_layers=0,
        hidden_size=128,
        moe_intermediate_size=128,
        vocab_size=2048,
    )


def write_many_layer_checkpoint(root: Path, blocks: int) -> tuple[Path, int, int]:
    """``(dir, largest tensor elements, bytes on disk)`` of a bf16 checkpoint ``blocks`` deep (one tensor in
    memory at a time)."""
    from dsv4_testkit.megatron_cpu import megatron_cpu_context
    from hybrid_model.hf.config_map import hf_config_from_model_config
    from hybrid_model.hf.released import expected_shapes
    from hybrid_model.hf.safetensors_io import SafetensorsWriter

    cfg = tall_config(blocks)
    with megatron_cpu_context():
        shapes = expected_shapes(cfg)
    root.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    plan = {
        n: (torch.int64 if n.endswith("tid2eid") else torch.bfloat16, s) for n, s in sorted(shapes.items())
    }
    w = SafetensorsWriter(root / "model.safetensors", plan)
    for n, (dt, s) in plan.items():
        if dt == torch.int64:
            t = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: s[1]] for _ in range(s[0])])
        else:
            t = (torch.randn(s, generator=g) * 0.05).bfloat16()
        w.write(n, t)
    w.close()
    (root / "config.json").write_text(json.dumps(hf_config_from_model_config(cfg)))
    largest = max(torch.Size(s).numel() for s in shapes.values())
    return root, largest, (root / "model.safetensors").stat().st_size


def _status(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def measure(src: Path, out: Path, pp: int = 1, ep: int = 1) -> dict:
    from dsv4_testkit.megatron_cpu import megatron_cpu_context
    from hybrid_model.hf.megatron_layout import TargetLayout
    from hybrid_model.hf.megatron_plan import plan_megatron
    from hybrid_model.hf.stream_megatron import stream_to_megatron

    layout = TargetLayout(pp=pp, ep=ep)
    with megatron_cpu_context():
        before = _status("VmRSS")
        plan = plan_megatron(src, layout)
        plan_bytes = max(0, _status("VmRSS") - before)
        del plan
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        base = _status("VmRSS")
        t = time.perf_counter()
        rep = stream_to_megatron(src, out, layout)
        seconds = time.perf_counter() - t
        peak = _status("VmHWM") - base
    return {
        "plan_bytes": plan_bytes,
        "stream_peak": peak,
        "seconds": seconds,
        "bytes_read": rep.bytes_read,
        "gb_per_s": rep.gb_per_s,
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    extra = [int(x) for x in args[2:4]]
    print(json.dumps(measure(Path(args[0]), Path(args[1]), *extra)))
