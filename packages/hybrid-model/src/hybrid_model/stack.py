"""``DSv4HybridStack``: the mHC hybrid stack with the DSv4 symbols ``C``/``H``/``W`` and hash-routed ``E`` layers.

megatron-core 0.19.2's ``HybridStack`` knows neither C/H/W nor hash MoE; this stack builds every layer itself
(:func:`hybrid_model.layers.build_hybrid_layer`: every symbol's record, :mod:`hybrid_model.mixers`)
(``layer_number = i + 1 + pp_layer_offset``, counting every symbol, as ``HybridStack`` does), wraps every layer in
:class:`mhc.megatron.HyperConnectionLayer`, expands the embedding into ``n`` streams on the first stage and collapses
them with the HyperHead + final RMSNorm on the last (returning the streams too, for MTP).

``input_ids`` reach the MoE routers through :meth:`bind_input_ids` (hash layers need them; THD ``cu_seqlens``
make the balance loss per document).
"""

from __future__ import annotations

from torch import nn

from hash_moe.megatron import DSv4MoELayer
from hybrid_model.layers import build_hybrid_layer
from hybrid_model.residual import SingleStreamHead
from hybrid_model.symbols import MOE
from mhc.megatron import HyperConnectionHybridStack


class DSv4HybridStack(HyperConnectionHybridStack):
    """Decoder stack of a DSv4 model (one pipeline segment).

    Args (beyond ``HyperConnectionHybridStack``'s): ``model_config`` (:class:`~hybrid_model.config.DSv4ModelConfig`,
    for the hash-layer positions) and ``submodules`` (:class:`~hybrid_model.spec.DSv4StackSubmodules`).
    """

    def __init__(
        self,
        config,
        submodules,
        pre_process: bool = True,
        layer_type_list: list[str] | None = None,
        pp_layer_offset: int = 0,
        post_process: bool = True,
        *,
        model_config=None,
        pg_collection=None,
        is_mtp_layer: bool = False,
        mhc=None,
        return_streams: bool = False,
        name: str | None = None,
        device=None,
        dtype=None,
        post_layer_norm: bool = True,
    ) -> None:
        if layer_type_list is None:
            raise ValueError(
                "DSv4HybridStack needs layer_type_list (HybridModel computes it from the pattern)"
            )
        if model_config is None:
            raise ValueError("DSv4HybridStack needs model_config (a DSv4ModelConfig)")
        # build an empty HybridStack (pre/post modules only), then the DSv4 layers here
        super().__init__(
            config,
            submodules,
            pre_process=pre_process,
            layer_type_list=[],
            pp_layer_offset=pp_layer_offset,
            post_process=post_process,
            pg_collection=pg_collection,
            is_mtp_layer=is_mtp_layer,
            mhc=mhc,
            return_streams=return_streams,
            post_layer_norm=post_layer_norm,
        )
        self.layer_type_list = list(layer_type_list)
        hashed = set() if is_mtp_layer else set(model_config.hash_layer_numbers)
        layers = [
            build_hybrid_layer(
                symbol,
                submodules,
                config,
                layer_number=i + 1 + pp_layer_offset,
                pg_collection=pg_collection,
                is_mtp_layer=is_mtp_layer,
                pp_layer_offset=pp_layer_offset,
                hashed=symbol == MOE and i + 1 + pp_layer_offset in hashed,
                mhc=self.mhc_config,
                plain_residual=not model_config.enable_mhc_connections,
            )
            for i, symbol in enumerate(self.layer_type_list)
        ]
        self.layers = nn.ModuleList(layers)
        if not model_config.enable_mhc_connections and self.post_process:
            self.hyper_head = SingleStreamHead()  # one stream (mhc.num_streams = 1): no HyperHead parameters
        self.num_layers_per_pipeline_rank = len(self.layers)

    def moe_layers(self):
        """The ``DSv4MoELayer`` of every ``E`` layer of this segment."""
        mlps = (getattr(layer.inner_layer, "mlp", None) for layer in self.layers)
        return [mlp for mlp in mlps if isinstance(mlp, DSv4MoELayer)]

    def capture_layer_state(self):
        """The token ids bound to the MoE routers now, re-bound by the returned function (a full-recompute chunk
        runs its layers again in backward, after the model has unbound them)."""
        bound = [(moe, moe._bound_input_ids, moe._bound_cu_seqlens) for moe in self.moe_layers()]

        def restore() -> None:
            for moe, ids, cu in bound:
                moe.set_input_ids(ids, cu)

        return restore

    def bind_input_ids(self, input_ids, cu_seqlens=None) -> None:
        """Bind ``input_ids [B, S]`` (THD: ``[1, T]`` + ``cu_seqlens``) for this forward's MoE routers."""
        for moe in self.moe_layers():
            moe.set_input_ids(input_ids, cu_seqlens)
