"""Streamed, resumable conversions between released (FP8 / FP4) and plain checkpoint directories.

``dequantize_checkpoint(SRC, DST)``: every FP8 / FP4 weight of a released directory dequantized (``dtype``, bf16 by
default), scales dropped, every other tensor copied as stored; same shard files, names and index; ``config.json``
without its ``quantization_config``. ``quantize_checkpoint(SRC, DST)``: a plain directory in the released format;
``like=RELEASED_DIR`` takes the layout (shards, names, dtypes, which weights are quantized, scale spelling) and the
scales as hints (:mod:`hybrid_model.hf.quant.reference`) from that directory, so import then export reproduces it
byte for byte; without ``like`` the default rule (:func:`default_quantized`) applies and names are official.

Memory: one output file is one job; a job reads one source tensor at a time with a plain read (no mmap), converts
it and appends it to the output file, whose header was written first (:mod:`hybrid_model.hf.safetensors_io`). A
job holds at most one source tensor, its scale, the converted tensor and fp32 temporaries (about 4 bytes per element
of the largest tensor, x 3): the bound depends on the largest tensor, not on shard or checkpoint size; ``workers``
jobs run at once (threads: reading, converting and writing release the GIL; fork-started processes deadlock
in torch's thread pools, spawned ones pay a full import each). Resumable: ``DST/.dsv4-convert-progress.json`` lists the finished files of a plan;
rerunning the same conversion skips them (files are written as ``NAME.partial`` and renamed when complete); the
index, ``config.json`` and removal of the progress file come last.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid_model.hf.io import INDEX, read_config
from hybrid_model.hf.quant.formats import QuantConfig, fp4_scale_shape, fp8_scale_shape, scale_from_float
from hybrid_model.hf.quant.reference import quantize_fp4_ref, quantize_fp8_ref
from hybrid_model.hf.released import Quantized, check_inventory, dequantize_stored, quant_config_of, scan
from hybrid_model.hf.safetensors_io import SafetensorsFile, SafetensorsWriter

PROGRESS = ".dsv4-convert-progress.json"
#: official suffixes quantized by default (FP8; routed experts FP4 with ``expert_dtype: fp4``)
_FP8_SUFFIXES = (
    "attn.wq_a.weight",
    "attn.wq_b.weight",
    "attn.wkv.weight",
    "attn.wo_a.weight",
    "attn.wo_b.weight",
    "attn.indexer.wq_b.weight",
    "ffn.shared_experts.w1.weight",
    "ffn.shared_experts.w2.weight",
    "ffn.shared_experts.w3.weight",
    "e_proj.weight",
    "h_proj.weight",
)


@dataclass(frozen=True)
class Item:
    """One output tensor: ``op`` ``copy`` (cast to ``dtype``), ``dequant`` (``src`` + ``scale``), ``quant`` (weight,
    then its ``scale`` output ``scale_out``; ``kind`` fp8/fp4; ``hint`` = scale name in the ``like`` directory)."""

    out: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    op: str
    src: str
    scale: str | None = None
    kind: str | None = None
    scale_out: tuple[str, torch.dtype, tuple[int, ...]] | None = None
    hint: str | None = None


@dataclass(frozen=True)
class Job:
    file: str
    items: tuple[Item, ...]
    read_bytes: int


@dataclass(frozen=True)
class Ctx:
    src: Path
    like: Path | None
    quant: QuantConfig | None
    backend: str


def default_quantized(official: str, quant: QuantConfig) -> str | None:
    """``"fp8"`` / ``"fp4"`` / ``None``: how the default export stores the official tensor ``official``."""
    if ".ffn.experts." in official:
        return quant.expert_dtype
    return "fp8" if official.endswith(_FP8_SUFFIXES) else None


def _scale_dtype(quant: QuantConfig) -> torch.dtype:
    return torch.float8_e8m0fnu if quant.scale_fmt == "ue8m0" else torch.float32


def _quant_item(out, src, kind, quant, shape, wdtype, scale_name, scale_dtype, hint=None) -> Item:
    stored = shape if kind == "fp8" else (shape[0], shape[1] // 2)
    grid = (
        fp8_scale_shape(shape, quant.fp8_block) if kind == "fp8" else fp4_scale_shape(stored, quant.fp4_block)
    )
    return Item(
        out, wdtype, stored, "quant", src, kind=kind, scale_out=(scale_name, scale_dtype, grid), hint=hint
    )


def _nbytes(dtype, shape) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= d
    return n


def plan_dequantize(src: Path, dtype: torch.dtype) -> tuple[list[Job], dict]:
    _, quant, stored, pairs, _ = check_inventory(src)
    if quant is None:
        raise ValueError(f"{src}: config.json has no quantization_config; the checkpoint is not quantized")
    scales = {p.scale for p in pairs.values()}
    jobs = []
    for f in sorted({s.file for s in stored.values()}):
        items, nbytes = [], 0
        for name in sorted(n for n, s in stored.items() if s.file == f and n not in scales):
            s, p = stored[name], pairs.get(name)
            nbytes += _nbytes(s.dtype, s.shape)
            if p is None:
                items.append(Item(name, s.dtype, s.shape, "copy", name))
            else:
                shape = s.shape if p.kind == "fp8" else (s.shape[0], 2 * s.shape[1])
                items.append(Item(name, dtype, shape, "dequant", name, scale=p.scale, kind=p.kind))
                nbytes += _nbytes(stored[p.scale].dtype, stored[p.scale].shape)
        jobs.append(Job(f.name, tuple(items), nbytes))
    config = {k: v for k, v in read_config(src).items() if k != "quantization_config"}
    return jobs, config


def plan_quantize(
    src: Path, like: Path | None, quant: QuantConfig, max_shard_bytes: int
) -> tuple[list[Job], dict]:
    _, q_src, stored, pairs, official = check_inventory(src)
    if q_src is not None or pairs:
        raise ValueError(f"{src} is already quantized (quantization_config); dequantize it first or copy it")
    config = dict(read_config(src))
    jobs: list[Job] = []
    if like is not None:
        _, quant, l_stored, l_pairs, l_official = check_inventory(like)
        if quant is None:
            raise ValueError(
                f"--like {like}: config.json has no quantization_config (not a released checkpoint)"
            )
        lost, extra = sorted(set(l_official) - set(official)), sorted(set(official) - set(l_official))
        if lost or extra:
            raise ValueError(
                f"{src} and --like {like} hold different tensors: missing {lost[:6]}, extra {extra[:6]} "
                "(export without --like, or from the model imported from that checkpoint)"
            )
        by_stored = {v: k for k, v in l_official.items()}
        scales = {p.scale for p in l_pairs.values()}
        for f in sorted({s.file for s in l_stored.values()}):
            items, nbytes = [], 0
            for name in sorted(n for n, s in l_stored.items() if s.file == f and n not in scales):
                s, p = l_stored[name], l_pairs.get(name)
                src_name = official[by_stored[name]]
                nbytes += _nbytes(stored[src_name].dtype, stored[src_name].shape)
                if p is None:
                    items.append(Item(name, s.dtype, s.shape, "copy", src_name))
                else:
                    sc = l_stored[p.scale]
                    shape = stored[src_name].shape
                    items.append(
                        _quant_item(name, src_name, p.kind, quant, shape, s.dtype, p.scale, sc.dtype, p.scale)
                    )
            jobs.append(Job(f.name, tuple(items), nbytes))
    else:
        groups: list[list[Item]] = [[]]
        size = 0
        for off in sorted(official):
            name, s = official[off], stored[official[off]]
            kind = default_quantized(off, quant) if len(s.shape) == 2 else None
            if kind is None:
                item, n = Item(off, s.dtype, s.shape, "copy", name), _nbytes(s.dtype, s.shape)
            else:
                wdtype = torch.float8_e4m3fn if kind == "fp8" else torch.int8
                scale = off[: -len(".weight")] + ".scale"
                item = _quant_item(off, name, kind, quant, s.shape, wdtype, scale, _scale_dtype(quant))
                n = _nbytes(item.dtype, item.shape)
            if groups[-1] and size + n > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(item)
            size += n
        for i, g in enumerate(groups):
            fname = (
                "model.safetensors"
                if len(groups) == 1
                else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            )
            jobs.append(
                Job(fname, tuple(g), sum(_nbytes(stored[it.src].dtype, stored[it.src].shape) for it in g))
            )
    config["quantization_config"] = quant.to_hf()
    return jobs, config


def _outputs(job: Job) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    out = {}
    for it in job.items:
        out[it.out] = (it.dtype, it.shape)
        if it.scale_out is not None:
            out[it.scale_out[0]] = (it.scale_out[1], it.scale_out[2])
    return out


def run_job(job: Job, ctx: Ctx, dst: Path) -> tuple[str, int]:
    """Write one output file (``dst/NAME.partial``, renamed when complete); returns ``(name, bytes read)``."""
    stored, files = scan(ctx.src)
    hints: dict[str, SafetensorsFile] = {}
    if ctx.like is not None:
        l_stored, l_files = scan(ctx.like)
        hints = {n: l_files[st.file] for n, st in l_stored.items()}
    part = dst / f"{job.file}.partial"
    w = SafetensorsWriter(part, _outputs(job))
    for it in job.items:
        if it.op == "copy":
            w.write(it.out, files[stored[it.src].file].read(it.src).to(it.dtype))
        elif it.op == "dequant":
            pair = Quantized(it.scale, it.kind)
            w.write(
                it.out,
                dequantize_stored(
                    files, stored, it.src, pair, ctx.quant, it.dtype, backend=ctx.backend
                ).cpu(),
            )
        else:
            q, sc = _quantize(files[stored[it.src].file].read(it.src), it, ctx.quant, hints)
            w.write(it.out, q)
            w.write(it.scale_out[0], sc)
    w.close()
    part.rename(dst / job.file)
    return job.file, job.read_bytes


def _quantize(
    w: torch.Tensor, it: Item, quant: QuantConfig, hints: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    hint = hints[it.hint].read(it.hint) if it.hint is not None else None
    if it.kind == "fp8":
        q, s = quantize_fp8_ref(w, quant.fp8_block, quant.scale_fmt, scale_hint=hint)
    else:
        q, s = quantize_fp4_ref(w, quant.fp4_block, quant.scale_fmt, scale_hint=hint)
        q = q.view(it.dtype) if it.dtype != torch.uint8 else q
    return q, scale_from_float(s, it.scale_out[1])


def _plan_key(jobs: list[Job], config: dict, ctx: Ctx) -> str:
    text = json.dumps(
        [str(ctx.src.resolve()), str(ctx.like), config]
        + [[j.file, [[i.out, str(i.dtype), list(i.shape), i.op, i.src] for i in j.items]] for j in jobs],
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def _prepare(dst: Path, key: str, overwrite: bool) -> set[str]:
    """The finished files of an interrupted run of the same plan in ``dst`` (``dst`` created if new)."""
    prog = dst / PROGRESS
    if dst.is_dir() and any(dst.iterdir()):
        state = json.loads(prog.read_text()) if prog.is_file() else None
        if state is not None and state.get("plan") == key:
            for p in dst.glob("*.partial"):
                p.unlink()
            return {f for f in state.get("done", []) if (dst / f).is_file()}
        if not overwrite:
            what = "an interrupted conversion with other settings" if state else "other files"
            raise ValueError(
                f"output directory {dst} holds {what}; choose a new or empty directory, or pass --overwrite "
                "(overwrite=True) to replace it"
            )
        shutil.rmtree(dst)
    dst.mkdir(parents=True, exist_ok=True)
    prog.write_text(json.dumps({"plan": key, "done": []}))
    return set()


def progress_line(done: int, total: int, read: int, read_total: int, elapsed: float) -> str:
    """``3/46 files, 12.40/160.00 GB read, 1.23 GB/s, ETA 1:52``"""
    rate = read / elapsed if elapsed > 0 else 0.0
    eta = (read_total - read) / rate if rate > 0 else float("nan")
    eta_s = f"{int(eta // 60)}:{int(eta % 60):02d}" if eta == eta else "?"
    return f"{done}/{total} files, {read / 1e9:.2f}/{read_total / 1e9:.2f} GB read, {rate / 1e9:.3f} GB/s, ETA {eta_s}"


@dataclass(frozen=True)
class StreamReport:
    files: int
    skipped: int
    bytes_read: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0


def run_plan(
    jobs: list[Job],
    config: dict,
    dst: str | Path,
    ctx: Ctx,
    *,
    workers: int = 1,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> StreamReport:
    """Run the jobs (``workers`` threads), resuming an interrupted run of the same plan; index + config last."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    dst = Path(dst)
    key = _plan_key(jobs, config, ctx)
    done = _prepare(dst, key, overwrite)
    todo = [j for j in jobs if j.file not in done]
    total = sum(j.read_bytes for j in todo)
    read, t0 = 0, time.perf_counter()

    def finished(name: str, nbytes: int) -> None:
        nonlocal read
        done.add(name)
        read += nbytes
        (dst / PROGRESS).write_text(json.dumps({"plan": key, "done": sorted(done)}))
        if progress is not None:
            progress(progress_line(len(done), len(jobs), read, total, time.perf_counter() - t0))

    if workers == 1 or len(todo) <= 1:
        for j in todo:
            finished(*run_job(j, ctx, dst))
    else:
        with ThreadPoolExecutor(min(workers, len(todo))) as pool:  # torch ops and file I/O release the GIL
            for name, nbytes in pool.map(lambda j: run_job(j, ctx, dst), todo):
                finished(name, nbytes)
    outputs = {n: j.file for j in jobs for n in _outputs(j)}
    if len(jobs) > 1 or jobs[0].file != "model.safetensors":
        total_size = sum(_nbytes(d, s) for j in jobs for d, s in _outputs(j).values())
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(outputs.items()))}
        (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (dst / PROGRESS).unlink()
    return StreamReport(len(jobs), len(jobs) - len(todo), read, time.perf_counter() - t0)


def dequantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    workers: int = 1,
    overwrite: bool = False,
    backend: str = "auto",
    progress: Callable[[str], None] | None = None,
) -> StreamReport:
    """Released directory ``src`` -> plain directory ``dst`` (module docstring)."""
    src = Path(src)
    jobs, config = plan_dequantize(src, dtype)
    quant = quant_config_of(read_config(src))
    ctx = Ctx(src, None, quant, backend)
    return run_plan(jobs, config, dst, ctx, workers=workers, overwrite=overwrite, progress=progress)


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    like: str | Path | None = None,
    quant: QuantConfig | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    workers: int = 1,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> StreamReport:
    """Plain directory ``src`` -> released directory ``dst`` (module docstring)."""
    src = Path(src)
    like = Path(like) if like is not None else None
    jobs, config = plan_quantize(src, like, quant or QuantConfig(), max_shard_bytes)
    ctx = Ctx(src, like, QuantConfig.from_hf(config["quantization_config"]), "reference")
    return run_plan(jobs, config, dst, ctx, workers=workers, overwrite=overwrite, progress=progress)
