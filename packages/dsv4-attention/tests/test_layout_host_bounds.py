"""Host-side layout facts (no device read-back): segment bounds, RoPE bound, compressed-entry counts, layout reuse."""

from __future__ import annotations

import itertools

import torch
from megatron.core.packed_seq_params import PackedSeqParams

import dsv4_attention._rope as rope_mod
from dsv4_attention import sbhd_layout, thd_layout
from dsv4_attention.layout import TokenLayout
from dsv4_primitives.varlen import SeqBoundaries


def _psp(cu, padded=None):
    cu = torch.tensor(cu, dtype=torch.int32)
    kw = {}
    if padded is not None:
        kw["cu_seqlens_q_padded"] = torch.tensor(padded, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), **kw)


def test_sbhd_bounds_and_reuse():
    a = sbhd_layout(37, 3)
    assert a.bounds.cu_seqlens_host == (0, 37, 74, 111)
    assert a.bounds.cu_seqlens_host == tuple(a.bounds.cu_seqlens.tolist())
    assert a.max_rope_position == 36
    assert a.max_compressed_entries(4) == 9 and a.max_compressed_entries(128) == 0
    assert a.max_compressed_entries(0) == 0
    assert sbhd_layout(37, 3) is a  # reused
    assert sbhd_layout(37, 2) is not a


def test_thd_bounds_match_device_tensor_and_bound_positions():
    lay = thd_layout(_psp([0, 5, 5, 42], padded=[0, 8, 8, 48]), 50)
    host = lay.bounds.cu_seqlens_host
    assert host == tuple(lay.bounds.cu_seqlens.tolist())
    assert lay.max_rope_position >= int(lay.positions.abs().max())
    lens = [b - a for a, b in itertools.pairwise(host)]
    assert lay.max_compressed_entries(4) == max(lens) // 4
    # the segments as one dsv4_primitives.varlen.SeqBoundaries; compressed counts floor(len / ratio) per segment
    assert not lay.bounds.is_static and lay.bounds.lengths_host == tuple(lens)
    want = [0]
    for n in lens:
        want.append(want[-1] + n // 4)
    assert list(lay.bounds.compressed(4).cu_seqlens_host) == want


def test_thd_layout_is_reused_until_the_boundaries_change():
    psp = _psp([0, 5, 17])
    a = thd_layout(psp, 17)
    assert thd_layout(psp, 17) is a
    assert thd_layout(psp, 20) is not a  # other token count
    # a static-shape buffer refilled in place must not return the stale layout
    psp.cu_seqlens_q[1] = 9
    psp.cu_seqlens_kv[1] = 9
    b = thd_layout(psp, 17)
    assert b is not a and b.bounds.cu_seqlens_host == (0, 9, 9, 17, 17)
    # another object with equal content is built anew (identity, not equality)
    assert thd_layout(_psp([0, 9, 17]), 17).bounds.cu_seqlens_host == b.bounds.cu_seqlens_host


def test_position_offset_widens_the_rope_bound():
    import dataclasses

    lay: TokenLayout = dataclasses.replace(sbhd_layout(16, 1), position_offset=-100)
    assert lay.max_rope_position >= int(lay.rope_positions.abs().max())


def test_every_rope_call_of_a_layer_gets_a_host_bound(build, monkeypatch):
    """The layer sizes every RoPE table from the layout (no device read-back of the positions)."""
    seen = []
    real = rope_mod.apply_rope

    def spy(x, positions, cfg, **kw):
        seen.append(kw.get("max_position"))
        assert kw.get("max_position") is not None
        assert int(positions.abs().max()) <= kw["max_position"]
        return real(x, positions, cfg, **kw)

    monkeypatch.setattr(rope_mod, "apply_rope", spy)
    for ratio in (0, 4, 128):
        m = build(ratio)
        with torch.no_grad():
            m(torch.randn(133, 1, 64))
    assert len(seen) >= 3 + 3 + 4  # q, kv, o (+ compressor) (+ indexer q and its compressor)


def test_thd_layout_is_rebuilt_when_a_boundary_tensor_is_replaced():
    """A new tensor assigned to the same PackedSeqParams is never mistaken for the old one (even if it reused the
    old one's memory and version counter)."""
    psp = _psp([0, 5, 17])
    a = thd_layout(psp, 17)
    psp.cu_seqlens_q = torch.tensor([0, 11, 17], dtype=torch.int32)
    psp.cu_seqlens_kv = psp.cu_seqlens_q.clone()
    b = thd_layout(psp, 17)
    assert b is not a and b.bounds.cu_seqlens_host[:2] == (0, 11)


def test_layouts_built_under_inference_mode_are_not_cached():
    """A layout first built under torch.inference_mode() (e.g. generation before training in one process) must not
    be reused by a training step: its tensors could not be saved for backward."""
    with torch.inference_mode():
        a = sbhd_layout(29, 3)
        b = thd_layout(_psp([0, 4, 9]), 9)
    assert a.positions.is_inference()
    c = sbhd_layout(29, 3)
    assert c is not a and not c.positions.is_inference()
    assert b.positions.is_inference()


def test_hand_built_layout_reads_a_device_tensor_back_once():
    bounds = SeqBoundaries.from_tensor(torch.tensor([0, 4, 9], dtype=torch.int32))
    lay = TokenLayout("thd", 9, 1, bounds, torch.zeros(9, dtype=torch.long), None, 5)
    assert list(lay.bounds.host) == [0, 4, 9]
    assert lay.max_compressed_entries(4) == 1
    assert list(lay.bounds.compressed(4).host) == [0, 1, 2]


def test_layer_trains_after_an_inference_mode_forward(build):
    """Inference-mode forward first, then a training forward+backward of the same shape (layout and RoPE caches)."""
    from dsv4_primitives import clear_rope_cache

    clear_rope_cache()
    m = build(4)
    x = torch.randn(41, 1, 64)
    with torch.inference_mode():
        m(x)
    y, _ = m(x.clone().requires_grad_())
    y.sum().backward()
