"""gloo workers of test_convert_layouts.py: build the trainer of a layout, load a one-process conversion and the
conversion into that layout (``--init-from``), compare the weights and list the files each rank reads.

Module-level functions only (``run_distributed`` pickles them into spawned workers)."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.distributed as dist


def _files_read(sharded: dict, ckpt: Path) -> tuple[set[str], set[str]]:
    """The files the rank's template reads from ``ckpt``: for its main replicas, and for all its entries."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica

    md = pickle.loads((ckpt / ".metadata").read_bytes())
    chunks: dict[str, list] = {}
    for idx, info in md.storage_data.items():
        chunks.setdefault(idx.fqn, []).append((idx.offset, info.relative_path))
    main, every = set(), set()
    for v in nested_values(sharded):
        if isinstance(v, ShardedObject):
            hit = {f for _, f in chunks[v.unique_key]}
        else:
            assert isinstance(v, ShardedTensor)
            lo, shape = v.global_offset, v.local_shape  # prepend axes: none in DSv4 (one offset per dim)
            hit = set()
            for offset, f in chunks[v.key]:
                size = md.state_dict_metadata[v.key].chunks
                box = next(c for c in size if tuple(c.offsets) == tuple(offset))
                if all(
                    o < lo_d + n and lo_d < o + s
                    for o, s, lo_d, n in zip(box.offsets, box.sizes, lo, shape, strict=True)
                ):
                    hit.add(f)
        every |= hit
        if is_main_replica(v.replica_id):
            main |= hit
    return main, every


def load_layouts(rank: int, world: int, runs: list[tuple[str, dict, str]], reference: str, out: str) -> dict:
    """For each ``(name, TrainConfig layout kwargs, converted checkpoint)``: ``{name: {"differ": [...], "main":
    files read for main replicas, "every": all files read, "params": count}}``."""
    from megatron.core import parallel_state as ps
    from parallel_runs import global_grad_names, run_trainer

    results = {}
    for name, kw, ckpt in runs:
        base = dict(seq_len=32, global_batch_size=4, micro_batch_size=1, steps=1, sources=("mock",))
        trainer = run_trainer(base | kw | {"out": f"{out}/{name}"})
        try:
            names = global_grad_names(trainer.core)
            trainer.load_model_weights(reference)  # the one-process conversion, resharded by megatron
            ref = {names[id(p)]: p.detach().clone() for p in trainer.core.parameters()}
            trainer.load_model_weights(ckpt)  # the conversion into this layout
            differ = [k for p in trainer.core.parameters() if not torch.equal(p, ref[k := names[id(p)]])]
            main, every = _files_read(trainer.core.sharded_state_dict(), Path(ckpt))
            results[name] = {
                "differ": differ,
                "params": len(ref),
                "main": sorted(main),
                "every": sorted(every),
                "rank": dist.get_rank(),
                "pp_ep": (ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()),
            }
        finally:
            trainer.close()
    return results
