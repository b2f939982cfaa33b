"""Checkpoints of ``dsv4 train``: megatron dist checkpoints ``checkpoints/iter_XXXXXXX`` (model, distributed
optimizer in ``dp_reshardable`` or ``fully_reshardable`` form (``--ckpt-format``), LR scheduler, step, data position, every rank's RNG state) and the
``checkpoints/latest`` pointer; weights-only loading for ``--init-from``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from torch.distributed.checkpoint.api import CheckpointException

from dsv4_primitives.megatron import cuda_as_cpu
from dsv4_train.atomic_save import save_atomically
from dsv4_train.ckpt_integrity import MANIFEST_MARKER, verify_loaded
from dsv4_train.config import TrainConfig, flag_name, flat_settings
from dsv4_train.data_identity import DATA_IDENTITY_FILE, identity_text
from dsv4_train.eval_data import heldout_conflict
from dsv4_train.init_model import mismatch_message
from dsv4_train.step import TrainingDiverged
from hybrid_model.dist_load import load_across_tp
from hybrid_model.hf.convert import describe_load_error

DISTOPT_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}  # the default (``--ckpt-format``)
# the distributed optimizer's checkpoint formats ``dsv4 train --ckpt-format`` offers: ``dp_reshardable`` (flat
# buffer shards: each rank writes its own, resumable at another DP size) and ``fully_reshardable`` (every
# param's fp32 main copy and Adam moments under its model key, gathered over DP to write: resumable at another
# PP, TP and DP size; see :func:`check_resume_layout`)
# the run's TrainConfig, written next to megatron's files of every checkpoint (read back for the resume checks)
TRAIN_CONFIG_FILE = "dsv4_train_config.json"

# Settings a resumed run must share with the checkpoint's run, with the reason (everything else may change and
# applies from the resume step on: clipping, loss coefficients, the dense phase and MTP weight by step index,
# micro-batch size, parallel layout, saving and logging).
FIXED_ON_RESUME = {
    "preset": "the model",
    "model_overrides": "the model",
    "seq_len": "the data stream (the saved position counts global batches of this shape and order)",
    "global_batch_size": "the data stream (the saved position counts global batches of this shape and order)",
    "packed": "the data stream (the saved position counts global batches of this shape and order)",
    "max_docs_per_pack": "the data stream (the documents of each pack)",
    "sources": "the data stream (the saved position counts global batches of this shape and order)",
    "tokenizer": "the data stream (the saved position counts global batches of this shape and order)",
    "long_docs": "the data stream (the saved position counts global batches of this shape and order)",
    "skip_bad_records": "the data stream (the saved position counts global batches of this shape and order)",
    "seed": "the data order",
    "lr": "the LR schedule",
    "min_lr": "the LR schedule",
    "warmup_steps": "the LR schedule",
    "steps": "the LR schedule (its decay spans --steps)",
    "lr_decay_style": "the LR schedule",
    "lr_wsd_decay_steps": "the LR schedule",
    "weight_decay": "the weight-decay schedule",
}


# what a failed checkpoint read raises: megatron's readers raise whatever they meet, and torch's distributed
# checkpoint wraps failures in ``CheckpointException``, a BaseException
_READ_ERRORS = (Exception, CheckpointException)


def _unreadable(what: Path, error: BaseException, latest: Path) -> ValueError:
    lines = str(error).strip().splitlines() or [""]
    cause = lines[-1] if len(lines) > 1 else f"{type(error).__name__}: {lines[0]}"  # a traceback's last line
    return ValueError(
        f"checkpoint {what} cannot be read ({cause}); it is truncated, corrupt or from another model: write the "
        f"name of an older iter_XXXXXXX into {latest} and resume again, or start a new run with --overwrite"
    )


def resume_conflicts(
    tc: TrainConfig, saved: dict[str, Any] | None, scheduler_state: dict[str, Any]
) -> list[str]:
    """The settings of ``tc`` that differ from the checkpoint's run (``saved``: its TrainConfig as a dict, ``None``
    for checkpoints without one; ``scheduler_state``: megatron's saved LR-scheduler state), one line each."""
    lines = []
    if saved is not None:
        saved, now = flat_settings(saved), tc.flat()
        for name, why in FIXED_ON_RESUME.items():
            if name in saved and saved[name] != now[name]:
                lines.append(
                    f"{flag_name(name)} {now[name]!r} (checkpoint: {saved[name]!r}; it defines {why})"
                )

        heldout = heldout_conflict(tc, saved)
        if heldout:
            lines.append(heldout)
    expected = {
        "max_lr": ("--lr", tc.optimizer.lr),
        "min_lr": ("--min-lr", tc.optimizer.min_lr),
        "lr_warmup_steps": ("--warmup-steps", min(tc.optimizer.warmup_steps, tc.schedule.steps - 1)),
        "lr_decay_steps": ("--steps", max(tc.schedule.steps, 2)),
        "start_wd": ("--weight-decay", tc.optimizer.weight_decay),
    }
    if saved is None:  # older checkpoints: megatron's scheduler state is what can be compared
        for key, (flag, value) in expected.items():
            if key in scheduler_state and scheduler_state[key] != value:
                lines.append(
                    f"{flag}: the LR schedule's {key} would be {value!r} (checkpoint: {scheduler_state[key]!r})"
                )
    return lines


