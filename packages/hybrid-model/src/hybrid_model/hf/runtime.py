"""A single-process megatron-core parallel state for building a whole model outside ``dsv4 train``.

``load_hf_checkpoint`` and ``dsv4 convert`` build the model on one process (TP = PP = EP = 1). When the caller has
already initialised megatron's parallel state (a script, a test fixture), it is reused if it allows a whole model on
this rank; otherwise a world-size-1 process group (gloo on CPU, NCCL on GPU) and the parallel state are created and
kept for the life of the process (the model's layers hold references to its groups).
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from dsv4_primitives.megatron import apply_cpu_shims, init_rng_tracker


def ensure_single_stage_parallel_state(seed: int = 1234) -> bool:
    """Make sure a megatron parallel state with TP = PP = EP = 1 exists; returns True if it was created here."""

    apply_cpu_shims()
    if ps.model_parallel_is_initialized():
        sizes = {
            "tensor": ps.get_tensor_model_parallel_world_size(),
            "pipeline": ps.get_pipeline_model_parallel_world_size(),
            "expert": ps.get_expert_model_parallel_world_size(),
        }
        bad = {k: v for k, v in sizes.items() if v != 1}
        if bad:
            raise ValueError(
                f"HF interop builds the whole model on one rank, but megatron's parallel state has sizes {bad}; "
                "run it in a process with tensor/pipeline/expert parallel size 1"
            )
        return False
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) != 1:
            raise ValueError(
                "HF interop runs on one process; do not launch it with torchrun on several ranks"
            )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    init_rng_tracker(seed)
    return True
