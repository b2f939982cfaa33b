"""Streamed HF / released checkpoint -> megatron dist checkpoint (``torch_dist``) of a target parallel layout.

``stream_to_megatron(SRC, OUT, layout)`` reads the source one piece at a time (a whole tensor, or under ``--tp N``
only the box of it that the rank holds: :mod:`hybrid_model.hf.source_box`; FP8 / FP4 weights dequantized to fp32,
everything else cast to the checkpoint's dtype) and appends it, as its box of its checkpoint key, to the file of the
rank that owns it
(:mod:`hybrid_model.hf.megatron_plan`, :mod:`hybrid_model.hf.megatron_layout`); ``.metadata`` is written last
(:mod:`hybrid_model.hf.dist_format`). ``dsv4 train --init-from OUT`` then loads it at that layout reading only
its own rank's file (and the replicas of its stage), at any other layout through megatron's resharding.

Memory: one rank file is one job; a job holds one piece at a time: its stored bytes (+ scale), the fp32 result
and, when it must be cast, one copy: at most ``~12 bytes x elements`` of the largest piece (a whole source tensor
unless TP-split; fp32 sources: 8), plus the plan (a few hundred bytes per source tensor); ``workers`` jobs run at
once.

Safety: everything is written into ``.OUT.partial`` beside ``OUT`` and renamed to ``OUT`` only when complete, so a
failed or killed run never leaves a loadable half checkpoint. ``.OUT.partial/.dsv4-convert-progress.json``
records the finished rank files of the plan (its fingerprint: source files, layout, options); rerunning the same
command resumes after them, another command on the same ``OUT`` is refused (``overwrite`` discards the partial
run). ``finalize(dir)`` runs on the complete directory before the rename (``dsv4 convert`` writes its manifest
of checksums there).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hybrid_model.config import DSv4ModelConfig
from hybrid_model.hf.dist_format import DistcpWriter, StoredItem, distcp_name, write_metadata
from hybrid_model.hf.megatron_layout import TargetLayout
from hybrid_model.hf.megatron_plan import MegatronPlan, RankJob, plan_megatron
from hybrid_model.hf.released import logical_shape
from hybrid_model.hf.safetensors_io import SafetensorsFile
from hybrid_model.hf.source_box import read_source_box
from hybrid_model.hf.stream import StreamReport, progress_line

PROGRESS = ".dsv4-convert-progress.json"
MODEL_CONFIG_FILE = "dsv4_model_config.json"


def partial_dir(out: Path) -> Path:
    """The hidden sibling directory a conversion into ``out`` is written in."""
    return out.parent / f".{out.name}.partial"


def _write_json(path: Path, doc) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def _prepare(plan: MegatronPlan, out: Path, overwrite: bool) -> dict[int, list[StoredItem]]:
    """The partial directory of ``out`` ready for ``plan``: the finished rank files of an interrupted run of the
    same plan (their items), or a fresh directory. ``ValueError`` for an output or partial run in the way."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory; choose a directory path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        held = sorted(q.name for q in out.iterdir())
        raise ValueError(
            f"output directory {out} is not empty (holds {held[:4]}); choose a new or empty directory, or pass "
            "--overwrite (overwrite=True) to replace it once the conversion has succeeded"
        )
    part = partial_dir(out)
    prog = part / PROGRESS
    if part.exists():
        try:
            state = json.loads(prog.read_text())
        except (OSError, ValueError):
            state = None
        if state is not None and state.get("fingerprint") == plan.fingerprint:
            done = {int(r): [StoredItem.from_json(x) for x in rows] for r, rows in state["done"].items()}
            done = {r: items for r, items in done.items() if (part / distcp_name(r)).is_file()}
            for f in part.glob("__*_0.distcp"):
                if int(f.name[2:].split("_")[0]) not in done:
                    f.unlink()
            return done
        if not overwrite:
            raise ValueError(
                f"{part} holds an interrupted conversion into {out} with another source, layout or options: rerun "
                "that command to finish it, or pass --overwrite (overwrite=True) to discard it"
            )
        shutil.rmtree(part)
    out.parent.mkdir(parents=True, exist_ok=True)
    part.mkdir()
    _write_json(prog, {"fingerprint": plan.fingerprint, "done": {}})
    return {}


