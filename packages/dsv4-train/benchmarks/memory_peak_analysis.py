"""What holds the GPU memory peak of a step: the live blocks at the peak of a ``torch.cuda.memory._snapshot()``
taken with ``torch.cuda.memory._record_memory_history`` (issue #33), grouped by the allocating frame in our code or
megatron, with the phase of the step each was allocated in. Pure Python (no CUDA): :mod:`memory_peak` runs it on the
GPU; a saved snapshot pickle can be read again with ``python3 memory_peak_analysis.py SNAPSHOT.pickle``.
"""

from __future__ import annotations

import pickle
import sys
from collections import defaultdict
from dataclasses import dataclass

# frames of these files are wrappers (module call machinery, autograd plumbing): never the "owner" of a block
_GENERIC = (
    "torch/nn/modules/module.py",
    "torch/autograd/function.py",
    "torch/utils/_contextlib.py",
    "torch/_compile.py",
    "torch/_dynamo",
    "contextlib.py",
    "functools.py",
)
_OURS = ("/packages/", "megatron/")


@dataclass(frozen=True)
class Block:
    """A live allocation: its bytes, the owning frame (``file:line function``) and the phase it was allocated in."""

    size: int
    owner: str
    phase: str


def _short(filename: str) -> str:
    for marker in ("/src/", "site-packages/", "/benchmarks/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename.rsplit("/", 2)[-1] if "/" in filename else filename


def owner_of(frames: list[dict]) -> str:
    """The innermost frame of our packages or megatron (else the innermost non-wrapper frame) of an allocation's
    Python stack (innermost first), as ``file:line function``; no Python frame: the C++ autograd engine."""
    if not frames:
        return "<no Python frame: autograd engine (C++ backward of a built-in op)>"
    for pick in (
        lambda f: any(o in f["filename"] for o in _OURS),
        lambda f: not any(g in f["filename"] for g in _GENERIC),
    ):
        for f in frames:
            if pick(f):
                return f"{_short(f['filename'])}:{f['line']} {f['name']}"
    f = frames[0]
    return f"{_short(f['filename'])}:{f['line']} {f['name']}"


def phase_of(frames: list[dict]) -> str:
    """The step phase of an allocation: ``optimizer``, ``recompute+backward`` (inside a checkpoint's backward: the
    recomputed forward and its own backward), ``forward``, ``backward`` (autograd engine), else ``other``."""
    names = [(f["filename"], f["name"]) for f in frames]
    if any("optimizer" in fn and name in ("step", "step_with_ready_grads") for fn, name in names):
        return "optimizer"
    if any(name == "backward" and ("random.py" in fn or "checkpoint" in fn) for fn, name in names):
        return "recompute+backward"
    if any(name in ("backward", "backward_step") for _fn, name in names):
        return "backward"
    if any(name in ("forward_step", "forward") for _fn, name in names):
        return "forward"
    return "backward" if not frames else "other"


def live_at_peak(trace: list[dict]) -> tuple[int, int, list[Block], list[dict]]:
    """Replay a device trace (``alloc`` / ``free_completed`` events): (peak bytes above the start, event index of the
    peak, the blocks live then, the frames of the last allocations before it (newest first))."""
    live: dict[int, dict] = {}
    cur = peak = 0
    peak_i = -1
    peak_live: dict[int, dict] = {}
    for i, ev in enumerate(trace):
        action = ev["action"]
        if action == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > peak:
                peak, peak_i = cur, i
                peak_live = dict(live)
        elif action == "free_completed" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]
    blocks = [
        Block(ev["size"], owner_of(ev.get("frames", [])), phase_of(ev.get("frames", [])))
        for ev in peak_live.values()
    ]
    recent = [ev for ev in trace[: peak_i + 1] if ev["action"] == "alloc"][-5:][::-1]
    return peak, peak_i, blocks, recent


def report(snapshot: dict, *, seq_len: int | None = None, top: int = 15, base_bytes: int = 0) -> str:
    """The text report of one snapshot: the peak, the phase at the peak, the top ``top`` owners of the live bytes (and
    per phase), bytes per token when ``seq_len`` is given. ``base_bytes``: allocated when recording started."""
    trace = snapshot["device_traces"][0] if snapshot.get("device_traces") else []
    peak, peak_i, blocks, recent = live_at_peak(trace)
    gib = 2**30
    lines = [
        f"peak: {(base_bytes + peak) / gib:.2f} GiB ({base_bytes / gib:.2f} GiB allocated before the recorded step "
        f"+ {peak / gib:.2f} GiB allocated in it), at event {peak_i} of {len(trace)}"
        + (f"; {peak / (seq_len / 1024) / gib:.3f} GiB per 1K tokens" if seq_len else "")
    ]
    if recent:
        lines.append(f"phase at the peak: {phase_of(recent[0].get('frames', []))}; the last allocations:")
        for ev in recent:
            lines.append(f"  {ev['size'] / 2**20:10.1f} MiB  {owner_of(ev.get('frames', []))}")
            chain = [
                f"{_short(f['filename'])}:{f['line']} {f['name']}"
                for f in ev.get("frames", [])
                if any(o in f["filename"] for o in _OURS)
            ]
            if chain:
                lines.append("      stack: " + " <- ".join(chain[:8]))
    by_owner: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    by_phase: dict[str, int] = defaultdict(int)
    for b in blocks:
        by_owner[(b.owner, b.phase)][0] += b.size
        by_owner[(b.owner, b.phase)][1] += 1
        by_phase[b.phase] += b.size
    lines.append("live bytes at the peak by phase of allocation:")
    for ph, size in sorted(by_phase.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {size / gib:8.3f} GiB  {ph}")
    per_tok = "  B/token" if seq_len else ""
    lines.append(f"top {top} owners of the live bytes at the peak (GiB, blocks{per_tok}, phase, frame):")
    for (own, ph), (size, count) in sorted(by_owner.items(), key=lambda kv: -kv[1][0])[:top]:
        tok = f" {size / seq_len:9.0f}" if seq_len else ""
        lines.append(f"  {size / gib:8.3f} {count:5d}{tok}  {ph:<18} {own}")
    if (
        seq_len
    ):  # sequence-sized blocks: bytes per token says the shape ([S, n*d] fp32 = 16·d bytes per token, ...)
        by_tok: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        for b in blocks:
            if b.size >= seq_len:
                by_tok[round(b.size / seq_len)][0] += b.size
                by_tok[round(b.size / seq_len)][1] += 1
        lines.append(f"live blocks of at least S bytes by bytes per token (top {top}: B/token, blocks, GiB):")
        for per, (size, count) in sorted(by_tok.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"  {per:9d} {count:5d} {size / gib:8.3f}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """``python3 memory_peak_analysis.py SNAPSHOT.pickle [SEQ_LEN]``: print the report of a saved snapshot."""
    with open(argv[0], "rb") as f:
        snap = pickle.load(f)
    print(report(snap, seq_len=int(argv[1]) if len(argv) > 1 else None))


if __name__ == "__main__":
    main(sys.argv[1:])
