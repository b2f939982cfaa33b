"""megatron-core's own ``+`` (MLA), ``D`` (DSA), ``G`` (GDN) and ``M`` (Mamba) layers inside a DSv4 model (mHC
wrapped, with the transformer-engine backend): build, forward + backward on one GPU, every parameter gets a finite
gradient. These symbols need transformer-engine (and ``fla`` / ``mamba_ssm`` + ``causal_conv1d``); on CPU their
missing-dependency ``ImportError`` is tested in ``test_symbol_layers.py``."""

import importlib.util

import pytest
import torch

from hybrid_model.presets import get_preset

NEEDS = {"W+E": ["transformer_engine"], "WDE": ["transformer_engine"], "WEGE": ["transformer_engine", "fla"]}
NEEDS["WEME"] = ["transformer_engine", "mamba_ssm", "causal_conv1d"]


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", sorted(NEEDS))
def test_megatron_symbol_layers_build_and_train_on_gpu(megatron_cpu, pattern):
    missing = [m for m in NEEDS[pattern] if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{pattern!r} needs {missing} (the ImportError is tested on CPU)")
    from hybrid_model.model import build_model
    from hybrid_model.params import count_model_params

    cfg = get_preset("tiny").with_pattern(pattern + "/WE")
    model = build_model(cfg, params_dtype=torch.bfloat16, bf16=True).cuda()
    ids = torch.randint(0, cfg.vocab_size, (2, 64), device="cuda")
    pos = torch.arange(64, device="cuda")[None].expand(2, 64)
    model.train()
    loss = model(ids, pos, None, labels=torch.roll(ids, -1, 1))
    loss.float().mean().backward()
    assert torch.isfinite(loss.float()).all()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad.float()).all(), name
    assert count_model_params(model, cfg).total == sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
    )
