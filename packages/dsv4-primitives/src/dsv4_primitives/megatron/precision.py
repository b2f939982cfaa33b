"""megatron-core 0.19.2 integration of selective FP32 (P1): the Float16Module wrapper and an optimizer fix.

Importing this module imports megatron-core (about 7 s on CPU), so it is not imported by ``dsv4_primitives``.

1. :class:`Float16ModuleKeepFP32` replaces ``megatron.core.transformer.module.Float16Module``. 0.19.2's wrapper
   converts the whole model with ``module.bfloat16()`` / ``module.half()``, which also casts tensors marked with
   :func:`~dsv4_primitives.precision.mark_keep_in_fp32`; the subclass converts with
   :func:`~dsv4_primitives.precision.convert_module_to_dtype_except_fp32_marked` instead and is otherwise the same
   object (same attributes, the inherited ``forward`` that casts fp32 inputs on the first stage and upcasts outputs
   on the last stage, ``sharded_state_dict``, ``set_input_tensor``, ...). Build ``Float16ModuleKeepFP32(config,
   model)`` wherever megatron's training loop would build ``Float16Module(config, model)``.

2. :class:`Float16OptimizerWithNativeFP32Params` fixes ``Float16OptimizerWithFloat16Params.sharded_state_dict``
   of 0.19.2 for models that mix bf16/fp16 params with native FP32 params (the same bug upstream fixed in P1).
   The inner optimizer's state ids enumerate *all* its params in group order: FP32 main copies of half params
   interleaved with native FP32 params. 0.19.2 builds the id -> model-ShardedTensor map by enumerating only the
   half params, so as soon as a native FP32 param precedes a half param in a group, every later id maps to the
   wrong model tensor (Adam state of the FP32 param saved under a bf16 weight's key, then a ``KeyError``), and the
   ``fp32_from_fp16_params`` main copies are zipped with the wrong ids. The subclass enumerates the optimizer's
   params in order, maps each main copy back to its model param (``main_param_id_to_model_param``) and each
   native FP32 param to itself, and keys ``fp32_from_fp16_params`` only by real main copies. A second 0.19.2
   failure: a param group holding only native FP32 params (e.g. the no-weight-decay group of sinks and biases)
   gives an empty main-copy list, which dist-checkpointing's split/merge of nested lists cannot round-trip
   ("Cannot merge two lists with different lengths" at load). The subclass stores the main copies as
   ``{group_index: [...]}`` without empty groups and ``load_state_dict`` turns that back into per-group lists
   (and refuses a checkpoint whose per-group main-copy counts differ instead of silently zipping short). It adds no state, so
   :func:`fix_native_fp32_optimizer` upgrades optimizers built by ``get_megatron_optimizer`` in place
   (``__class__`` swap of exact ``Float16OptimizerWithFloat16Params`` instances, inside ``ChainedOptimizer`` too).

3. :class:`DistributedOptimizerWithNativeFP32Params` fixes the same class of bug in 0.19.2's
   ``DistributedOptimizer``: ``model_param_group_index_map`` (model param -> ``(group, position)`` in the inner
   optimizer, used by every checkpoint save/load path) records positions in grad-buffer order, but the inner
   optimizer's groups are rebuilt as ``[*native FP32 shards, *main copies of half shards]``. In a group mixing
   both, positions point at another param's main copy and Adam state (found here as a shape assertion in the
   ``dp_reshardable`` save; with equal shapes the state would be silently swapped). The subclass rebuilds the map
   from the real group order. :func:`fix_native_fp32_optimizer` applies it to built optimizers as well.
   Second fix, for a ``DistributedOptimizer`` on ``torch.optim.Adam/AdamW`` (no Apex/TE fused Adam: our CPU runs
   and the H200 box, which has no transformer-engine): ``state_dict()`` asserts that exactly one ``step`` value
   exists across the inner state, which fails on a fresh optimizer, so the loading template
   ``sharded_state_dict(..., is_loading=True)`` of a new run cannot be built. The subclass reports step 0 for a
   fresh optimizer (the loaded checkpoint then sets the real step). Third fix: a native FP32 param's shard is
   ``model_param.view(-1)[range]`` (a view of a leaf that requires grad, unlike the detached main copies of half
   params), and ``_set_main_param_and_optimizer_states`` copies loaded values into it outside ``no_grad``, so the
   ``dp_reshardable`` load raises "a view of a leaf Variable that requires grad is being used in an in-place
   operation"; the subclass runs that copy under ``torch.no_grad()``. Fourth and fifth (torch Adam only): that
   same copy also writes the loading template's ``step`` (0 for a fresh optimizer) over the step that
   ``load_state_dict`` just restored from the checkpoint's param groups, and ``load_state_dict`` gives every
   param's state one *shared* ``step`` tensor, which torch Adam then increments once per param per step; either
   breaks Adam's bias correction after a resume. The subclass skips ``step`` in the per-param copy (megatron's
   own comment says step is restored from the param groups) and gives each param its own step tensor.
   Sixth: 0.19.2's ``fully_reshardable`` save (``sharded_param_state_fully_reshardable``) slices the gathered
   world tensors of ``get_parameter_state_dp_zero`` with ``buffer.param_index_map`` offsets. Those are positions in
   the *padded* grad buffer, but the gathered tensors concatenate the buckets *without* their end padding (its own
   comment: "gets rid of the padding between buckets"). With one bucket per buffer the two agree; with several they
   do not, and every param after the first padded bucket end is saved with another param's values (zeros at the
   end). The distributed optimizer starts a new bucket at a ``shared_embedding`` param, so pipeline stages holding
   the word embedding together with other params (PP > 1 with MTP or tied embeddings: the first and the last
   stage) hit it. The subclass re-inserts the bucket padding (each bucket's unpadded data at its ``offset``) before
   megatron's slicing, for saving and for the loading template alike; the loader
   (``load_parameter_state_from_fully_reshardable``) uses the per-rank ranges and is correct as it is.
"""