def params_finite(core, group=None) -> bool:
    """Whether every parameter of ``core`` on every rank of ``group`` (default: the world) is finite."""
    sums = [p.detach().sum(dtype=torch.float32) for p in core.parameters()]
    bad = (~torch.isfinite(torch.stack(sums))).any().to(torch.float32).reshape(1) if sums else torch.zeros(1)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return not bool(bad.item())


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


def saved_distopt_format(common: dict) -> str:
    """The distributed-optimizer format a checkpoint was written in (``dp_reshardable`` before it was recorded)."""
    return common.get("distopt_format", "dp_reshardable")


def check_resume_layout(common: dict, path: Path | str, layout: tuple[int, int, int]) -> None:
    """``ValueError`` unless ``layout`` = (PP, TP, EP) can resume the checkpoint saved at ``common["model_layout"]``.

    ``dp_reshardable`` optimizer state (the default format) is flat buffer shards whose layout depends on which
    parameters (and which TP slices of them) a PP/TP/EP rank holds: megatron re-splits it over DP only, so PP, TP
    and EP must be the saved ones. ``fully_reshardable`` state (``--ckpt-format fully_reshardable``) is keyed per
    parameter like the model, each TP-split parameter's main copy and moments as TP shards of the TP=1 tensor: PP
    and TP may change too (PP2 -> PP1, TP2 -> TP1 and TP1 -> TP2 are tested). EP stays fixed (an EP change is not
    tested). ``common``: the checkpoint's common state with ``model_layout``; checkpoints written before it existed
    give PP and TP through ``rng_layout`` = (PP, TP, DP).
    """
    saved = common.get("model_layout") or [*common.get("rng_layout", [0, 0])[:2], layout[2]]
    fmt = saved_distopt_format(common)
    fixed = (2,) if fmt == "fully_reshardable" else (0, 1, 2)
    if any(tuple(saved)[i] != tuple(layout)[i] for i in fixed):
        if fmt == "fully_reshardable":
            raise ValueError(
                f"{path} was saved at (PP, TP, EP) = {tuple(saved)}; this run is {tuple(layout)}. Its optimizer "
                "state (fully_reshardable) resumes at another PP, TP or DP size, not at another EP size: resume "
                "at the saved EP, or start from its weights with --init-from (optimizer, schedule and data start "
                "fresh)"
            )
        raise ValueError(
            f"{path} was saved at (PP, TP, EP) = {tuple(saved)}; this run is {tuple(layout)}. Its optimizer state "
            "(megatron's dp_reshardable format) can be resumed at another DP size only: resume at the saved "
            "PP/TP/EP, save with --ckpt-format fully_reshardable to resume at another PP or TP size, or start from "
            "its weights with --init-from (optimizer, schedule and data start fresh)"
        )


def rng_state(ps):
    """This rank's RNG state (CPU generator, CUDA generator + megatron's tracker on GPU) as one ShardedObject
    at (pp rank, tp rank, dp rank): every rank keeps its own stream across a resume."""

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

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


