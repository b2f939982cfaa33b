"""The sync-free multi-tensor ops that replace megatron-core's local fallbacks (``dsv4_primitives.megatron.
multi_tensor``): the same values as the fallbacks, in place where megatron asks for it, installed only over the
fallbacks, and (GPU) no host synchronisation."""

import pytest
import torch
from megatron.core import utils as megatron_utils
from megatron.core.optimizer import clip_grads, optimizer

from dsv4_primitives.megatron import cuda_as_cpu
from dsv4_primitives.megatron.multi_tensor import (
    foreach_l2norm,
    foreach_scale,
    install_foreach_multi_tensor_ops,
    remove_foreach_multi_tensor_ops,
)
from dsv4_testkit.tolerance import assert_close_to_ref


def _grads(device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    shapes = [(7,), (3, 5), (1,), (33, 2, 3), (0,), (129,)]  # odd sizes and an empty tensor
    return [torch.randn(s, generator=g, dtype=torch.float32).to(device=device, dtype=dtype) for s in shapes]


def test_l2norm_matches_megatron_fallback_and_fp64():
    grads = _grads()
    noop = torch.zeros(1, dtype=torch.int)
    total, per = foreach_l2norm(2048 * 32, noop, [grads], True)
    with cuda_as_cpu():  # the fallback puts its result on device="cuda"
        fallback, _ = megatron_utils.local_multi_tensor_l2_norm(2048 * 32, noop, [grads], False)
    exact = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).reshape(1)
    assert total.shape == (1,) and total.dtype == torch.float32
    # yardstick: the fallback's own fp32 error
    assert_close_to_ref("l2norm", total, exact, ref_same_dtype=fallback.cpu().double())
    assert torch.equal(per, torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    empty, none = foreach_l2norm(0, noop, [[]], False)
    assert torch.equal(empty, torch.zeros(1)) and none is None


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_scale_equals_fallback_bitwise(dst_dtype, scale):
    """Same process, same arithmetic (one fp32 product rounded once into dst): bitwise equal to the fallback."""
    src = _grads()
    ours = [torch.full_like(s, float("nan"), dtype=dst_dtype) for s in src]  # NaN-poisoned destinations
    theirs = [torch.empty_like(s, dtype=dst_dtype) for s in src]
    foreach_scale(0, None, [src, ours], scale)
    megatron_utils.local_multi_tensor_scale(0, None, [src, theirs], scale)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_scale_in_place_for_clipping():
    grads = _grads()
    expected = [g * 0.25 for g in grads]
    ptrs = [g.data_ptr() for g in grads]
    foreach_scale(0, None, [grads, grads], 0.25)
    assert [g.data_ptr() for g in grads] == ptrs
    for g, e in zip(grads, expected, strict=True):
        assert torch.equal(g, e)
    with pytest.raises(ValueError, match="2 source tensors but 1 destinations"):
        foreach_scale(0, None, [grads[:2], grads[:1]], 1.0)


def test_install_replaces_only_megatron_fallbacks():
    sites = [
        (clip_grads, "l2_norm_impl"),
        (clip_grads, "multi_tensor_scale_impl"),
        (optimizer, "multi_tensor_scale_impl"),
    ]
    before = [getattr(m, n) for m, n in sites]
    try:
        remove_foreach_multi_tensor_ops()
        fallbacks = {megatron_utils.local_multi_tensor_l2_norm, megatron_utils.local_multi_tensor_scale}
        if not all(getattr(m, n) in fallbacks for m, n in sites):
            pytest.skip("transformer-engine / apex ops are installed here: nothing to replace")
        assert len(install_foreach_multi_tensor_ops()) == 3
        assert install_foreach_multi_tensor_ops() == []  # idempotent
        assert [getattr(m, n) for m, n in sites] == [foreach_l2norm, foreach_scale, foreach_scale]

        def fused_op(*args):  # what apex / transformer-engine would have put there
            raise AssertionError("not called")

        remove_foreach_multi_tensor_ops()
        clip_grads.l2_norm_impl = fused_op
        install_foreach_multi_tensor_ops()
        assert clip_grads.l2_norm_impl is fused_op
    finally:
        for (m, n), f in zip(sites, before, strict=True):
            setattr(m, n, f)


@pytest.mark.gpu
def test_no_host_sync_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    grads = _grads("cuda")
    noop = torch.zeros(1, dtype=torch.int, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        total, _ = foreach_l2norm(0, noop, [grads], False)
        foreach_scale(0, noop, [grads, grads], 0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    exact = torch.sqrt(sum((g.double().cpu() ** 2).sum() for g in _grads())).reshape(1)
    assert_close_to_ref("l2norm", total.cpu(), exact)