from __future__ import annotations

from itertools import chain

import torch
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)
from megatron.core.optimizer import ChainedOptimizer, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron.core.transformer.module import Float16Module, MegatronModule

from dsv4_primitives.precision.keep_fp32 import convert_module_to_dtype_except_fp32_marked

__all__ = [
    "DistributedOptimizerWithNativeFP32Params",
    "Float16ModuleKeepFP32",
    "Float16OptimizerWithNativeFP32Params",
    "fix_native_fp32_optimizer",
    "get_megatron_optimizer_keep_fp32",
]


class Float16ModuleKeepFP32(Float16Module):
    """``Float16Module`` that keeps ``keep_in_fp32``-marked params and buffers in FP32 (see the module docstring).

    Args:
        config: ``TransformerConfig`` with ``bf16`` or ``fp16`` set.
        module: the model chunk (a ``MegatronModule``).
    """

    def __init__(self, config, module: torch.nn.Module):
        # Float16Module.__init__ would call module.bfloat16(); replicate its attributes without that cast.
        MegatronModule.__init__(self, config)
        self.config = config
        self.fp16 = config.fp16
        self.bf16 = config.bf16
        self.vp_size = config.virtual_pipeline_model_parallel_size
        self.vp_stage = getattr(module, "vp_stage", None)
        self.pg_collection = getattr(module, "pg_collection", None)
        if self.fp16:
            dtype = torch.float16
        elif self.bf16:
            dtype = torch.bfloat16
        else:
            raise ValueError("Float16ModuleKeepFP32 needs config.fp16 or config.bf16 to be True")
        self.add_module("module", convert_module_to_dtype_except_fp32_marked(module, dtype))

        def float16_convertor(val):
            return val.to(dtype)

        self.float16_convertor = float16_convertor


