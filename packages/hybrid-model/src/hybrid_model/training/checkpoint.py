"""Checkpoints of ``dsv4 train``: megatron dist checkpoints ``checkpoints/iter_XXXXXXX`` (model, distributed
optimizer in ``dp_reshardable`` form, LR scheduler, step, data position, every rank's RNG state) and the
``checkpoints/latest`` pointer; weights-only loading for ``--init-from``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dsv4_primitives.megatron import cuda_as_cpu

DISTOPT_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


def rng_layout(ps) -> tuple[int, int, int]:
    """``(PP, TP, DP)`` sizes: the RNG states are restored only into the layout that saved them."""
    return (
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_data_parallel_world_size(with_context_parallel=True),
    )


def model_layout(ps) -> tuple[int, int, int]:
    """``(PP, TP, EP)`` sizes: what a resume cannot change (see :func:`check_resume_layout`)."""
    return (
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
    )


def check_resume_layout(common: dict, path: Path | str, layout: tuple[int, int, int]) -> None:
    """``ValueError`` unless ``layout`` = (PP, TP, EP) is the one the checkpoint was saved at.

    The distributed optimizer's ``dp_reshardable`` state is flat buffer shards whose layout depends on which
    parameters a PP/TP/EP rank holds: megatron re-splits it over DP only. Its other format, ``fully_reshardable``,
    is not offered: with PP > 1 its save writes the later stages' fp32 main params and Adam moments wrong on our
    stack (zeros / another stage's values; a PP2 -> PP1 resume ran one exact step, then diverged).
    ``common``: the checkpoint's common state with ``model_layout``; checkpoints written before it existed give PP
    and TP through ``rng_layout`` = (PP, TP, DP).
    """
    saved = common.get("model_layout") or [*common.get("rng_layout", [0, 0])[:2], layout[2]]
    if tuple(saved) != tuple(layout):
        raise ValueError(
            f"{path} was saved at (PP, TP, EP) = {tuple(saved)}; this run is {tuple(layout)}. Its optimizer state "
            "(megatron's dp_reshardable format) can be resumed at another DP size only: resume at the saved "
            "PP/TP/EP, or start from its weights with --init-from (optimizer, schedule and data start fresh)"
        )


def rng_state(ps):
    """This rank's RNG state (CPU generator, CUDA generator + megatron's tracker on GPU) as one ShardedObject
    at (pp rank, tp rank, dp rank): every rank keeps its own stream across a resume."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "cuda": None, "tracker": None}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
        # graph-safe trackers (--cuda-graph) hold generators: saved as their state tensors, the same format
        state["tracker"] = {
            name: st.get_state() if isinstance(st, torch.Generator) else st
            for name, st in get_cuda_rng_tracker().get_states().items()
        }
    offset = (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_data_parallel_rank(with_context_parallel=True),
    )
    return ShardedObject("rng_state", state, rng_layout(ps), offset, replica_id=0)


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` saved (into the live generators of a graph-safe tracker)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"])
        tracker = get_cuda_rng_tracker()
        live = tracker.get_states()
        restored = {}
        for name, st in state["tracker"].items():
            if isinstance(live.get(name), torch.Generator):  # keep the generator objects (graphs hold them)
                live[name].set_state(st.get_state() if isinstance(st, torch.Generator) else st)
                restored[name] = live[name]
            else:
                restored[name] = st
        tracker.set_states(restored)


def sync_saver_queue() -> None:
    """Single-process (sync) saves collect their write results in-process instead of through a spawned manager."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


class Checkpointer:
    """Saves and restores the whole training state of one rank (``core``: the unwrapped DSv4 model)."""

    def __init__(self, *, core, optimizer, scheduler, batches, ps, out: Path, rank: int) -> None:
        self.core, self.optimizer, self.scheduler, self.batches = core, optimizer, scheduler, batches
        self.ps, self.dir, self.rank = ps, Path(out) / "checkpoints", rank

    def sharded_state(self, step: int, loading: bool, *, with_rng: bool = True) -> dict[str, Any]:
        state = {
            "model": self.core.sharded_state_dict(),
            "optimizer": self.optimizer.sharded_state_dict(
                self.core.sharded_state_dict(), is_loading=loading, metadata=DISTOPT_FORMAT
            ),
            "scheduler": self.scheduler.state_dict(),
            "step": step,
            "data": self.batches.state_dict(),  # the global iteration (identical on every rank)
            "rng_layout": list(rng_layout(self.ps)),
            "model_layout": list(model_layout(self.ps)),
        }
        if with_rng:
            state["rng_state"] = rng_state(self.ps)
        return state

    def save(self, step: int) -> Path:
        """Write ``checkpoints/iter_{step:07d}`` (all ranks), then point ``checkpoints/latest`` at it (rank 0)."""
        from megatron.core import dist_checkpointing

        sync_saver_queue()
        path = self.dir / f"iter_{step:07d}"
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        with cuda_as_cpu():
            dist_checkpointing.save(self.sharded_state(step, loading=False), str(path))
        dist.barrier()
        if self.rank == 0:
            (self.dir / "latest").write_text(path.name)
        return path

    def load_latest(self) -> int | None:
        """Restore model, optimizer (Adam moments + per-param step), LR scheduler, data position and RNG state of
        ``checkpoints/latest`` and return its step; ``None`` when there is none. The DP size may differ from the
        saved one, PP/TP/EP may not (:func:`check_resume_layout`); the RNG streams are restored only when the
        parallel layout (PP, TP, DP) is the saved one."""
        from megatron.core import dist_checkpointing

        latest = self.dir / "latest"
        if not latest.exists():
            return None
        path = self.dir / latest.read_text().strip()
        common = dist_checkpointing.load_common_state_dict(str(path))
        check_resume_layout(common, path, model_layout(self.ps))
        same_layout = list(common.get("rng_layout", [])) == list(rng_layout(self.ps))
        with cuda_as_cpu():
            state = dist_checkpointing.load(
                self.sharded_state(0, loading=True, with_rng=same_layout), str(path)
            )
            self.core.load_state_dict(state["model"])
            with torch.no_grad():
                self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.batches.load_state_dict(state["data"])
        if same_layout:
            set_rng_state(state["rng_state"])
        return int(state["step"])

    def load_weights(self, path: str | Path) -> Path:
        """Initialise the model (weights and buffers only) from the dist checkpoint ``path``: an ``iter_XXXXXXX``
        directory, or a run directory (its ``checkpoints/latest``). Any PP/EP/DP layout can read a checkpoint
        written by another (megatron resharding); optimizer, scheduler, data and RNG state start fresh."""
        from megatron.core import dist_checkpointing

        p = Path(path)
        if (p / "checkpoints" / "latest").exists():
            p = p / "checkpoints" / (p / "checkpoints" / "latest").read_text().strip()
        if not dist_checkpointing.check_is_distributed_checkpoint(str(p)):
            raise ValueError(
                f"--init-from {path}: not a megatron dist checkpoint (give an iter_XXXXXXX directory or a run "
                "directory with checkpoints/latest)"
            )
        from torch.distributed.checkpoint.api import CheckpointException

        from hybrid_model.hf.convert import describe_load_error

        with cuda_as_cpu():
            try:
                state = dist_checkpointing.load({"model": self.core.sharded_state_dict()}, str(p))
            except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
                raise ValueError(
                    f"--init-from {p}: cannot load the model weights ({describe_load_error(e)}); the checkpoint's "
                    "files are incomplete or corrupt, or it holds another model (use the preset it was trained with)"
                ) from e
            self.core.load_state_dict(state["model"])
            self.optimizer.reload_model_params()  # main (fp32) copies follow the loaded weights
        return p
