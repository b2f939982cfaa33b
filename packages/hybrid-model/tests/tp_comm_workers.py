"""gloo worker of ``test_tp_comm.py``: one forward + backward of a tiny model at TP=2 with every collective of
``torch.distributed`` (and megatron-core's module-level aliases of them) recorded, attributed to the layer that
ran it, plus the parameters each layer holds on the rank."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import dsv4_attention.cp.comm as cp_comm
from dsv4_testkit.megatron_cpu import megatron_cpu_context
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset
from hybrid_model.seeded_init import seed_parameters

#: the collectives of torch.distributed and how a call names its full tensor (hybrid_model.tp_comm.Collective)
_OPS = {
    "all_gather_into_tensor": ("all_gather", 0),  # (out, in): the gathered output
    "reduce_scatter_tensor": ("reduce_scatter", 1),  # (out, in): the scattered input
    "all_reduce": ("all_reduce", 0),
    "all_to_all_single": ("all_to_all", 1),
}
_OTHER = (
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "send",
    "recv",
    "isend",
    "irecv",
    "reduce",
)


def _patch(log: list, tag: list) -> list:
    """Wrap the collectives in torch.distributed and every alias of them in loaded megatron / first-party modules;
    returns the (module, name, original) list to restore."""
    undo = []
    for name in (*_OPS, *_OTHER):
        orig = getattr(dist, name)

        def wrapped(*args, _orig=orig, _name=name, **kwargs):
            group = kwargs.get("group")
            if dist.get_world_size(group) > 1:
                if _name not in _OPS:
                    log.append((tag[0], _name, 0, 0))
                else:
                    op, arg = _OPS[_name]
                    t = args[arg]
                    log.append((tag[0], op, t.numel(), t.element_size()))
            return _orig(*args, **kwargs)

        for mod in [
            dist,
            *(
                m
                for n, m in list(sys.modules.items())
                if n.startswith(("megatron", "dsv4", "hybrid", "hash"))
            ),
        ]:
            for attr, val in list(vars(mod).items()):
                if val is orig:
                    undo.append((mod, attr, orig))
                    setattr(mod, attr, wrapped)
    return undo


def _tag_modules(model, tag: list) -> None:
    """Forward: a module's pre-hook names it; backward: a hook on its output's gradient names it."""

    def named(name):
        def pre(module, args):
            tag[0] = (name, "forward")

        def post(module, args, out):
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g: tag.__setitem__(0, (name, "backward")))

        return pre, post

    for name, module in model.named_modules():
        top = name.startswith(("decoder.layers.", "mtp.block.")) and name.count(".") == 2
        if top or name == "embedding":
            pre, post = named(name)
            module.register_forward_pre_hook(pre)
            module.register_forward_hook(post)
    head_loss, output_layer = model.head_loss, model.output_layer

    def tagged(fn):
        def run(*args, **kwargs):
            tag[0] = ("head", "forward")
            out = fn(*args, **kwargs)
            t = out[0] if isinstance(out, tuple) else out
            t.register_hook(lambda g: tag.__setitem__(0, ("head", "backward")))
            return out

        return run

    model.head_loss = tagged(head_loss)
    model.output_layer.forward = tagged(output_layer.forward)


def _layer_params(model) -> dict[str, tuple[int, int]]:
    """``{layer module: (split elements on this rank, replicated elements)}``, routed experts excluded."""
    out = {}
    for name, module in model.named_modules():
        if (name.startswith(("decoder.layers.", "mtp.block.")) and name.count(".") == 2) or name in (
            "embedding",
            "output_layer",
        ):
            split = rep = 0
            for p in module.parameters():
                if getattr(p, "tensor_model_parallel", False):
                    split += p.numel()
                elif getattr(p, "allreduce", True):
                    rep += p.numel()
            out[name] = (split, rep)
    return out


def tp_comm_run(rank: int, world: int, pattern: str, seq: int, fused: bool) -> dict:
    """``{"log": [(tag, op, elements, itemsize)], "params": _layer_params}`` of one bf16 TP=2 forward + backward of
    the tiny preset with ``pattern`` on one ``[1, seq]`` sequence. The attention's gloo fallback (all-reduce +
    slice for a reduce-scatter) is switched to the NCCL path, which torch's gloo supports: the recorded calls are
    the GPU's."""
    log, tag = [], [("setup", "forward")]
    has_rs = cp_comm._has_reduce_scatter
    cp_comm._has_reduce_scatter = lambda group: True
    try:
        with megatron_cpu_context(tp=2):
            model = build_model(
                get_preset("tiny").with_pattern(pattern),
                tensor_model_parallel_size=2,
                fused_linear_cross_entropy=fused,
                bf16=True,
                params_dtype=torch.bfloat16,
            )
            seed_parameters(model, 3)
            _tag_modules(model, tag)
            torch.manual_seed(0)
            ids = torch.randint(0, 512, (1, seq))  # [b, s]
            undo = _patch(log, tag)
            try:
                loss = model(ids, torch.arange(seq)[None], None, labels=torch.roll(ids, -1, dims=1))
                tag[0] = ("loss", "backward")
                loss.float().mean().backward()
            finally:
                for mod, attr, orig in undo:
                    setattr(mod, attr, orig)
            return {"log": log, "params": _layer_params(model)}
    finally:
        cp_comm._has_reduce_scatter = has_rs


def tp_comm_runs(rank: int, world: int, cases: list[tuple[str, bool]], seq: int) -> dict[str, dict]:
    """``{pattern: tp_comm_run(...)}`` of each ``(pattern, fused)`` case, one after the other in this worker (the
    process start and the imports paid once; each run builds and destroys its own megatron state)."""
    return {pattern: tp_comm_run(rank, world, pattern, seq, fused) for pattern, fused in cases}
