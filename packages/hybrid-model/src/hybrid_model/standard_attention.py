"""The ``*`` symbol's attention: megatron-core's standard ``SelfAttention`` with its own RoPE and a causal core.

megatron-core 0.19.2 builds ``*`` as ``SelfAttention`` (fused QKV projection, softmax core attention, output
projection) and feeds it the *model-level* RoPE. A DSv4 model has no model-level RoPE (its C/H/W attention rotates
its own last ``qk_rope_head_dim`` dims, as megatron's MLA/DSA do), so :class:`StandardSelfAttention` owns one:

* heads: ``num_attention_heads`` query and key/value heads of ``kv_channels = hidden_size / num_attention_heads``
  (megatron's defaults of a standard attention config);
* RoPE: megatron's ``RotaryEmbedding`` with base ``rope_theta`` over ``rotary_percent = qk_rope_head_dim / head_dim``
  of each head (the share of rotated dims a DSv4 layer has), positions restarting at every packed document;
* core: :class:`CausalSoftmaxAttention` (below), which runs on CPU and GPU and accepts packed THD batches
  (megatron's local ``DotProductAttention`` needs CUDA for its causal mask and refuses THD).

Inside the model the layer is one mHC-wrapped hybrid layer like every other symbol (``hybrid_model.stack``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule

#: the context-parallel refusal of the causal core (``*``'s record reads it; the local ``+`` refuses CP before)
CP_REFUSAL = (
    "the '*' layer (standard attention) and the '+' layer without transformer-engine (MLA) do not support context "
    "parallelism: use C/H/W layers or CP=1"
)


def document_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``doc[t]`` = index of the document row ``t`` belongs to (``[T]``); rows past ``cu_seqlens[-1]`` get -1."""
    rows = torch.arange(num_tokens, device=cu_seqlens.device)
    doc = torch.bucketize(rows, cu_seqlens[1:].to(rows.dtype), right=True)  # [T]
    return torch.where(rows < cu_seqlens[-1], doc, torch.full_like(doc, -1))


def causal_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, doc: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 reference of causal softmax attention.

    ``q [s, b, hq, d]``, ``k, v [s, b, hk, d]`` (``hq`` a multiple of ``hk``; key/value head ``j`` serves query
    heads ``j·hq/hk … (j+1)·hq/hk - 1``)::

        out[i, h] = Σ_j softmax_j(scale · q[i, h]·k[j, h'] + M[i, j]) v[j, h']
        M[i, j]   = 0 if j <= i and doc[i] == doc[j] (and doc[i] >= 0) else -inf

    ``doc`` (``[s]``, packed THD, ``b == 1``) restricts attention to each row's document; rows with ``doc = -1``
    (pack padding) attend only to themselves. Returns ``[s, b, hq, d]`` in ``q.dtype``.
    """
    s, hq, hk = q.shape[0], q.shape[2], k.shape[2]
    qf, kf, vf = (t.float() for t in (q, k, v))
    kf = kf.repeat_interleave(hq // hk, dim=2)
    vf = vf.repeat_interleave(hq // hk, dim=2)
    logits = torch.einsum("ibhd,jbhd->bhij", qf, kf) * scale  # [b, h, s, s]
    allowed = _allowed(s, doc, q.device)
    logits = logits.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("bhij,jbhd->ibhd", logits.softmax(-1), vf)
    return out.to(q.dtype)


def _allowed(s: int, doc: torch.Tensor | None, device) -> torch.Tensor:
    """``[s, s]`` boolean: row ``i`` may attend to column ``j`` (causal, same document; padding rows self only)."""
    idx = torch.arange(s, device=device)
    allowed = idx[None, :] <= idx[:, None]
    if doc is not None:
        same = doc[:, None] == doc[None, :]
        allowed = allowed & same & (doc[:, None] >= 0) | torch.eye(s, dtype=torch.bool, device=device)
    return allowed


class CausalSoftmaxAttention(MegatronModule):
    """Core attention of ``*`` (and of ``+`` without transformer-engine): causal softmax attention on ``[s, b, h, d]`` (SBHD) or ``[t, h, d]`` (THD).

    Same constructor and ``forward`` interface as megatron's ``DotProductAttention``; the math is
    :func:`causal_attention_reference`, computed with ``torch.nn.functional.scaled_dot_product_attention`` (a
    boolean block-causal mask for packed batches). No dropout (DSv4 trains without attention dropout).
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        **_unused,
    ) -> None:
        super().__init__(config=config)
        if pg_collection is not None and pg_collection.cp is not None and pg_collection.cp.size() > 1:
            raise ValueError(CP_REFUSAL)
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None:
            raise ValueError(
                "CausalSoftmaxAttention is causal by construction: no attention_mask / attention_bias"
            )
        thd = packed_seq_params is not None
        if thd:  # [t, h, d] -> [t, 1, h, d]
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        s, b, hq, _ = query.shape
        hk = key.shape[2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        if hk != hq:
            k = k.repeat_interleave(hq // hk, dim=1)
            v = v.repeat_interleave(hq // hk, dim=1)
        if thd:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            mask = _allowed(s, document_ids(cu, s), query.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        out = out.permute(2, 0, 1, 3)  # [s, b, h, dv] (dv = the value head dim, MLA's may differ from d)
        dv = out.shape[-1]
        return out.reshape(s, hq * dv) if thd else out.reshape(s, b, hq * dv)


class StandardSelfAttention(SelfAttention):
    """megatron's ``SelfAttention`` that computes its own RoPE when the stack passes none (see module doc)."""

    def __init__(
        self, config, submodules, layer_number: int, *args, rope_base: float, rotary_percent: float, **kw
    ):
        super().__init__(config, submodules, layer_number, *args, **kw)
        self.rotary = RotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=rotary_percent,
            rotary_interleaved=False,
            rotary_base=rope_base,
            use_cpu_initialization=True,
        )

    def forward(
        self, hidden_states, attention_mask=None, *args, rotary_pos_emb=None, packed_seq_params=None, **kw
    ):
        if rotary_pos_emb is None:
            if (
                packed_seq_params is not None
            ):  # [t, 1, d]: positions restart per document (cu_seqlens in RoPE)
                cu = packed_seq_params.cu_seqlens_q_padded
                cu = packed_seq_params.cu_seqlens_q if cu is None else cu
                length = int((cu[1:] - cu[:-1]).max())
            else:  # sequence parallelism: the QKV projection gathers this rank's s/tp rows into the s of all ranks
                sp = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
                length = hidden_states.shape[0] * sp
            emb = self.rotary(length).to(hidden_states.device)  # [length, 1, 1, rot]
            rotary_pos_emb = (emb, emb)
        return super().forward(
            hidden_states,
            attention_mask,
            *args,
            rotary_pos_emb=rotary_pos_emb,
            packed_seq_params=packed_seq_params,
            **kw,
        )
