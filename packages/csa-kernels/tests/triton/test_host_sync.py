"""Trusted callers: with host boundaries (a ``SeqBoundaries`` carrying its host copy) and ``check_indices=False``
every public op (forward and backward) runs without a device -> host sync. CPU: a host-read detector (``_nosync``) on both
backends (Triton in the interpreter); GPU: ``torch.cuda.set_sync_debug_mode("error")``."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _nosync import HostReadError, no_host_reads

import csa_kernels as ck
from dsv4_primitives import RopeConfig
from dsv4_primitives.varlen import SeqBoundaries, compressed_cu_seqlens, compressed_cu_seqlens_host
from dsv4_testkit import interpreting

interpreter_only = pytest.mark.skipif(not interpreting(), reason="CPU interpreter case (gpu cases cover it)")

LENGTHS = [9, 0, 14, 1]  # an empty and a length-1 document
RATIO, W, TOPK = 4, 3, 3


class Case:
    """Inputs of every op on one device; ``bounds`` carries the device boundaries and their host copy."""

    def __init__(self, device, dtype=torch.float32):
        gen = torch.Generator(device=device).manual_seed(
            0
        )  # inputs made on the device: no upload in the calls
        self.cu_l = [0]
        for n in LENGTHS:
            self.cu_l.append(self.cu_l[-1] + n)
        self.cuc_l = compressed_cu_seqlens_host(self.cu_l, RATIO)
        self.T, self.Tc = self.cu_l[-1], self.cuc_l[-1]
        self.cu = torch.tensor(self.cu_l, dtype=torch.int32).to(device)
        self.bounds = SeqBoundaries(self.cu, tuple(self.cu_l))
        self.device, self.dtype = device, dtype

        def rnd(*shape, scale=1.0):
            x = torch.randn(*shape, generator=gen, device=device) * scale
            return x.to(dtype).requires_grad_()

        self.rnd = rnd
        self.rnd32 = lambda *shape, scale=1.0: rnd(*shape, scale=scale).detach().float().requires_grad_()


def _backward(*outs):
    loss = sum(torch.where(torch.isfinite(o), o, 0.0).float().sum() for o in outs if o.requires_grad)
    if isinstance(loss, torch.Tensor):
        loss.backward()


def op_calls(c: Case, backend: str):
    """``name -> thunk`` running one public op (with the trusted options) forward and backward."""
    H, D, HI, DI, c_dim = 2, 16, 2, 16, 8
    kw = dict(backend=backend)
    rope = RopeConfig(rope_dim=4, base=10000.0)

    def pool():
        kv, score = c.rnd(c.T, 2 * c_dim), c.rnd(c.T, 2 * c_dim)
        ape = c.rnd(RATIO, 2 * c_dim).detach().float().requires_grad_()
        p, _ = ck.compressor_pool(kv, score, ape, RATIO, True, c.bounds, **kw)
        _backward(p)

    def compress():
        x, wkv, wg = c.rnd(c.T, 12), c.rnd(2 * c_dim, 12), c.rnd(2 * c_dim, 12)
        ape, nw = c.rnd(RATIO, 2 * c_dim), c.rnd(c_dim)
        e, _ = ck.compress(x, wkv, wg, ape, nw, RATIO, True, rope, c.bounds, **kw)
        _backward(e)

    def compress_sbhd():
        x, wkv, wg = c.rnd(8, 2, 12), c.rnd(c_dim, 12), c.rnd(c_dim, 12)
        e = ck.compress_sbhd(x, wkv, wg, c.rnd(RATIO, c_dim), c.rnd(c_dim), RATIO, False, rope, **kw)
        _backward(e, ck.compressor_pool_sbhd(c.rnd(8, 2, c_dim), c.rnd(8, 2, c_dim), c.rnd(RATIO, c_dim),
                                             RATIO, False, **kw))  # fmt: skip

    def indexer():
        q, k, w = c.rnd(c.T, HI, DI), c.rnd(c.Tc, DI), c.rnd(c.T, HI)
        idx, s = ck.indexer_topk(q, k, w, RATIO, TOPK, c.bounds, **kw)
        dense = ck.indexer_scores(q, k, w, RATIO, c.bounds, **kw)
        at = ck.indexer_scores_at(q, k, w, idx, check_indices=False, **kw)
        _backward(s, dense, at)

    def indexer_sbhd():
        q, k, w = c.rnd(8, 2, HI, DI), c.rnd(2, 2, DI), c.rnd(8, 2, HI)
        _, s = ck.indexer_topk_sbhd(q, k, w, RATIO, TOPK, **kw)
        _backward(s, ck.indexer_scores_sbhd(q, k, w, RATIO, **kw))

    def attention_and_loss():
        win = ck.window_indices(c.bounds, W)
        vis = ck.visible_compressed_indices(c.bounds, RATIO)
        idx = ck.attention_indices(win, vis, c.T)
        q, kv, sink = c.rnd(c.T, H, D), c.rnd(c.T + c.Tc, D), c.rnd32(H, scale=0.1)
        o, lse = ck.sparse_attn(q, kv, sink, idx, D**-0.5, check_indices=False, **kw)
        comp = idx[:, W:].contiguous()
        x = c.rnd32(*comp.shape)  # fp32 student logits, fp32 sink (as in the model)
        loss, _ = ck.indexer_loss(q, kv, sink, lse, comp, x, D**-0.5, check_indices=False, **kw)
        _backward(o, loss)

    def sbhd_attention_and_loss():
        S, B = 8, 2
        loc = ck.attention_indices(ck.window_indices_sbhd(S, W, c.device),
                                   ck.visible_compressed_indices_sbhd(S, RATIO, c.device), S)  # fmt: skip
        idx = loc[:, None, :].expand(S, B, -1).contiguous()
        q, kv, sink = c.rnd(S, B, H, D), c.rnd(S + S // RATIO, B, D), c.rnd32(H, scale=0.1)
        o, lse = ck.sparse_attn_sbhd(q, kv, sink, idx, D**-0.5, check_indices=False, **kw)
        comp = idx[..., W:].contiguous()
        loss, _ = ck.indexer_loss_sbhd(q, kv, sink, lse, comp, c.rnd32(*comp.shape), D**-0.5,
                                       check_indices=False, **kw)  # fmt: skip
        _backward(o, loss)
        ck.local_to_global_rows(idx, kv.shape[0])

    def layout():
        compressed_cu_seqlens(c.cu, RATIO, cu_seqlens_host=c.cu_l)
        ck.compressed_positions(c.bounds, RATIO)

    return dict(
        compressor_pool=pool,
        compress=compress,
        compress_sbhd=compress_sbhd,
        indexer=indexer,
        indexer_sbhd=indexer_sbhd,
        attention_and_loss=attention_and_loss,
        sbhd_attention_and_loss=sbhd_attention_and_loss,
        layout=layout,
    )


OPS = list(op_calls(Case("cpu"), "reference"))


@interpreter_only
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("op", OPS)
def test_trusted_calls_read_nothing_back(op, backend):
    fn = op_calls(Case("cpu"), backend)[op]
    with no_host_reads():
        fn()


@contextlib.contextmanager
def _deterministic_algorithms():
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev)


@interpreter_only
@pytest.mark.parametrize("mode", ["torch_flag", "atomic"])
@pytest.mark.parametrize("op", ["indexer", "attention_and_loss", "compressor_pool"])
def test_trusted_calls_read_nothing_back_other_modes(op, mode):
    """The other backward modes stay sync-free too: under torch's deterministic flag, and the fp32-atomic kernels
    (``set_deterministic_default(False)``; the calls above run the deterministic default)."""
    fn = op_calls(Case("cpu"), "triton")[op]
    scope = _deterministic_algorithms() if mode == "torch_flag" else ck.deterministic_default_scope(False)
    with scope, no_host_reads():
        fn()


def test_detector_catches_the_default_validation():
    """The same calls without a host copy (boundaries read back from the device) do read back (so the test above
    can fail)."""
    c = Case("cpu")
    q, k, w = c.rnd(c.T, 2, 16), c.rnd(c.Tc, 16), c.rnd(c.T, 2)
    with pytest.raises(HostReadError), no_host_reads():
        ck.indexer_topk(q, k, w, RATIO, TOPK, SeqBoundaries.from_tensor(c.cu))
    idx = torch.zeros(c.T, 2, dtype=torch.int32)
    with pytest.raises(HostReadError), no_host_reads():
        ck.indexer_scores_at(q, k, w, idx)
    with pytest.raises(HostReadError), no_host_reads():
        ck.window_indices(SeqBoundaries.from_tensor(c.cu), W)
    for read in (lambda: int(idx[0, 0]), lambda: idx.tolist(), lambda: idx[idx > 0], lambda: bool(idx.any())):
        with pytest.raises(HostReadError), no_host_reads():
            read()


@pytest.mark.parametrize(
    "host,match",
    [
        ([0, 9, 9, 23], "has 4 values but"),  # wrong length
        ([1, 9, 9, 23, 24], r"\[0\] must be 0"),
        ([0, 9, 8, 23, 24], "non-decreasing"),
        ([0, 9, 9, 23, 25], "number of packed rows"),
        ([0, 9.0, 9, 23, 24], "Python ints"),
        (torch.tensor([0, 9, 9, 23, 24]), "non-empty list"),
    ],
)
def test_bad_host_lists_raise(host, match):
    c = Case("cpu")
    q, k, w = c.rnd(c.T, 2, 16), c.rnd(c.Tc, 16), c.rnd(c.T, 2)
    with pytest.raises(ValueError, match=match):
        ck.indexer_topk(q, k, w, RATIO, TOPK, SeqBoundaries(c.cu, host))


def test_index_flags_checked():
    c = Case("cpu")
    q, k, w = c.rnd(c.T, 2, 16), c.rnd(c.Tc, 16), c.rnd(c.T, 2)
    idx = torch.zeros(c.T, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="check_indices must be a bool"):
        ck.indexer_scores_at(q, k, w, idx, check_indices=None)
    idx[0, 0] = c.Tc  # out of range: caught by default, not looked at when the caller vouches for it
    with pytest.raises(ValueError, match="must lie in"):
        ck.indexer_scores_at(q, k, w, idx)
    ck.indexer_scores_at(q, k, w, idx.clamp(max=c.Tc - 1), check_indices=False)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_trusted_calls_do_not_sync_on_gpu(op, monkeypatch):
    """Default backend on CUDA (Triton), bf16: zero synchronising calls, forward and backward (after a warm-up
    call, so one-time compilation and launch-config caches are excluded)."""
    monkeypatch.delenv("CSA_KERNELS_BACKEND", raising=False)
    op_calls(Case("cuda", torch.bfloat16), "auto")[op]()
    torch.cuda.synchronize()
    fn = op_calls(Case("cuda", torch.bfloat16), "auto")[op]
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["indexer", "attention_and_loss", "compressor_pool"])
def test_trusted_calls_do_not_sync_on_gpu_deterministic(op, monkeypatch):
    """The same under torch.use_deterministic_algorithms(True): the atomic-free backwards do not sync either."""
    monkeypatch.delenv("CSA_KERNELS_BACKEND", raising=False)
    with _deterministic_algorithms():
        op_calls(Case("cuda", torch.bfloat16), "auto")[op]()
        torch.cuda.synchronize()
        fn = op_calls(Case("cuda", torch.bfloat16), "auto")[op]
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