def latest_checkpoint(checkpoints: Path) -> Path:
    """The checkpoint directory that ``checkpoints/latest`` names (``ValueError`` naming the file and what to do
    when it cannot be read or names no checkpoint)."""
    latest = Path(checkpoints) / "latest"
    try:
        name = latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{latest} cannot be read ({e}): write the name of an iter_XXXXXXX directory into it"
        ) from e
    path = latest.parent / name
    if not name or "/" in name or not (path / "metadata.json").is_file():
        raise ValueError(
            f"{latest} names {name!r}, which is not a checkpoint in {latest.parent} (no {name}/metadata.json): "
            "write the name of an existing iter_XXXXXXX directory into it"
        )
    return path


def read_common_state(path: Path) -> dict:
    """The common (non-sharded) state of the dist checkpoint ``path`` (``ValueError`` naming it when unreadable)."""

    try:
        return dist_checkpointing.load_common_state_dict(str(path))
    except _READ_ERRORS as e:  # megatron raises whatever its reader meets: name the file
        raise _unreadable(path, e, path.parent / "latest") from e


def check_resumable(tc: TrainConfig, path: Path, common: dict) -> None:
    """``ValueError`` listing every setting of ``tc`` that a resume from ``path`` cannot change (see
    :data:`FIXED_ON_RESUME`) and what to do instead."""
    saved = None
    cfg_file = path / TRAIN_CONFIG_FILE
    if cfg_file.exists():
        try:
            saved = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(
                f"{cfg_file} cannot be read ({e}): restore it, or delete it to resume with the LR-schedule checks only"
            ) from e
    conflicts = resume_conflicts(tc, saved, common.get("scheduler", {}))
    if conflicts:
        if any(line.startswith(("--preset", "--model-overrides")) for line in conflicts):
            # the weights belong to the checkpoint's model: --init-from could not load them into another one
            way_out = (
                "or start a new run of the new model in another --out (without --init-from: the weights are "
            )
            way_out += "the checkpoint's model's)"
        else:
            way_out = f"or start a new run from its weights with --init-from {path} --out NEW_DIR"
        raise ValueError(
            f"--resume from {path}: these settings differ from the checkpoint's run and cannot change in a resumed "
            "run:\n  " + "\n  ".join(conflicts) + f"\nresume with the checkpoint's values, {way_out}"
        )


def preflight_resume(tc: TrainConfig) -> Path:
    """Before anything is built: the checkpoint a resume of ``tc`` will load, its pointer, common state and settings
    checked (``ValueError`` naming the file or the conflicting settings)."""
    path = latest_checkpoint(Path(tc.checkpoint.out) / "checkpoints")
    check_resumable(tc, path, read_common_state(path))
    return path