class Float16OptimizerWithNativeFP32Params(Float16OptimizerWithFloat16Params):
    """``Float16OptimizerWithFloat16Params`` with a checkpoint mapping that is correct for native FP32 params."""

    def main_param_id_to_model_param(self) -> dict[int, torch.nn.Parameter]:
        """Inner-optimizer state id -> model param: a main copy maps to its half param, native FP32 to itself."""
        main_to_model = {
            id(main): model
            for model_group, main_group in zip(
                self.float16_groups, self.fp32_from_float16_groups, strict=True
            )
            for model, main in zip(model_group, main_group, strict=True)
        }
        params = chain.from_iterable(g["params"] for g in self.optimizer.param_groups)
        return {i: main_to_model.get(id(p), p) for i, p in enumerate(params)}

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        state_dict = self.state_dict()
        id_to_model = self.main_param_id_to_model_param()
        id_to_sharded_param_map = get_param_id_to_sharded_param_map(
            model_sharded_state_dict, (id_to_model[i] for i in range(len(id_to_model)))
        )
        missing = sorted(set(id_to_model) - set(id_to_sharded_param_map))
        if missing:
            raise ValueError(
                f"optimizer params {missing} have no entry in the model sharded_state_dict; build it with "
                "model.sharded_state_dict() of the same model chunks the optimizer was made for"
            )
        main_ids = {
            id(p): i
            for i, p in enumerate(chain.from_iterable(g["params"] for g in self.optimizer.param_groups))
        }
        # keyed by group index, empty groups left out (an empty list inside a list breaks dist-ckpt's merge)
        state_dict["fp32_from_fp16_params"] = {
            gi: [
                make_sharded_optimizer_tensor(
                    id_to_sharded_param_map[main_ids[id(main)]], main, prefix="optimizer.state.fp32_param"
                )
                for main in main_group
            ]
            for gi, main_group in enumerate(self.fp32_from_float16_groups)
            if main_group
        }
        step = self._extract_common_per_param_step(state_dict["optimizer"])
        optim_state_to_sharding_state(state_dict["optimizer"], id_to_sharded_param_map, exclude_keys="step")
        if step:
            state_dict["optimizer"]["state"]["common_step"] = step
        return state_dict

    def load_state_dict(self, state_dict):
        saved = state_dict.get("fp32_from_fp16_params")
        if isinstance(saved, dict):  # written by sharded_state_dict above
            groups = [list(saved.get(gi, [])) for gi in range(len(self.fp32_from_float16_groups))]
            extra = set(saved) - set(range(len(groups)))
            if extra:
                raise ValueError(
                    f"checkpoint has main-copy groups {sorted(extra)} this optimizer does not have"
                )
            state_dict = {**state_dict, "fp32_from_fp16_params": groups}
        mains = state_dict.get("fp32_from_fp16_params", state_dict.get("fp32_from_fp16"))
        if mains is not None:
            have = [len(g) for g in self.fp32_from_float16_groups]
            got = [len(g) for g in mains]
            if have != got:
                raise ValueError(
                    f"checkpoint main copies per param group {got} do not match this optimizer's {have}: the model "
                    "or its keep-in-FP32 marks differ from the saved run"
                )
        super().load_state_dict(state_dict)


