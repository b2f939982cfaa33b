"""megatron-core parallel state for tests, on CPU with gloo (or on GPU with NCCL when run there).

The CUDA assumptions of megatron-core 0.19.2's local path are neutralised by
:func:`dsv4_primitives.megatron.cpu_shims` for the duration of the block (each shim is documented in
:mod:`dsv4_primitives.megatron.cpu`); nothing stays patched after it. Needs the ``[megatron]`` extra
(``pip install 'dsv4-testkit[megatron]'``).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from dsv4_testkit.distributed import free_port


@contextlib.contextmanager
def megatron_cpu_context(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    cp: int = 1,
    seed: int = 1234,
    vpp: int | None = None,
    etp: int = 1,
):
    """Initialise megatron-core's parallel state for the duration of the block.

    If no process group exists yet, a world-size-1 group is created (gloo on CPU, NCCL on CUDA) and destroyed on
    exit; inside :func:`dsv4_testkit.run_distributed` workers the existing group is reused. The process groups
    megatron creates are destroyed on exit (``dsv4_primitives.megatron.destroy_model_parallel``). ``etp``: the
    expert tensor-parallel size (1: routed experts whole on their EP rank, as DSv4's experts need; megatron's own
    default would follow ``tp``).
    """
    # here, not at module top: dsv4_primitives.megatron needs the [megatron] extra, and the pytest plugin imports
    # dsv4_testkit before it sets TRITON_INTERPRET (importing dsv4_primitives creates its Triton kernels, which read it)
    from dsv4_primitives.extras import require_megatron

    require_megatron("dsv4-testkit[megatron]", "dsv4_testkit.megatron_cpu_context")
    from megatron.core import parallel_state

    from dsv4_primitives.megatron import cpu_shims, destroy_model_parallel, init_rng_tracker, process_groups

    with cpu_shims():
        own_group = not dist.is_initialized()
        if own_group:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(free_port())
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, rank=0, world_size=1)
        existing = process_groups()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
        init_rng_tracker(seed)
        try:
            yield parallel_state
        finally:
            # megatron's groups too (their gloo threads poll until destroyed)
            destroy_model_parallel(keep=existing)
            if own_group:
                dist.destroy_process_group()
