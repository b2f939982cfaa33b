"""``dsv4 memory``: the per-rank static and peak GiB of a ``dsv4 train`` configuration (:mod:`dsv4_train.memory_model`).

It takes ``dsv4 train``'s own flags (``--preset``, ``--seq-len``, ``--micro-batch-size``, ``--pp``/``--vpp``/``--ep``/
``--tp``/``--cp``, ``--recompute-*``, ``--optimizer-cpu-offload``, ``--bf16``, ``--model-overrides``, ...) plus ``--dp``
(the data-parallel replicas: world = DP x TP x PP x CP) and ``--json``; bf16 is on unless ``--no-bf16``.
Under ``--tp > 1`` it also prints the bytes one rank sends (= receives) over its TP group per step
(:mod:`dsv4_train.memory_comm`; JSON key ``tp_comm_bytes``).
"""

from __future__ import annotations

import json

from dsv4_train.memory_comm import tp_comm_per_step
from dsv4_train.memory_model import GIB, estimate_memory


def add_memory_parser(sub, *, add_train_flags) -> None:
    p = sub.add_parser(
        "memory",
        help="per-rank static and peak GiB of a dsv4 train configuration, and where they go",
        description="The memory model of dsv4-train (README 'Memory model'): parameters, fp32 gradient buffers, the "
        "distributed optimizer's sharded fp32 main params and Adam moments (or their offloaded share), and the peak "
        "of a training step (activations per layer kind under the recompute setting, head, MTP, transient "
        "backward buffers) on the busiest rank. Takes dsv4 train's flags.",
    )
    p.add_argument("--config", help="JSON file of TrainConfig sections, as dsv4 train --config")
    p.add_argument(
        "--dp", type=int, default=1, help="data-parallel replicas; world = DP x TP x PP x CP (default: 1)"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_train_flags(p)


def run_memory(args, train_config_from_args) -> int:
    tc = train_config_from_args(args)
    tp = tc.parallel.tp
    report = estimate_memory(tc, dp=args.dp, tp=tp)
    d = report.to_dict()
    par = tc.parallel
    layout = (
        f"DP{args.dp} TP{tp} PP{par.pp}"
        + (f" VPP{par.vpp}" if par.vpp > 1 else "")
        + f" CP{par.cp} EP{par.ep}"
    )
    comm = tp_comm_per_step(tc, dp=args.dp, stage=report.stage, tp=tp)
    d.update(
        preset=tc.model.preset,
        seq_len=tc.data.seq_len,
        layout=layout,
        world=args.dp * tp * par.pp * par.cp,
        tp_comm_bytes=comm,
    )
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    print(
        f"{tc.model.preset}, seq-len {tc.data.seq_len}, {layout} ({d['world']} GPUs"
        + f"): busiest rank (stage "
        f"{report.stage}) static {d['static_gib']:.2f} GiB, peak {d['peak_gib']:.2f} GiB"
        + (
            f", {d['host_offloaded_gib']:.2f} GiB optimizer state in host memory"
            if report.host_offloaded
            else ""
        )
        + (
            f", {d['host_activations_gib']:.2f} GiB of activations in host memory"
            if report.host_activations
            else ""
        )
    )
    for title, parts in (
        ("static", d["static"]),
        ("activations", d["activations"]),
        ("transient", d["transient"]),
    ):
        print(f"  {title}:")
        for k, v in parts.items():
            print(f"    {k:<44} {v:9.2f} GiB")
    if comm:
        print(
            f"  TP communication per step, one rank sends (= receives), {sum(comm.values()) / GIB:.3f} GiB:"
        )
        for k, v in comm.items():
            print(f"    {k:<44} {v / GIB:9.3f} GiB")
    return 0


__all__ = ["GIB", "add_memory_parser", "run_memory"]
