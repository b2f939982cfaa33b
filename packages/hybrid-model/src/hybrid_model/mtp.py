"""DSv4 multi-token prediction (spec §8), adapted to mHC; ``D >= 1`` chained depths (pattern ``main/WE/WE``).

    X_L [s, b, n, d]  main streams before the HyperHead;   e = Embed(ids rolled left by one)   [s, b, d]
    Xm  = h_proj(RMSNorm_hnorm(X_L))  +  e_proj(RMSNorm_enorm(e))[:, :, None]                 [s, b, n, d]
    Xm  = Block_mtp(Xm)          window-only attention (ratio 0) + learned top-k MoE, each with its own mHC
    h   = RMSNorm_norm(HyperHead_mtp(Xm))                                                     [s, b, d]
    logits_mtp = h @ head.weight.T (shared head);   position t predicts token t+2 (last positions masked)

Depth ``k`` (1-based) reads the streams of depth ``k - 1`` (depth 1: the main streams) and the embedding of the ids
rolled left by ``k``; its position ``t`` predicts token ``t + k + 1``. Each depth's layers follow the MTP part of the
pattern (``WE`` in DSv4; any symbols but hash routing, which is never used in MTP layers).

The depth's layers take ``layer_number`` = the depth ``k`` with ``is_mtp_layer=True``, so routers and the indexer-loss
tracker put them in the MTP slots after the main layers (upstream P4's per-depth metric slots).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import sharded_state_dict_default
from torch import nn

from dsv4_attention.layout import STATIC_BOUNDS_ATTR
from dsv4_primitives import RMSNorm
from dsv4_primitives.recompute import checkpoint_layers, recompute_config_of
from hash_moe.megatron import DSv4MoELayer
from hybrid_model.layers import build_hybrid_layer
from hybrid_model.residual import SingleStreamHead
from hybrid_model.tensor_parallel import sequence_shard
from mhc import HyperHead
from thd_packing import roll_left, roll_left_contiguous_cp


def mtp_roll_left(x: torch.Tensor, packed_seq_params=None, cp_group=None) -> torch.Tensor:
    """``x [b, s]`` moved one token left along ``s``: ``out[..., t] = x[..., t + 1]``, 0 where ``t + 1`` is past the
    sequence or, for a packed THD ``[1, T]`` batch, outside ``t``'s document.

    THD documents are the *padded* intervals ``cu_seqlens_q_padded`` (``cu_seqlens_q`` when there is no padding),
    the row layout the attention uses: a real token is never fed the next document's first token (megatron's
    ``roll_tensor`` rolls inside the *unpadded* ``cu_seqlens_q`` intervals, which are not row offsets once a pack has
    per-document padding). Used for the MTP input ids, labels and loss mask (applied twice: targets ``t + 2``).

    ``cp_group`` (static contiguous context parallelism, size > 1): ``x [1, L]`` is this CP rank's slice of the
    global pack that ``packed_seq_params`` describes; thd-packing's contiguous-CP roll (P9) takes the next rank's first
    row with one point-to-point exchange (gradients go back the same way), so the result is this rank's slice of the
    roll of the whole pack.
    """
    if cp_group is not None:
        if packed_seq_params is None:
            raise ValueError(
                "the MTP roll under context parallelism needs the global THD pack (packed_seq_params); [B, S] "
                "batches run under CP as a THD pack of B documents"
            )
        return roll_left_contiguous_cp(x, _document_rows(packed_seq_params), cp_group, fill_value=0, dim=-1)
    if packed_seq_params is None:
        out = torch.roll(x, shifts=-1, dims=-1)
        out[..., -1] = 0
        return out
    validate = not _is_static(packed_seq_params)  # static packs (CUDA graphs): boundaries stay on the device
    return roll_left(x, _document_rows(packed_seq_params), shifts=1, fill_value=0, dim=-1, validate=validate)


def _is_static(packed_seq_params) -> bool:
    """A static-shape pack (``--cuda-graph --packed``): its boundaries stay on the device (no host reads)."""

    return bool(getattr(packed_seq_params, STATIC_BOUNDS_ATTR, False))


def _document_rows(packed_seq_params) -> torch.Tensor:
    """Row offsets ``[D + 1]`` of a THD pack's documents: ``cu_seqlens_q_padded`` (``cu_seqlens_q`` without padding)."""
    cu = packed_seq_params.cu_seqlens_q_padded
    return packed_seq_params.cu_seqlens_q if cu is None else cu


