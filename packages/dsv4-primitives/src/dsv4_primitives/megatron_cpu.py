"""Running megatron-core 0.19.2's ``transformer_impl="local"`` path on a machine without CUDA.

megatron-core assumes CUDA in a few places even on its local (non-transformer-engine) path. Each shim below names
the assumption it neutralises; all are no-ops when CUDA is available. They are used by ``dsv4 train`` on CPU and by
the test fixtures in ``dsv4-testkit``.

1. ``torch.cuda.current_device()`` is called at ~200 sites (``GlobalMemoryBuffer.get_tensor``, ``RotaryEmbedding``,
   buffers of the distributed optimizer, ...): on CPU it is redirected to return ``"cpu"``.
2. ``model_parallel_cuda_manual_seed`` needs a CUDA driver, and without it ``get_cuda_rng_tracker().fork()`` raises
   "cuda rng state model-parallel-rng is not added": the tracker is initialised in its inference mode, whose
   ``fork()`` is a null context (dropout then draws from the default CPU generator).
"""

from __future__ import annotations

import torch

_patched = False


def apply_cpu_shims() -> None:
    """Neutralise megatron-core's CUDA assumptions when no CUDA device exists (idempotent)."""
    global _patched
    if torch.cuda.is_available() or _patched:
        return
    torch.cuda.current_device = lambda: "cpu"  # shim 1
    _patched = True


def init_rng_tracker(seed: int = 1234) -> None:
    """Seed megatron-core's RNG tracker: the real CUDA tracker on GPU, the null-fork tracker on CPU (shim 2)."""
    from megatron.core.tensor_parallel.random import initialize_rng_tracker, model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed)
    else:
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
