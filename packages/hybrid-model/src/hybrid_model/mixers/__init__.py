"""One record per hybrid pattern symbol (issue #30).

Each symbol's module holds its :class:`~hybrid_model.mixers.record.SymbolRecord`: the spec builder, how the stack
builds the layer, the optional packages it needs, the layouts it refuses with their reasons, its parameter count
and its FLOPs. :mod:`hybrid_model.mixers.registry` maps symbol -> record; the stack spec, the layer builder, the
parameter and FLOP accounting and the refusals read the records.

============  ======================================================  =========================================
module        symbol                                                  implementation it names
============  ======================================================  =========================================
``window``    ``W`` sliding-window attention                          dsv4-attention (``dsv4_kinds``: W/C/H's
``csa``       ``C`` compressed sparse attention                       shared parts)
``hca``       ``H`` heavily compressed attention
``moe``       ``E`` DSv4 MoE (hash / learned router)                  hash-moe
``mlp``       ``-`` dense SwiGLU MLP                                  megatron ``MLP``
``attention`` ``*`` standard attention                                :mod:`hybrid_model.standard_attention`
``mla``       ``+`` megatron's MLA (``latent``: ``+``/``D``'s shared)  :mod:`hybrid_model.latent_attention`
``dsa``       ``D`` megatron's DSA                                    :mod:`hybrid_model.latent_attention`
``gdn``       ``G`` megatron's gated delta net                        :mod:`hybrid_model.gated_delta_net_layer`
``mamba``     ``M`` megatron's Mamba (TE spec only)                   megatron ``MambaLayer``
============  ======================================================  =========================================

This package module imports nothing: the implementation modules import :mod:`hybrid_model.mixers.record` (and are
imported by the symbol modules), so importing the registry here would close a circle.
"""