class DistributedOptimizerWithNativeFP32Params(DistributedOptimizer):
    """``DistributedOptimizer`` whose param -> (group, position) map follows the inner optimizer's real order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rebuild_model_param_group_index_map()

    def rebuild_model_param_group_index_map(self) -> None:
        """Positions in ``optimizer.param_groups[g]['params']`` = ``[*fp32 shards, *half shards]`` (0.19.2 order)."""
        if self.is_stub_optimizer:
            return
        index_map = {}
        for gi, (fp32_params, half_params) in enumerate(
            zip(self.model_fp32_groups, self.model_float16_groups, strict=True)
        ):
            ordered = [*fp32_params, *half_params]
            assert len(ordered) == len(self.optimizer.param_groups[gi]["params"]), "unexpected group layout"
            for order, model_param in enumerate(ordered):
                index_map[model_param] = (gi, order)
        assert index_map.keys() == self.model_param_group_index_map.keys()
        self.model_param_group_index_map = index_map

    @torch.no_grad()
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        tensors = {**tensors, "step": None}  # megatron skips non-tensor entries
        return super()._set_main_param_and_optimizer_states(model_param, tensors)

    def sharded_param_state_fully_reshardable(
        self, model_sharded_state_dict, is_loading: bool = False, metadata=None
    ):
        """megatron's ``fully_reshardable`` param state, with the world tensors in padded-buffer coordinates
        (sixth fix above)."""

        def padded_dp_zero_state(**kwargs):
            state = DistributedOptimizer.get_parameter_state_dp_zero(self, **kwargs)
            return None if state is None else self._in_buffer_coordinates(state)

        self.get_parameter_state_dp_zero = padded_dp_zero_state  # shadows the method for this one call
        try:
            return super().sharded_param_state_fully_reshardable(
                model_sharded_state_dict, is_loading=is_loading, metadata=metadata
            )
        finally:
            del self.get_parameter_state_dp_zero

    def _in_buffer_coordinates(self, state: dict) -> dict:
        """``get_parameter_state_dp_zero``'s world tensors (buckets concatenated without their end padding) laid
        out like the grad buffer: bucket ``k``'s unpadded elements at ``bucket.offset``, zeros in the padding."""
        out = dict(state)
        for gbuf_idx, buffer in enumerate(self.buffers):
            if gbuf_idx not in state:
                continue
            per_dtype = {}
            for dtype, world in state[gbuf_idx].items():
                padded = {}
                for key, t in world.items():
                    if not torch.is_tensor(t):
                        padded[key] = t  # numel_unpadded
                        continue
                    full = torch.zeros(buffer.grad_data.numel(), dtype=t.dtype, device=t.device)
                    src = 0
                    for bucket in buffer.buckets:
                        n = bucket.numel_unpadded
                        full[bucket.offset : bucket.offset + n] = t[src : src + n]
                        src += n
                    padded[key] = full
                per_dtype[dtype] = padded
            out[gbuf_idx] = per_dtype
        return out

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for st in self.optimizer.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()

    def state_dict(self):
        from megatron.core.optimizer import distrib_optimizer

        if distrib_optimizer.HAVE_APEX_OR_TE or self.is_stub_optimizer:
            return super().state_dict()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if not params:
            # no parameter of this kind on this rank (e.g. the expert optimizer of a pipeline stage without MoE
            # layers: megatron builds it on every rank of the model-parallel group): megatron reads the step from
            # the per-parameter state, of which there is none, so give it the one step it asks for (0, unused)
            real = self.optimizer.state_dict

            def with_a_step():
                out = real()
                out["state"] = {0: {"step": torch.zeros((), dtype=torch.float32)}}
                return out

            self.optimizer.state_dict = with_a_step
            try:
                return super().state_dict()
            finally:
                del self.optimizer.state_dict
        fresh = [p for p in params if "step" not in self.optimizer.state.get(p, {})]
        if not fresh or len(fresh) != len(params):  # trained (or partially: let megatron's check speak)
            return super().state_dict()
        for p in fresh:  # a fresh torch Adam: no step taken yet
            self.optimizer.state[p]["step"] = torch.zeros((), dtype=torch.float32)
        try:
            return super().state_dict()
        finally:
            for p in fresh:
                self.optimizer.state[p].pop("step", None)
                if not self.optimizer.state[p]:
                    del self.optimizer.state[p]


def fix_native_fp32_optimizer(optimizer):
    """Upgrade the 0.19.2 mixed-precision optimizers inside ``optimizer`` in place (see above); returns it."""
    inner = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    for opt in inner:
        if type(opt) is Float16OptimizerWithFloat16Params:
            opt.__class__ = Float16OptimizerWithNativeFP32Params
        elif type(opt) is DistributedOptimizer:
            opt.__class__ = DistributedOptimizerWithNativeFP32Params
            opt.rebuild_model_param_group_index_map()
    return optimizer


def get_megatron_optimizer_keep_fp32(config, model_chunks, **kwargs):
    """``megatron.core.optimizer.get_megatron_optimizer`` followed by :func:`fix_native_fp32_optimizer`."""
    return fix_native_fp32_optimizer(get_megatron_optimizer(config, model_chunks, **kwargs))
