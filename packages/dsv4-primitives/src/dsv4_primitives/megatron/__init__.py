"""megatron-core 0.19.2 glue of dsv4-primitives (the ``[megatron]`` extra: ``pip install 'dsv4-primitives[megatron]'``).

- :mod:`dsv4_primitives.megatron.cpu`: running megatron-core's local path on a machine without CUDA
  (:func:`apply_cpu_shims` / :func:`cpu_shims` / :func:`cuda_as_cpu`, :func:`init_rng_tracker`). Nothing is patched
  at import: the shims are applied by explicit calls only.
- :mod:`dsv4_primitives.megatron.groups`: :func:`process_groups` / :func:`destroy_model_parallel`, megatron's
  teardown that also releases the process groups it created (their gloo threads poll for the life of the
  process), :func:`release_autograd_graphs` and :func:`remove_grad_accumulator_hooks` (the reference cycles that
  keep a finished model, its DDP and its groups alive).
- :mod:`dsv4_primitives.megatron.precision`: selective FP32 for megatron-core (``Float16ModuleKeepFP32``, the
  native-FP32 optimizer fixes, ``get_megatron_optimizer_keep_fp32``); imports megatron-core (seconds), so it is
  not imported here.
- :mod:`dsv4_primitives.megatron.multi_tensor`: sync-free ``_foreach`` replacements of megatron's local
  multi-tensor L2 norm and scale (used when neither transformer-engine nor apex is installed),
  :func:`install_foreach_multi_tensor_ops`; imports megatron-core's optimizer, so it is not imported here.

Importing this subpackage without megatron-core raises an ``ImportError`` naming the extra.
"""

from dsv4_primitives.extras import require_megatron

require_megatron("dsv4-primitives[megatron]", "dsv4_primitives.megatron")

from dsv4_primitives.megatron.cpu import (  # noqa: E402
    apply_cpu_shims,
    cpu_shims,
    cpu_shims_applied,
    cuda_as_cpu,
    init_rng_tracker,
    remove_cpu_shims,
)
from dsv4_primitives.megatron.groups import (  # noqa: E402
    destroy_model_parallel,
    process_groups,
    release_autograd_graphs,
    remove_grad_accumulator_hooks,
)

__all__ = [
    "apply_cpu_shims",
    "cpu_shims",
    "cpu_shims_applied",
    "cuda_as_cpu",
    "destroy_model_parallel",
    "init_rng_tracker",
    "process_groups",
    "release_autograd_graphs",
    "remove_cpu_shims",
    "remove_grad_accumulator_hooks",
]
