"""Where the activation peak of a long-context full step sits (issue #33): flash-smoke, full recompute + optimizer CPU
offload (``long_context``'s ``offload-full`` setting), one ``[1, S]`` sequence per S.

Per S: a warm-up step; a step with a phase timeline (forward pre/post hooks on every mHC layer, the MTP depth, the
output layer and the optimizer step: the peak of ``max_memory_allocated`` between consecutive events; a layer's
second forward is its recomputation in backward); a step under ``torch.cuda.memory._record_memory_history`` whose
snapshot :mod:`memory_peak_analysis` reads (live blocks at the peak by allocating frame and phase). Writes
``memory_peak_S.txt`` (and, with ``--save-snapshot``, the snapshot pickle) to ``--out``::

    python3 packages/dsv4-train/benchmarks/memory_peak.py --seq-lens 8192 16384 --out DIR

Without CUDA it runs the tiny preset with the timeline only (a smoke test of this script: no memory numbers).
"""

from __future__ import annotations

import argparse
import os
import pickle
import time
from pathlib import Path

import long_context
import torch
from memory_peak_analysis import report

GIB = 2**30


class PhaseTimeline:
    """Forward pre/post hooks on the named modules and a wrapper of the optimizer step: each event records the peak
    allocated bytes since the previous event (``max_memory_allocated``, reset at every event) and the bytes allocated
    now. ``bwd`` marks events inside the autograd engine (a full-recompute chunk's recomputation)."""

    def __init__(self, core, optimizer) -> None:
        self.events: list[tuple[str, float, float]] = []
        self.handles = []
        self.cuda = torch.cuda.is_available()
        for name, module in core.named_modules():
            if self._watched(name):
                self.handles.append(module.register_forward_pre_hook(self._hook(f"{name} >")))
                self.handles.append(module.register_forward_hook(self._hook(f"{name} <")))
        step = optimizer.step

        def timed(*a, **k):
            self.mark("optimizer >")
            out = step(*a, **k)
            self.mark("optimizer <")
            return out

        optimizer.step = timed
        self._restore = lambda: setattr(optimizer, "step", step)

    @staticmethod
    def _watched(name: str) -> bool:
        parts = name.split(".")
        return (
            (len(parts) == 3 and parts[0] in ("decoder", "mtp") and parts[1] in ("layers", "block"))
            or name in ("mtp", "output_layer", "decoder.hyper_head", "embedding")
            or (len(parts) == 3 and parts[0] == "mtp" and parts[1] == "layers")
        )

    def _hook(self, label: str):
        def hook(*_args):
            self.mark(label)

        return hook

    def mark(self, label: str) -> None:
        bwd = torch._C._current_autograd_node() is not None
        if self.cuda:
            peak, now = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            peak = now = 0
        self.events.append((("bwd " if bwd else "") + label, peak / GIB, now / GIB))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self._restore()

    def text(self, top: int = 12) -> str:
        rows = [f"{i:4d} {peak:8.2f} {now:8.2f}  {label}" for i, (label, peak, now) in enumerate(self.events)]
        worst = sorted(range(1, len(self.events)), key=lambda i: -self.events[i][1])[:top]
        head = [
            "peak between consecutive events (GiB; 'peak' is the max allocated since the previous event):",
            *(
                f"  {self.events[i][1]:8.2f}  between [{self.events[i - 1][0]}] and [{self.events[i][0]}]"
                for i in worst
            ),
            "all events: index, peak since previous (GiB), allocated now (GiB), event",
        ]
        return "\n".join(head + rows)


def profile_point(run, s: int, out: Path, save_snapshot: bool) -> str:
    batch = long_context._batch(run.model_config.vocab_size, s, run.device)
    run.step(s, batch)  # warm-up
    timeline = PhaseTimeline(run.parts.core, run.optimizer)
    try:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        run.step(s, batch)
        dt = time.perf_counter() - t0
    finally:
        timeline.close()
    text = [f"S = {s}: timeline step {dt:.2f} s", timeline.text()]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        try:
            run.step(s, batch)
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        peak = torch.cuda.max_memory_allocated()
        text.insert(
            1,
            f"max_memory_allocated of the recorded step: {peak / GIB:.2f} GiB (start {base / GIB:.2f} GiB); "
            f"{(peak - base) / (s / 1024) / GIB:.3f} GiB per 1K tokens above the start\n"
            + report(snap, seq_len=s, base_bytes=base),
        )
        if save_snapshot:
            with open(out / f"memory_peak_{s}.pickle", "wb") as f:
                pickle.dump(snap, f)
        del snap
    return "\n".join(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-lens", type=int, nargs="*", default=[8192, 16384])
    ap.add_argument("--setting", default="offload-full", choices=list(long_context.SETTINGS))
    ap.add_argument("--out", default="memory_peak_out")
    ap.add_argument("--save-snapshot", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    setting = args.setting if cuda or "offload" not in args.setting else "full"
    run = long_context._Run(setting, "flash-smoke" if cuda else "tiny")
    for s in args.seq_lens if cuda else [64]:
        text = (
            f"setting {setting}, device {torch.cuda.get_device_name() if cuda else 'cpu'}\n"
            + profile_point(run, s, out, args.save_snapshot)
        )
        (out / f"memory_peak_{s}.txt").write_text(text)
        print(text, flush=True)


if __name__ == "__main__":
    main()