def router_cu_seqlens(packed_seq_params, num_tokens: int, rows_group=None) -> torch.Tensor | None:
    """Row intervals ``[D + 1]`` of a THD pack for the MoE routers' per-document balance loss: the *padded* document
    intervals (:func:`_document_rows`) with the pack's tail rows after the last document (static-shape padding) as
    one more interval, so that the intervals cover all ``num_tokens`` rows (hash-moe's balance loss needs
    ``cu_seqlens[-1] == T``). Padding rows lie inside these intervals; the model's ``padding_mask`` drops them.

    ``rows_group`` (size ``P`` > 1: contiguous CP, or TP x CP under sequence parallelism, where rank ``r`` of the
    group holds the ``r``-th slice): ``num_tokens`` is this rank's ``L`` rows of the global pack of ``P·L`` rows; the
    global intervals are clipped to the rank's rows ``[r·L, (r+1)·L)`` and shifted to local offsets. Every rank keeps
    all ``D + 1`` entries (documents it holds no row of are empty), so document ``d`` is the same document on every
    rank and the routers can sum their per-document statistics over the group."""
    if packed_seq_params is None:
        return None
    if _is_static(packed_seq_params):  # --cuda-graph --packed: no host read; the tail interval may be empty
        cu = _document_rows(packed_seq_params)
        return torch.cat([cu, torch.full((1,), num_tokens, dtype=cu.dtype, device=cu.device)])
    if rows_group is not None:
        size, rank = rows_group.size(), rows_group.rank()
        cu = router_cu_seqlens(packed_seq_params, num_tokens * size)
        return (cu.long() - rank * num_tokens).clamp(0, num_tokens).to(cu.dtype)
    cu = _document_rows(packed_seq_params)
    end = int(cu[-1])
    if end > num_tokens:
        raise ValueError(f"packed_seq_params cover {end} rows but the pack holds {num_tokens} tokens")
    if end < num_tokens:
        cu = torch.cat([cu, cu.new_tensor([num_tokens])])
    return cu


def mtp_full_recompute(config, num_decoder_layers: int) -> bool:
    """Whether the MTP depths are recomputed: under full recompute (``--recompute-granularity full``) when the
    stage's last decoder layer is checkpointed too (uniform: always; block: when ``--recompute-num-layers`` covers
    the whole stage), i.e. the MTP block counts as part of the stage's last chunk."""

    rc = recompute_config_of(config)
    if not rc.full:
        return False
    chunks = rc.full_chunks(num_decoder_layers)
    return not chunks or chunks[-1][2]


