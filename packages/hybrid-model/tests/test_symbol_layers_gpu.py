"""megatron-core's own ``+`` (MLA), ``D`` (DSA), ``G`` (GDN) and ``M`` (Mamba) layers inside a DSv4 model (mHC
wrapped): build, forward + backward on one GPU, every parameter gets a finite gradient, the analytic parameter
count equals the built model's. ``+``/``D``/``G`` run with transformer-engine's spec where it is installed and with
the local specs (``hybrid_model.latent_attention``, ``hybrid_model.gated_delta_net``) elsewhere; ``G`` needs
``fla`` (the ``hybrid-model[gdn]`` extra), ``M`` transformer-engine, ``mamba_ssm`` and ``causal_conv1d`` (on CPU
their missing-dependency ``ImportError`` is tested in ``test_symbol_layers.py``). ``dsv4 train`` trains a
``+``/``D`` pattern and a ``G`` pattern (``[B, S]``) in bf16 on CUDA; packed THD with ``G`` trains on fla's varlen
kernels where they are trusted and is refused elsewhere (on the H200, Triton 3.6: refused, and ``G`` runs megatron's
torch rule, whose output is checked against fla's forward kernels)."""

import importlib.util

import pytest
import torch

from hybrid_model.presets import get_preset

NEEDS = {"W+E": [], "WDE": [], "WEGE": ["fla"]}
NEEDS["WEME"] = ["transformer_engine", "mamba_ssm", "causal_conv1d"]


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", sorted(NEEDS))
def test_megatron_symbol_layers_build_and_train_on_gpu(megatron_cpu, pattern):
    missing = [m for m in NEEDS[pattern] if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{pattern!r} needs {missing} (the ImportError is tested on CPU)")
    from hybrid_model.model import build_model
    from hybrid_model.params import analytic_param_counts, count_model_params

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
    built = count_model_params(model, cfg).total
    assert built == sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
    )
    if "M" not in pattern:  # Mamba is counted from a built model only
        assert analytic_param_counts(cfg).total == built
    if "G" in pattern:  # megatron's torch rule exactly where fla's kernels are not correct
        from hybrid_model.gated_delta_net_layer import GatedDeltaNetLayer, fla_chunk_kernels_correct

        gdn = [m for m in model.modules() if isinstance(m, GatedDeltaNetLayer)]
        assert len(gdn) == 1 and gdn[0].torch_delta_rule is not fla_chunk_kernels_correct()[0]


def _needs_fla():
    if importlib.util.find_spec("fla") is None:
        pytest.skip("'G' needs fla (the hybrid-model[gdn] extra)")


@pytest.mark.gpu
def test_gdn_torch_rule_matches_fla_forward(megatron_cpu):
    """The local ``G`` layer on fla's chunked forward kernels against the same layer on megatron's torch gated delta
    rule (what runs where fla's kernels are not correct), fp32 on [200, 2] tokens (not a multiple of the 64-token
    chunk). fla's Triton dots run in TF32, so the bound is the guide's: fla's error against the torch rule in full
    fp32 is at most 2x that of the torch rule itself with TF32 matmuls and convolutions, + 1e-6."""
    _needs_fla()
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from hybrid_model.mixers.gdn import local_gdn_layer_spec
    from hybrid_model.spec import transformer_config

    cfg = get_preset("tiny").with_pattern("WGE")
    pg = ProcessGroupCollection.use_mpu_process_groups()
    layers = []
    for deterministic in (False, True):
        torch.manual_seed(0)
        config = transformer_config(cfg, deterministic_mode=deterministic)
        spec = local_gdn_layer_spec().submodules
        layers.append(TransformerLayer(config, spec, layer_number=1, pg_collection=pg).cuda())
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(200, 2, cfg.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        outs = {}
        for name, layer, tf32 in (("fla", 0, False), ("ref", 1, False), ("peer", 1, True)):
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
            with torch.no_grad():
                outs[name] = layers[layer](x)[0]
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    err = (outs["fla"] - outs["ref"]).abs().max().item()
    peer = (outs["peer"] - outs["ref"]).abs().max().item()
    assert torch.isfinite(outs["fla"]).all() and peer > 0
    assert err <= 2 * peer + 1e-6, (err, peer, outs["ref"].abs().max().item())
