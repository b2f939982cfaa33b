"""``decode_step_counts``: the host syncs, uploads and aten ops of one eager decode step of a model, per layer kind.

One :class:`~hybrid_model.generation.decoder.CachedDecoder` prefills ``batch`` prompts, then one
:meth:`~hybrid_model.generation.decoder.CachedDecoder.extend` of one token per sequence runs under
:func:`~hybrid_model.generation.op_count.count_ops` with the scopes::

    window / csa / hca   every DSv4 attention layer of that kind (the bound decode step, all of its ops)
    moe                  every DSv4 MoE layer (router, megatron's token dispatcher, experts)
    other                the rest: the decoder's host planning, embedding, mHC, HyperHead, norm, output layer

``packages/hybrid-model/tools/decode_step_counts.py`` prints the table of the ``tiny`` preset (the README's numbers).
"""

from __future__ import annotations

import torch

from dsv4_attention.megatron import DSv4HybridAttention
from hash_moe.megatron import DSv4MoELayer
from hybrid_model.generation.decoder import CachedDecoder
from hybrid_model.generation.op_count import ScopeCounts, count_ops


def layer_scopes(model) -> dict[torch.nn.Module, str]:
    """Every attention layer of the main decoder -> its kind's name (``window`` / ``csa`` / ``hca``), every MoE
    layer of it -> ``moe`` (MTP depths are not run by a decode step)."""
    scopes: dict[torch.nn.Module, str] = {}
    for module in model.decoder.modules():
        if isinstance(module, DSv4HybridAttention):
            scopes[module] = module.kind.name.lower()
        elif isinstance(module, DSv4MoELayer):
            scopes[module] = "moe"
    return scopes


@torch.no_grad()
def decode_step_counts(model, batch: int, prompt_length: int = 9, *, seed: int = 0) -> dict[str, ScopeCounts]:
    """Counts of the second decode step after a prefill of ``batch`` random prompts of ``prompt_length`` tokens
    (the first step after the prefill is counted too, untimed, as a warm-up of lazily built tables)."""
    vocab = model.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (batch, prompt_length), generator=g).tolist()
    decoder = CachedDecoder(model, batch, prompt_length + 2)
    decoder.extend(prompts, last_only=True)
    decoder.extend([[1]] * batch, last_only=True)
    scopes = layer_scopes(model)
    with count_ops(scopes) as counts:
        decoder.extend([[2]] * batch, last_only=True)
    return dict(counts)


def layers_per_scope(model) -> dict[str, int]:
    """How many modules each scope name of :func:`layer_scopes` covers."""
    out: dict[str, int] = {}
    for name in layer_scopes(model).values():
        out[name] = out.get(name, 0) + 1
    return out


def format_table(model, batches: tuple[int, ...] = (1, 4)) -> str:
    """A markdown table: per batch and scope, syncs / uploads / ops (per layer for the layer scopes)."""
    layers = layers_per_scope(model)
    lines = [
        "| batch | scope | layers | syncs | uploads | ops | ops per layer |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in batches:
        counts = decode_step_counts(model, b)
        whole = ScopeCounts()
        for name in sorted(counts):
            c = counts[name]
            whole.add(c)
            n = layers.get(name, 1)
            lines.append(f"| {b} | {name} | {n} | {c.syncs} | {c.uploads} | {c.ops} | {c.ops // n} |")
        lines.append(f"| {b} | **step** | | {whole.syncs} | {whole.uploads} | {whole.ops} | |")
    return "\n".join(lines)