class Checkpointer:
    """Saves and restores the whole training state of one rank (``core``: the unwrapped DSv4 model)."""

    def __init__(
        self,
        *,
        core,
        optimizer,
        scheduler,
        batches,
        ps,
        out: Path,
        rank: int,
        tc: TrainConfig,
        data_identity: dict[str, Any] | None = None,
    ) -> None:
        self.core, self.optimizer, self.scheduler, self.batches = core, optimizer, scheduler, batches
        self.ps, self.dir, self.rank, self.tc = ps, Path(out) / "checkpoints", rank, tc
        # the training data's identity at the run's start (dsv4_train.data_identity), written with every checkpoint
        self.data_identity = data_identity

    def sharded_state(
        self, step: int, loading: bool, *, with_rng: bool = True, distopt_format: str | None = None
    ) -> dict[str, Any]:
        """The sharded state to save, or (``loading``) the template to load into; ``distopt_format``: the
        optimizer format (default ``--ckpt-format``; loading: the checkpoint's, :func:`saved_distopt_format`)."""
        fmt = distopt_format or self.tc.checkpoint.ckpt_format
        state = {
            "model": self.core.sharded_state_dict(),
            "optimizer": self.optimizer.sharded_state_dict(
                self.core.sharded_state_dict(),
                is_loading=loading,
                metadata={"distrib_optim_sharding_type": fmt},
            ),
            "distopt_format": fmt,
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
        """Write ``checkpoints/iter_{step:07d}`` (all ranks), then point ``checkpoints/latest`` at it (rank 0).
        Refuses (:class:`~dsv4_train.step.TrainingDiverged`) when a weight is not finite: ``latest`` never
        names a NaN model."""

        if not params_finite(self.core):
            raise TrainingDiverged(
                f"step {step}: the model has non-finite weights; not saving it (checkpoints/latest keeps naming the "
                "last finite checkpoint)"
            )
        sync_saver_queue()

        def write_shards(directory: Path) -> None:
            with cuda_as_cpu():
                state = self.sharded_state(step, loading=False)
                dist_checkpointing.save({**state, MANIFEST_MARKER: True}, str(directory))

        # written into a partial directory and published atomically with its manifest (dsv4_train.atomic_save)
        files = {TRAIN_CONFIG_FILE: json.dumps(self.tc.to_dict(), indent=1) + "\n"}
        if (
            self.data_identity is not None
        ):  # what the training stream was read from (dsv4_train.data_identity)
            files[DATA_IDENTITY_FILE] = identity_text(self.data_identity)
        return save_atomically(self.dir, step, write_shards, files, rank=self.rank)

    def load_latest(self) -> int | None:
        """Restore model, optimizer (Adam moments + per-param step), LR scheduler, data position and RNG state of
        ``checkpoints/latest`` and return its step; ``None`` when there is none. The DP size may differ from the
        saved one, PP and TP only in the ``fully_reshardable`` format, EP not (:func:`check_resume_layout`); the RNG
        streams are restored only when the parallel layout (PP, TP, DP) is the saved one. Unreadable files and settings a resume cannot change
        (:func:`check_resumable`) raise ``ValueError`` naming them."""

        latest = self.dir / "latest"
        if not latest.exists():
            return None
        path = latest_checkpoint(self.dir)
        common = read_common_state(path)
        check_resume_layout(common, path, model_layout(self.ps))
        check_resumable(self.tc, path, common)
        same_layout = list(common.get("rng_layout", [])) == list(rng_layout(self.ps))
        try:
            with cuda_as_cpu():
                template = self.sharded_state(
                    0, loading=True, with_rng=same_layout, distopt_format=saved_distopt_format(common)
                )
                state = load_across_tp(template, str(path))
                self.core.load_state_dict(state["model"])
                with torch.no_grad():
                    self.optimizer.load_state_dict(state["optimizer"])
        except _READ_ERRORS as e:  # truncated / corrupt shards, or another model's checkpoint
            raise _unreadable(path, e, latest) from e
        self.scheduler.load_state_dict(state["scheduler"])
        self.batches.load_state_dict(state["data"])
        if same_layout:
            set_rng_state(state["rng_state"])
        return int(state["step"])

    def load_weights(self, path: str | Path) -> Path:
        """Initialise the model (weights and buffers only) from the dist checkpoint ``path``: an ``iter_XXXXXXX``
        directory, or a run directory (its ``checkpoints/latest``). Any PP/EP/DP layout can read a checkpoint
        written by another (megatron resharding); optimizer, scheduler, data and RNG state start fresh."""

        p = Path(path)
        if (p / "checkpoints" / "latest").exists():
            p = latest_checkpoint(p / "checkpoints")
        if not dist_checkpointing.check_is_distributed_checkpoint(str(p)):
            raise ValueError(
                f"--init-from {path}: not a megatron dist checkpoint (give an iter_XXXXXXX directory or a run "
                "directory with checkpoints/latest)"
            )
        verify_loaded(p, what=f"--init-from {path}")  # checksums (dsv4_train.ckpt_integrity)

        with cuda_as_cpu():
            try:
                state = load_across_tp({"model": self.core.sharded_state_dict()}, str(p))
            except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
                other_model = mismatch_message(str(path), p, self.tc)
                if other_model is not None:
                    raise ValueError(other_model) from e
                raise ValueError(
                    f"--init-from {p}: cannot load the model weights ({describe_load_error(e)}); the checkpoint's "
                    "files are incomplete or corrupt, or it holds another model (use the preset it was trained with)"
                ) from e
            self.core.load_state_dict(state["model"])
            self.optimizer.reload_model_params()  # main (fp32) copies follow the loaded weights
        return p
