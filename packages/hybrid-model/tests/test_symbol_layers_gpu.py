"""megatron-core's own ``+`` (MLA), ``D`` (DSA), ``G`` (GDN) and ``M`` (Mamba) layers inside a DSv4 model (mHC
wrapped): build, forward + backward on one GPU, every parameter gets a finite gradient. ``+``/``D`` run with
transformer-engine's spec where it is installed and with the local spec (``hybrid_model.latent_attention``)
elsewhere; ``G``/``M`` need transformer-engine and ``fla`` / ``mamba_ssm`` + ``causal_conv1d`` (on CPU their
missing-dependency ``ImportError`` is tested in ``test_symbol_layers.py``). ``dsv4 train`` trains a ``+``/``D``
pattern in bf16 on CUDA."""

import importlib.util
import json

import pytest
import torch

from hybrid_model.presets import get_preset

NEEDS = {"W+E": [], "WDE": [], "WEGE": ["transformer_engine", "fla"]}
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


@pytest.mark.gpu
def test_mla_and_dsa_pattern_trains_in_bf16_on_cuda(tmp_path):
    """``dsv4 train --pattern W+D-E/+E`` on one GPU in bf16 (the local '+'/'D' specs without transformer-engine):
    finite losses that decrease, D's indexer loss logged."""
    from hybrid_model.cli import main

    run = tmp_path / "run"
    flags = ["--seq-len", "256", "--global-batch-size", "4", "--micro-batch-size", "2", "--warmup-steps", "0"]
    flags += ["--log-interval", "1", "--lr", "1e-2", "--bf16", "--steps", "10"]
    assert main(["train", *flags, "--pattern", "W+D-E/+E", "--out", str(run)]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["lm_loss"] for r in rows if "lm_loss" in r]
    assert len(losses) == 10 and all(x == x and x < 1e3 for x in losses), losses
    assert min(losses[-3:]) < losses[0], losses
    assert all(r.get("indexer_loss") is not None for r in rows if "lm_loss" in r)
