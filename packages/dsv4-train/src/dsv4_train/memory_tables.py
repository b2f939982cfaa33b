"""The README tables of the memory model (``tools/readme_tables.py`` writes them, a test checks they are current):
the model against the flash-smoke peaks measured on one H200, and V4-Flash / V4-Pro layouts at long context."""

from __future__ import annotations

from dsv4_train.config import TrainConfig
from dsv4_train.memory_comm import tp_comm_per_step
from dsv4_train.memory_model import GIB, estimate_memory

FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
OFFLOAD = dict(FULL, optimizer_cpu_offload=True)
#: flash-smoke, bf16, full step with MTP, one [1, S] sequence, one H200 (benchmarks/results/long_context*_2026-12-01
#: .json: max_memory_allocated over the timed steps); all measured before the between-steps release of issue 33
MEASURED: tuple[tuple[str, dict, int, float], ...] = (
    ("no recompute", {}, 4096, 79.14),
    ("no recompute", {}, 16384, 117.18),
    ("full recompute", FULL, 4096, 71.70),
    ("full recompute", FULL, 16384, 87.43),
    ("full recompute", FULL, 32768, 109.19),
    ("full + offload F=1", OFFLOAD, 4096, 27.19),
    ("full + offload F=1", OFFLOAD, 16384, 44.08),
    ("full + offload F=1", OFFLOAD, 32768, 66.69),
    ("full + offload F=1", OFFLOAD, 65536, 111.78),
    ("full + offload F=0.5", dict(OFFLOAD, optimizer_offload_fraction=0.5), 4096, 46.15),
    ("full + offload F=0.5", dict(OFFLOAD, optimizer_offload_fraction=0.5), 65536, 130.73),
)


def _tc(preset: str, seq_len: int, **settings) -> TrainConfig:
    return TrainConfig.from_flat(
        preset=preset,
        seq_len=seq_len,
        micro_batch_size=1,
        global_batch_size=settings.pop("gbs", 1),
        bf16=True,
        **settings,
    )


def model_vs_measured() -> list[tuple[str, int, float, float]]:
    """(setting, S, model peak GiB, measured peak GiB) of :data:`MEASURED`."""
    return [
        (name, s, estimate_memory(_tc("flash-smoke", s, **settings), dp=1).peak / GIB, measured)
        for name, settings, s, measured in MEASURED
    ]


def render_measured() -> str:
    rows = [
        "| setting | S | model peak GiB | measured peak GiB (H200) | error |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, s, model, measured in model_vs_measured():
        rows.append(
            f"| {name} | {s:,} | {model:.1f} | {measured:.1f} | {100 * (model / measured - 1):+.1f}% |"
        )
    return "\n".join(rows)


#: (GPUs, layout flags, DP) of the preset table without TP: PP for the weights, EP for the experts, CP for the
#: sequence and DP for the rest (the layouts with TP are in the TP table)
LAYOUTS = {
    8: (dict(pp=1, ep=8, cp=8), 1),
    64: (dict(pp=8, ep=8, cp=8), 1),
    256: (dict(pp=8, ep=32, cp=32), 1),
}
SEQ_LENS = (131072, 262144, 1048576)


def render_presets() -> str:
    rows = [
        "| preset | GPUs | layout | S | static GiB | peak GiB | host GiB (offload) |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for preset in ("v4-flash", "v4-pro"):
        for gpus, (layout, dp) in LAYOUTS.items():
            for s in SEQ_LENS:
                tc = _tc(preset, s, gbs=8 * layout["pp"], **layout, **OFFLOAD)
                r = estimate_memory(tc, dp=dp)
                text = f"PP{layout['pp']} EP{layout['ep']} CP{layout['cp']} DP{dp}"
                rows.append(
                    f"| {preset} | {gpus} | {text} | {s // 1024}K | {r.static.total / GIB:.1f} | "
                    f"{r.peak / GIB:.1f} | {r.host_offloaded / GIB:.1f} |"
                )
    return "\n".join(rows)


#: layout flags of the TP table: TP alone (expert TP 1, EP 1: every rank holds every routed expert), TP x CP,
#: TP x EP and TP x CP x EP
TP_LAYOUTS = (
    dict(tp=2),
    dict(tp=4),
    dict(tp=8),
    dict(tp=8, cp=8),
    dict(tp=8, ep=8),
    dict(tp=8, cp=8, ep=8),
)
TP_SEQ_LENS = (262144, 1048576)


def render_tp() -> str:
    rows = [
        "| preset | layout | GPUs | S | static GiB | peak GiB | host GiB (offload) | TP GiB / step / rank |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for preset in ("v4-flash", "v4-pro"):
        for layout in TP_LAYOUTS:
            for s in TP_SEQ_LENS:
                tp = layout["tp"]
                tc = _tc(preset, s, **layout, **OFFLOAD)
                r = estimate_memory(tc, dp=1, tp=tp)
                comm = sum(tp_comm_per_step(tc, dp=1, stage=r.stage, tp=tp).values())
                text = " x ".join(f"{k.upper()}{v}" for k, v in layout.items())
                gpus = tp * layout.get("cp", 1)
                rows.append(
                    f"| {preset} | {text} | {gpus} | {s // 1024}K | "
                    f"{r.static.total / GIB:.1f} | {r.peak / GIB:.1f} | {r.host_offloaded / GIB:.1f} | "
                    f"{comm / GIB:.1f} |"
                )
    return "\n".join(rows)


__all__ = [
    "LAYOUTS",
    "MEASURED",
    "SEQ_LENS",
    "TP_LAYOUTS",
    "TP_SEQ_LENS",
    "model_vs_measured",
    "render_measured",
    "render_presets",
    "render_tp",
]
