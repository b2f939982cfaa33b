"""Small-M routed experts (Triton; interpreter on CPU) vs the loop reference: odd shapes, empty experts (whose
weights are NaN: never read), all rows on one expert, filler rows, fp32 / bf16; inference-only refusal; on GPU bf16
at flash-smoke size vs the grouped GEMM path, sync-free and CUDA-graph replayable."""

import pytest
import torch

from dsv4_testkit import assert_close_to_ref
from hash_moe import grouped_mm, grouped_swiglu_experts, routed_mm, routed_swiglu_experts

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# [G] row counts: M = 1, empty experts, all rows on one expert (> 64 rows: several row blocks), all experts used
# one expert; 33 experts (the kernels' power-of-two width over G is 64) with rows in one expert past the 16th
COUNTS = [
    [0, 1, 0],
    [3, 0, 5, 1, 0],
    [0, 0, 70, 0],
    [2, 1, 1, 3, 1],
    [0, 0, 0],
    [4],
    [0] * 20 + [2] + [0] * 12,
]


def _poison_empty_experts(w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """NaN weights for the experts without rows: a kernel that reads them yields NaN."""
    w = w.clone()
    for e, c in enumerate(counts):
        if c == 0:
            w[e] = float("nan")
    return w


def _mm_ref(x, w, counts):
    return grouped_mm(x, w.nan_to_num(0.0), counts, backend="loop")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", COUNTS, ids=lambda c: "-".join(map(str, c)))
def test_routed_mm_matches_loop_reference(counts, dtype):
    torch.manual_seed(len(counts) + sum(counts))
    m, k, n, filler = sum(counts), 37, 45, 2
    x = torch.randn(m + filler, k, device=DEV).to(dtype)  # filler rows past sum(counts): zero output
    w = _poison_empty_experts(torch.randn(len(counts), n, k, device=DEV).to(dtype), counts)
    out = routed_mm(x, w, torch.tensor(counts, device=DEV))
    assert out.dtype == dtype and out.shape == (m + filler, n)
    ref = _mm_ref(x[:m].double(), w.double(), counts)
    same = _mm_ref(x[:m], w, counts) if dtype != torch.float32 else None
    assert_close_to_ref("out", out[:m], ref, same)
    assert torch.equal(out[m:], torch.zeros_like(out[m:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [None, 0.75])
@pytest.mark.parametrize("counts", COUNTS, ids=lambda c: "-".join(map(str, c)))
def test_routed_swiglu_experts_match_grouped_reference(counts, limit, dtype):
    torch.manual_seed(7 * len(counts) + sum(counts))
    g, m, hidden, ffn, filler = len(counts), sum(counts), 29, 19, 3
    x = torch.randn(m + filler, hidden, device=DEV).to(dtype)
    gate_up = _poison_empty_experts((torch.randn(g, 2 * ffn, hidden, device=DEV) * 0.4).to(dtype), counts)
    down = _poison_empty_experts((torch.randn(g, hidden, ffn, device=DEV) * 0.4).to(dtype), counts)
    probs = (torch.rand(m + filler, device=DEV) + 0.25).to(dtype)
    out = routed_swiglu_experts(x, torch.tensor(counts, device=DEV), gate_up, down, limit=limit, probs=probs)
    assert out.dtype == dtype and out.shape == (m + filler, hidden)

    def ref(dt):
        return grouped_swiglu_experts(
            x[:m].to(dt),
            counts,
            gate_up.nan_to_num(0.0).to(dt),
            down.nan_to_num(0.0).to(dt),
            limit=limit,
            probs=probs[:m].to(dt),
            backend="loop",
            activation_backend="reference",
        )

    assert_close_to_ref("out", out[:m], ref(torch.float64), ref(dtype) if dtype != torch.float32 else None)
    assert torch.equal(out[m:], torch.zeros_like(out[m:]))


def test_host_counts_without_probs_equal_device_counts():
    torch.manual_seed(3)
    counts = [4, 0, 2]
    x = torch.randn(6, 16, device=DEV)
    gate_up, down = torch.randn(3, 10, 16, device=DEV), torch.randn(3, 16, 5, device=DEV)
    host = routed_swiglu_experts(x, counts, gate_up, down, limit=None)
    dev = routed_swiglu_experts(x, torch.tensor(counts, device=DEV), gate_up, down, limit=None)
    assert torch.equal(host, dev)  # two runs in this test: bitwise
    ref = grouped_swiglu_experts(
        x, counts, gate_up, down, limit=None, backend="loop", activation_backend="reference"
    )
    assert_close_to_ref("out", host, ref)


def test_refuses_grad_and_bad_arguments():
    x, w = torch.randn(3, 8, device=DEV), torch.randn(2, 4, 8, device=DEV)
    counts = torch.tensor([1, 2], device=DEV)
    with pytest.raises(ValueError, match="inference only"):
        routed_mm(x.requires_grad_(), w, counts)
    with torch.no_grad():
        routed_mm(x, w, counts)  # no grad mode: fine
    x = x.detach()
    with pytest.raises(ValueError, match="entries for 2 experts"):
        routed_mm(x, w, torch.tensor([3], device=DEV))
    with pytest.raises(ValueError, match="integer"):
        routed_mm(x, w, torch.tensor([1.0, 2.0], device=DEV))
    with pytest.raises(ValueError, match="at most M=3"):
        routed_mm(x, w, [2, 2])  # host counts are checked (device counts are trusted)
    with pytest.raises(ValueError, match="non-negative"):
        routed_mm(x, w, [-1, 2])
    with pytest.raises(ValueError, match="equal K"):
        routed_mm(x, torch.randn(2, 4, 7, device=DEV), counts)
    with pytest.raises(ValueError, match="one dtype"):
        routed_mm(x.double(), w.double(), counts)
    with pytest.raises(ValueError, match="down"):
        routed_swiglu_experts(x, counts, torch.randn(2, 6, 8), torch.randn(2, 8, 4), limit=None)
    with pytest.raises(ValueError, match="probs"):
        routed_swiglu_experts(
            x, counts, torch.randn(2, 6, 8), torch.randn(2, 8, 3), limit=None, probs=torch.ones(2)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 32])
def test_flash_smoke_shapes_bf16_match_grouped_mm_sync_free(tokens):
    """bf16 at flash-smoke MoE size (H 4096, F 2048, 16 experts, top-6) vs the grouped GEMM path (same roundings,
    other sums: within 2x its error against fp32); no host sync."""
    torch.manual_seed(tokens)
    g, topk, hidden, ffn, dev = 16, 6, 4096, 2048, "cuda"
    experts = torch.stack([torch.randperm(g, device=dev)[:topk] for _ in range(tokens)])  # [T, topk]
    counts = torch.bincount(experts.flatten(), minlength=g)  # [G]
    m = tokens * topk
    x = torch.randn(m, hidden, device=dev).bfloat16()
    gate_up = (torch.randn(g, 2 * ffn, hidden, device=dev) / 64).bfloat16()
    down = (torch.randn(g, hidden, ffn, device=dev) / 45).bfloat16()
    probs = torch.rand(m, device=dev).bfloat16()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            out = routed_swiglu_experts(x, counts, gate_up, down, limit=10.0, probs=probs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with torch.no_grad():
        grouped = grouped_swiglu_experts(x, counts, gate_up, down, limit=10.0, probs=probs)
        ref = grouped_swiglu_experts(
            x.float(),
            counts.tolist(),
            gate_up.float(),
            down.float(),
            limit=10.0,
            probs=probs.float(),
            backend="loop",
        )
    assert_close_to_ref("out", out, ref, grouped)


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_counts():
    """Captured once, replayed with other routings (an expert emptied, another filled): equals the eager call."""
    torch.manual_seed(0)
    g, hidden, ffn, m, dev = 8, 256, 96, 12, "cuda"
    x = torch.randn(m, hidden, device=dev).bfloat16()
    gate_up = (torch.randn(g, 2 * ffn, hidden, device=dev) / 16).bfloat16()
    down = (torch.randn(g, hidden, ffn, device=dev) / 10).bfloat16()
    probs = torch.rand(m, device=dev).bfloat16()
    counts = torch.tensor([3, 0, 0, 5, 4, 0, 0, 0], device=dev)
    with torch.no_grad():
        routed_swiglu_experts(
            x, counts, gate_up, down, limit=10.0, probs=probs
        )  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = routed_swiglu_experts(x, counts, gate_up, down, limit=10.0, probs=probs)
        for new in ([0, 12, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 3], [2, 0, 0, 0, 0, 0, 0, 7]):
            counts.copy_(torch.tensor(new, device=dev))
            graph.replay()
            want = routed_swiglu_experts(x, counts, gate_up, down, limit=10.0, probs=probs)
            assert torch.equal(out, want), new


def test_strided_device_counts_are_read_as_their_values():
    """A non-contiguous ``[G]`` counts view (every other entry of a longer tensor) gives the result of its values."""
    torch.manual_seed(3)
    counts = [2, 0, 3, 1]
    x, w = torch.randn(6, 21, device=DEV), torch.randn(4, 13, 21, device=DEV)
    strided = torch.tensor([c for c in counts for _ in range(2)], device=DEV)[::2]  # [G], stride 2
    assert not strided.is_contiguous()
    torch.testing.assert_close(
        routed_mm(x, w, strided), routed_mm(x, w, torch.tensor(counts, device=DEV)), rtol=0, atol=0
    )