def run_mtp_depth(
    depth,
    embedding,
    streams,
    ids,
    position_ids,
    router_cu,
    *,
    recompute: bool,
    sequence_parallel_group=None,
    **layer_kwargs,
):
    """One MTP ``depth`` on ``streams [s, b, n, d]`` and the ids ``[b, s]`` rolled for it: binds the ids to the
    depth's MoE routers, embeds them, runs the depth. Returns ``(h [s, b, d], streams [s, b, n, d])``, the streams
    ``None`` after the last depth (nothing reads them).

    ``recompute``: the depth runs as reentrant checkpoints (:func:`dsv4_primitives.recompute.checkpoint_layers`),
    one per sub-layer as in the main stack: (embedding lookup + input projections), each layer of the block, (HyperHead
    + norm). Only each chunk's input streams are saved (``streams``, kept by the main stack anyway, and the fp32
    streams ``[s, b, n·d]`` between the chunks), so a backward recomputes one sub-layer at a time: one checkpoint over
    the whole depth held both of its sub-layers' activations at once in backward, the step's activation peak on
    flash-smoke (issue #33). Every chunk binds the ids to the depth's MoE routers first (a later micro-batch may have
    bound others before the recompute runs). Side effects guarded by ``torch.is_grad_enabled()`` (expert-load
    counters, loss trackers) run once.

    ``sequence_parallel_group``: the TP group under sequence parallelism (``streams`` are this rank's ``[s/tp, b, n,
    d]``; the embedding scatters its output the same way, the routers get this rank's ids)."""
    last = depth.next_depth is None
    router_ids = sequence_shard(ids, sequence_parallel_group)
    s, b, n, d = streams.shape  # [s, b, n, d]

    def bind() -> None:
        for moe in depth.moe_layers():
            moe.set_input_ids(router_ids, router_cu)

    def embed():
        return embedding(input_ids=ids, position_ids=position_ids)  # [s(/tp), b, d]

    if not recompute:
        bind()
        h, out = depth(streams, embed(), return_streams=True, **layer_kwargs)  # [s, b, d], [s, b, n, d]
        return (h, None) if last else (h, out)

    def enter(x):
        bind()
        return depth.enter(x, embed())  # [s, b, n·d]

    def sublayer(layer):
        def run(x):
            bind()
            return layer(x, **layer_kwargs)[0]  # [s, b, n·d]

        return run

    def leave(x):
        return depth.leave(x.view(s, b, n, d))  # [s, b, d]

    x = checkpoint_layers(enter, streams)
    for layer in depth.block:
        x = checkpoint_layers(sublayer(layer), x)
    h = checkpoint_layers(leave, x)
    return (h, None) if last else (h, x.view(s, b, n, d))


