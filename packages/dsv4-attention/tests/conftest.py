"""Shared fixtures: the tiny DSv4 attention config (spec §9.4) and layer builders on megatron-core's CPU state."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# the independent reference (_attention_reference.py) is importable under --import-mode=importlib
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from _attention_testconfig import TINY, tiny_config  # noqa: E402,F401


@pytest.fixture
def pg(megatron_cpu):
    """An explicit ProcessGroupCollection of the world-size-1 megatron state."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


@pytest.fixture
def build(pg):
    """``build(ratio, layer_number=1, seed=0, init_std=None, **config_overrides)`` -> a DSv4HybridAttention in train mode.

    ``init_std`` re-draws every parameter (incl. sink and ape) from N(0, init_std^2) so that no term is trivially 0.
    """
    from megatron.core.transformer.spec_utils import build_module

    from dsv4_attention.megatron import get_dsv4_attention_spec

    def _build(ratio, layer_number=1, seed=0, init_std=0.2, is_mtp_layer=False, **overrides):
        torch.manual_seed(seed)
        cfg = tiny_config(**overrides)
        m = build_module(
            get_dsv4_attention_spec(ratio, is_mtp_layer=is_mtp_layer),
            config=cfg,
            layer_number=layer_number,
            pg_collection=pg,
        )
        if init_std is not None:
            with torch.no_grad():
                for name, p in m.named_parameters():
                    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                        p.copy_(1.0 + 0.1 * torch.randn_like(p))
                    else:
                        p.normal_(0.0, init_std)
        return m.train()

    return _build
