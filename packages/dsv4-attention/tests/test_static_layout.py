"""Static-shape THD layouts (the CUDA-graph path): boundaries computed on the device, capacity shapes, every op in
csa-kernels' static-bounds mode. A layer on a static layout equals the same layer on the host-bounds layout of the
same pack: outputs, indexer loss and every gradient (Triton backend, interpreted on CPU; reference backend)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_core import _randomise, core_config

from dsv4_attention import DSv4Attention, LayerKind
from dsv4_attention.layout import mark_static_bounds, static_thd_layout, thd_layout, token_layout


def _pack(lengths, padded_lengths, total, capacity):
    """PackedSeqParams-like THD params: documents ``lengths`` at offsets of ``padded_lengths`` (per-document padding),
    the tail up to ``total`` rows; the static copy repeats the end up to ``capacity`` documents."""

    def cu(ls, n):
        c = torch.zeros(n + 1, dtype=torch.int32)
        c[1 : len(ls) + 1] = torch.tensor(ls, dtype=torch.int32).cumsum(0)
        c[len(ls) + 1 :] = c[len(ls)]
        return c

    host = SimpleNamespace(
        qkv_format="thd",
        cu_seqlens_q=cu(lengths, len(lengths)),
        cu_seqlens_kv=cu(lengths, len(lengths)),
        cu_seqlens_q_padded=cu(padded_lengths, len(lengths)),
    )
    static = SimpleNamespace(
        qkv_format="thd",
        cu_seqlens_q=cu(lengths, capacity),
        cu_seqlens_kv=cu(lengths, capacity),
        cu_seqlens_q_padded=cu(padded_lengths, capacity),
    )
    return host, mark_static_bounds(static)


# documents shorter than the window (8) and than a ratio-128 group, per-document padding, an empty-capacity tail
PACK = ([21, 5, 129, 3], [24, 5, 129, 3], 168, 6)
PACK_CSA = ([21, 5, 30, 3], [24, 5, 30, 3], 72, 6)  # ratio 4: a short pack keeps the interpreter quick
PACK_FULL = ([130, 2, 30], [130, 2, 30], 170, 3)  # exactly at the document capacity, a 8-row tail


@pytest.mark.parametrize("pack", [PACK, PACK_FULL], ids=["tail_capacity", "full_capacity"])
def test_static_layout_segments(pack):
    host_p, static_p = _pack(*pack)
    total = pack[2]
    host = thd_layout(host_p, total)
    static = token_layout(torch.zeros(total, 1, 8), static_p)
    assert static.is_static and static.bounds.total == total
    assert torch.equal(static.positions, host.positions)
    assert torch.equal(static.real_rows, host.real_rows)
    # the same non-empty segments (the static form adds empty ones)
    cu = static.bounds.cu_seqlens.tolist()
    assert sorted(set(cu)) == sorted(set(host.bounds.host))
    with pytest.raises(ValueError, match="device only"):
        _ = static.bounds.host


@pytest.mark.parametrize(
    "kind,dense,backend",
    [
        (LayerKind.HCA, False, "triton"),
        (LayerKind.CSA, False, "triton"),
        (LayerKind.CSA, True, "triton"),
        (LayerKind.CSA, False, "reference"),
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_layer_static_equals_host_layout(kind, dense, backend):
    lengths, padded, total, cap = PACK if kind == LayerKind.HCA else PACK_CSA
    host_p, static_p = _pack(lengths, padded, total, cap)
    host = thd_layout(host_p, total)
    static = static_thd_layout(static_p, total)
    m = DSv4Attention(core_config(kind, backend=backend)).train()
    _randomise(m)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(total, 64, generator=gen)
    w = torch.randn(total, 64, generator=gen)

    def run(layout):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        y, loss = m(xi, layout, dense=dense)
        ((y * w).sum() + (loss if loss is not None else 0)).backward()
        return y, loss, xi.grad, {n: p.grad for n, p in m.named_parameters()}

    y_h, l_h, dx_h, g_h = run(host)
    y_s, l_s, dx_s, g_s = run(static)
    # same kernels on the same rows: bitwise (HCA; window layers run the same index maps, tested in csa-kernels).
    # CSA: the dense indexer scores (dense phase, and the KL student of use_sparse_loss=False) come from the
    # scores-at op in the static form, the dense-scores op in the host form: the same fp32 math summed in another
    # order, so a few fp32 ulps of each tensor's scale (1e-5 of its largest value, ~80 ulps) bound the difference
    exact = kind != LayerKind.CSA

    def check(a, b):
        if exact:
            return torch.equal(a, b)
        a, b = a.detach(), b.detach()
        return float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()) + 1e-7

    assert check(y_s, y_h)
    assert (l_h is None) == (l_s is None) and (l_h is None or check(l_s, l_h))
    assert check(dx_s, dx_h)
    for name, g in g_h.items():
        assert (g is None) == (g_s[name] is None), name
        assert g is None or check(g_s[name], g), name