class DSv4MultiTokenPrediction(MegatronModule):
    """One DSv4 MTP depth (``mtp.*`` parameters). ``forward(streams, next_embedding, **layer_kwargs) -> h [s, b, d]``."""

    def __init__(
        self,
        config,
        submodules,
        mhc,
        pg_collection,
        depth: int = 1,
        pattern: str = "WE",
        num_depths: int = 1,
        enable_mhc: bool = True,
    ) -> None:
        super().__init__(config=config)
        d = config.hidden_size
        self.mhc_config = mhc
        self.depth = depth
        self.pattern = pattern
        eps = config.layernorm_epsilon
        self.enorm = RMSNorm(d, eps=eps, config=config)
        self.hnorm = RMSNorm(d, eps=eps, config=config)
        self.e_proj = nn.Linear(d, d, bias=False, dtype=config.params_dtype)
        self.h_proj = nn.Linear(d, d, bias=False, dtype=config.params_dtype)
        if config.perform_initialization:
            config.init_method(self.e_proj.weight)
            config.init_method(self.h_proj.weight)
        self.block = nn.ModuleList(  # one mHC-wrapped layer per symbol of the depth's pattern (DSv4: W, E)
            build_hybrid_layer(
                symbol,
                submodules,
                config,
                layer_number=depth,
                pg_collection=pg_collection,
                is_mtp_layer=True,
                pp_layer_offset=0,
                hashed=False,  # hash routing is never used in MTP layers
                mhc=mhc,
                plain_residual=not enable_mhc,
            )
            for symbol in pattern
        )
        if enable_mhc:
            self.hyper_head = HyperHead(mhc)
        else:
            self.hyper_head = SingleStreamHead()
        self.norm = RMSNorm(d, eps=eps, config=config)
        self.tp_group = pg_collection.tp
        # depth k + 1 reads this depth's streams (spec §8 / DeepSeek-V3 MTP chaining); its parameters are
        # ``mtp.next_depth.*`` so that depth 1 keeps the ``mtp.*`` names of a one-depth model
        self.next_depth = (
            DSv4MultiTokenPrediction(
                config, submodules, mhc, pg_collection, depth + 1, pattern, num_depths, enable_mhc
            )
            if depth < num_depths
            else None
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """megatron's default treats the plain ``nn.ModuleList`` :attr:`block` as replicated tensors, which loses
        the layers' own sharding (experts split over EP): ask every block layer for its sharded state instead."""

        out = {}
        for name, child in self.named_children():
            if name == "next_depth":
                out.update(child.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
                continue
            subs = (
                [(f"{name}.{i}.", m) for i, m in enumerate(child)]
                if name == "block"
                else [(f"{name}.", child)]
            )
            for sub_prefix, module in subs:
                out.update(
                    sharded_state_dict_default(
                        module, prefix + sub_prefix, sharded_offsets, metadata, tp_group=self.tp_group
                    )
                )
        assert not list(self.named_parameters(recurse=False)), (
            "DSv4MultiTokenPrediction has no own parameters"
        )
        return out

    @property
    def layers(self) -> tuple:
        """megatron's schedules walk ``model.mtp.layers`` for its own (CUDA-graphed) MTP layers; this depth has
        none of those (its layers are :attr:`block`)."""
        return ()

    def depths(self) -> list[DSv4MultiTokenPrediction]:
        """This depth and the ones after it (``[depth 1, depth 2, ...]`` on the model's ``mtp``)."""
        return [self] + (self.next_depth.depths() if self.next_depth is not None else [])

    def moe_layers(self) -> list:
        """The ``DSv4MoELayer`` of every ``E`` layer of this depth (not of the next ones)."""

        mlps = (getattr(layer.inner_layer, "mlp", None) for layer in self.block)
        return [mlp for mlp in mlps if isinstance(mlp, DSv4MoELayer)]

    def forward(
        self,
        streams: torch.Tensor,
        next_embedding: torch.Tensor,
        *,
        return_streams: bool = False,
        **layer_kwargs,
    ):
        """``streams [s, b, n, d]`` (main streams, or the previous depth's), ``next_embedding [s, b, d]`` -> this
        depth's ``h [s, b, d]`` (and its streams ``[s, b, n, d]`` for the next depth with ``return_streams``):
        :meth:`enter`, the block's layers, :meth:`leave` (:func:`run_mtp_depth` runs the same pieces, each as a
        recompute chunk under full recompute)."""
        s, b, n, d = streams.shape  # [s, b, n, d]
        x = self.enter(streams, next_embedding)  # [s, b, n·d]
        for layer in self.block:
            x, _ = layer(x, **layer_kwargs)
        h = self.leave(x.view(s, b, n, d))  # [s, b, d]
        return (h, x.view(s, b, n, d)) if return_streams else h

    def enter(self, streams: torch.Tensor, next_embedding: torch.Tensor) -> torch.Tensor:
        """The block's input ``Xm = h_proj(hnorm(X)) + e_proj(enorm(e))`` as stream-dtype ``[s, b, n·d]`` from
        ``streams [s, b, n, d]`` and ``next_embedding [s, b, d]``."""
        s, b, n, d = streams.shape  # [s, b, n, d]
        e = self.e_proj(self.enorm(next_embedding))  # [s, b, d]
        h = self.h_proj(self.hnorm(streams).to(self.h_proj.weight.dtype))  # [s, b, n, d]
        return (h + e[:, :, None, :]).to(self.mhc_config.stream_dtype).reshape(s, b, n * d)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """``h = norm(HyperHead(x))`` ``[s, b, d]`` from the block's output streams ``x [s, b, n, d]``."""
        out_dtype = torch.bfloat16 if self.config.bf16 else None
        return self.norm(self.hyper_head(x, out_dtype=out_dtype))  # [s, b, d]