def _run_job(plan: MegatronPlan, job: RankJob, part: Path) -> list[StoredItem]:
    """Write rank ``job.rank``'s file, one source tensor at a time; returns where each item went."""
    files: dict[Path, SafetensorsFile] = {}
    w = DistcpWriter(part / distcp_name(job.rank))
    try:
        for p in job.pieces:
            f = plan.stored[p.src].file
            if f not in files:
                files[f] = SafetensorsFile(f)
            pair = plan.pairs.get(p.src)
            if pair is not None and plan.stored[pair.scale].file not in files:
                files[plan.stored[pair.scale].file] = SafetensorsFile(plan.stored[pair.scale].file)
            box = p.source_box(logical_shape(plan.stored[p.src], pair.kind if pair else None))
            t = read_source_box(files, plan.stored, p.src, pair, plan.quant, box, p.dtype).to(p.dtype)
            w.add_tensor(p.key, p.offset, (p.cut(t) if box is None else t.reshape(p.shape)).contiguous())
            del t
        for unique_key, data in job.objects:
            w.add_object(unique_key, data)
    except BaseException:
        w.abort()
        raise
    w.close()
    return w.stored


def _publish(part: Path, out: Path, overwrite: bool) -> None:
    fd = os.open(part, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if out.exists():
        if not overwrite and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"output {out} appeared during the conversion; {part} holds the result")
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(old / out.name)
        part.rename(out)
        shutil.rmtree(old)
    else:
        part.rename(out)


def stream_to_megatron(
    src: str | Path,
    out: str | Path,
    layout: TargetLayout | None = None,
    *,
    mtp: bool | None = None,
    common: dict | None = None,
    extra_config: Callable[[DSv4ModelConfig], dict] | None = None,
    workers: int = 1,
    overwrite: bool = False,
    finalize: Callable[[Path], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> StreamReport:
    """HF / released checkpoint directory ``src`` -> megatron dist checkpoint ``out`` for ``layout`` (default
    PP = VPP = EP = 1); see the module docstring. ``common``: the checkpoint's common state; ``extra_config(model
    config)``: entries added to ``dsv4_model_config.json`` (beside the model config and the layout)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    src, out = Path(src), Path(out)
    layout = layout or TargetLayout()
    s, o = src.resolve(), out.resolve()
    if s == o or s.is_relative_to(o) or o.is_relative_to(s):
        raise ValueError(
            f"output {out} and source {src} overlap; write the conversion to a separate directory"
        )
    plan = plan_megatron(src, layout, mtp=mtp, common=common)
    done = _prepare(plan, out, overwrite)
    part = partial_dir(out)
    todo = [j for j in plan.jobs if j.rank not in done]
    total = sum(j.read_bytes for j in todo)
    if progress is not None:
        progress(f"layout {layout.describe()}: {len(todo)} of {len(plan.jobs)} rank files to write")
    read, t0, lock = 0, time.perf_counter(), threading.Lock()

    def finished(job: RankJob, items: list[StoredItem]) -> None:
        nonlocal read
        with lock:
            done[job.rank] = items
            read += job.read_bytes
            rows = {str(r): [x.to_json() for x in v] for r, v in sorted(done.items())}
            _write_json(part / PROGRESS, {"fingerprint": plan.fingerprint, "done": rows})
            if progress is not None:
                line = progress_line(len(done), len(plan.jobs), read, total, time.perf_counter() - t0)
                progress(line.replace(" files,", " rank files,"))

    if workers == 1 or len(todo) <= 1:
        for j in todo:
            finished(j, _run_job(plan, j, part))
    else:
        with ThreadPoolExecutor(min(workers, len(todo))) as pool:  # reads, casts and writes release the GIL
            for j, items in zip(todo, pool.map(lambda j: _run_job(plan, j, part), todo)):
                finished(j, items)
    write_metadata(part, plan.tensors, list(plan.objects), [x for v in done.values() for x in v])
    layout_doc = {"pp": layout.pp, "vpp": layout.vpp, "ep": layout.ep, "tp": layout.tp}
    meta = {
        "model_config": plan.model_config.to_dict(),
        "layout": layout_doc,
        **(extra_config(plan.model_config) if extra_config else {}),
    }
    (part / MODEL_CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    (part / PROGRESS).unlink()
    if finalize is not None:
        finalize(part)
    _publish(part, out, overwrite)
    return StreamReport(len(plan.jobs), len(plan.jobs) - len(todo), read, time.perf_counter() - t0)
