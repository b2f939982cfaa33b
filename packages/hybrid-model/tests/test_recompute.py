"""Activation recompute (``--recompute-*``): every module choice and full uniform/block give the gradients of a run
without recompute bit for bit on CPU (deterministic kernels), run their side effects once, and keep fewer bytes
for backward (counted with ``torch.autograd.graph.saved_tensors_hooks``)."""

import pytest
import torch

from dsv4_primitives.recompute import SELECTIVE_MODULES, RecomputeConfig
from hybrid_model.presets import get_preset

SETTINGS = {
    **{m: RecomputeConfig("selective", (m,)) for m in SELECTIVE_MODULES},
    "mhc-groups-of-2": RecomputeConfig("selective", ("mhc",), mhc_layer_num=2),
    "all-selective": RecomputeConfig(
        "selective",
        ("mhc", "layernorm", "mla_up_proj", "compressor", "indexer", "core_attn", "moe_act"),
        mhc_layer_num=3,
    ),
    "full-uniform-3": RecomputeConfig("full", method="uniform", num_layers=3),
    "full-block-5": RecomputeConfig("full", method="block", num_layers=5),
}


def _step(recompute, ids, *, count_saved=False):
    """One forward + backward of the tiny model (same init every call): loss, gradients, side effects, and the
    bytes of the distinct storages saved for backward."""
    from dsv4_attention import get_indexer_loss_tracker
    from hybrid_model.model import build_model

    get_indexer_loss_tracker().reset()
    torch.manual_seed(0)
    model = build_model(get_preset("tiny"), recompute=recompute).train()
    labels = torch.roll(ids, -1, 1)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, None, None, labels=labels).mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    loads = [
        m.router.local_tokens_per_expert.clone() for m in model.decoder.moe_layers() if not m.is_hash_layer
    ]
    return loss.detach(), grads, loads, get_indexer_loss_tracker().values.clone(), sum(saved.values())


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, get_preset("tiny").vocab_size, (2, 150), generator=g)  # > 128: HCA/CSA entries


@pytest.fixture(scope="module")
def reference(ids):
    from dsv4_testkit.megatron_cpu import megatron_cpu_context

    with megatron_cpu_context():
        return _step(None, ids)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_gradients_equal_no_recompute_bitwise(megatron_cpu, ids, reference, name):
    loss, grads, loads, indexer_losses, saved = _step(SETTINGS[name], ids)
    ref_loss, ref_grads, ref_loads, ref_indexer, ref_saved = reference
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    differ = [n for n in grads if grads[n] is None or not torch.equal(grads[n], ref_grads[n])]
    assert differ == []
    # side effects ran once: expert-load counters (bias update) and the indexer-loss tracker
    assert all(torch.equal(a, b) for a, b in zip(loads, ref_loads, strict=True))
    assert torch.equal(indexer_losses, ref_indexer)
    # every setting keeps fewer bytes for backward than no recompute
    assert saved < ref_saved, (name, saved, ref_saved)
