"""Hash routing (oracle E2), tid2eid builders / loader, and the MoE-layer count of hash layers (P4 pitfall)."""

import pytest
import torch

from hash_moe import (
    RouterConfig,
    build_tid2eid_balanced,
    build_tid2eid_round_robin,
    dense_routing,
    hash_moe_layer_flags,
    hash_moe_layer_numbers,
    hash_route,
    load_tid2eid,
    token_ids_checked,
    validate_tid2eid,
)


def _expected_load(table, counts):
    e = int(table.max()) + 1
    w = counts.double().unsqueeze(1).expand_as(table).reshape(-1)
    return torch.zeros(e, dtype=torch.float64).index_add_(0, table.long().reshape(-1), w)


@pytest.mark.parametrize("fn", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_e2_hash_ids_fixed_by_token_id(fn):
    torch.manual_seed(0)
    cfg = RouterConfig(num_experts=8, topk=3, score_function=fn, routed_scaling_factor=1.5)
    table = build_tid2eid_round_robin(50, 8, 3)
    ids = torch.randint(0, 50, (20,))
    a = hash_route(torch.randn(20, 8), ids, table, cfg)
    b = hash_route(torch.randn(20, 8) * 5, ids, table, cfg)  # other gate weights / other context
    assert torch.equal(a.experts, table[ids].long()) and torch.equal(a.experts, b.experts)
    perm = torch.randperm(20)
    c = hash_route(torch.randn(20, 8), ids[perm], table, cfg)
    assert torch.equal(c.experts, a.experts[perm])
    torch.testing.assert_close(a.weights.sum(-1), torch.full((20,), 1.5))  # E1 holds for hash layers too
    s = a.scores.gather(1, a.experts)
    torch.testing.assert_close(a.weights, 1.5 * s / s.sum(-1, keepdim=True))


def test_token_ids_checked_skips_only_the_range_check():
    """Inside ``token_ids_checked()`` the routing is the same and the id range is not read back (a bad id then
    fails in the table lookup, not in the range check); after the block the check is back."""
    cfg = RouterConfig(num_experts=4, topk=2)
    table = build_tid2eid_round_robin(10, 4, 2)
    logits, ids = torch.randn(3, 4), torch.tensor([1, 9, 3])
    with token_ids_checked():
        inside = hash_route(logits, ids, table, cfg)
        with pytest.raises(IndexError):
            hash_route(torch.randn(2, 4), torch.tensor([3, 10]), table, cfg)
    outside = hash_route(logits, ids, table, cfg)
    assert torch.equal(inside.experts, outside.experts) and torch.equal(inside.weights, outside.weights)
    with pytest.raises(ValueError, match="vocab"):
        hash_route(torch.randn(2, 4), torch.tensor([3, 10]), table, cfg)


def test_hash_padding_and_bad_ids():
    cfg = RouterConfig(num_experts=4, topk=2)
    table = build_tid2eid_round_robin(10, 4, 2)
    valid = torch.tensor([True, False, True])
    r = hash_route(torch.randn(3, 4), torch.tensor([1, 2, 3]), table, cfg, valid=valid)
    probs, rmap = dense_routing(r, 4)
    assert not rmap[1].any() and (probs[1] == 0).all()
    with pytest.raises(ValueError, match="vocab"):
        hash_route(torch.randn(2, 4), torch.tensor([3, 10]), table, cfg)
    with pytest.raises(ValueError, match=r"\[-1, 3\]"):
        hash_route(torch.randn(2, 4), torch.tensor([3, -1]), table, cfg)
    with pytest.raises(ValueError, match="token_ids"):
        hash_route(torch.randn(2, 4), torch.tensor([[1, 2]]), table, cfg)
    with pytest.raises(ValueError, match="topk"):
        hash_route(torch.randn(2, 4), torch.tensor([1, 2]), build_tid2eid_round_robin(10, 4, 3), cfg)


@pytest.mark.parametrize("v,e,k", [(1, 1, 1), (17, 4, 4), (100, 8, 6), (7, 256, 6)])
def test_round_robin_valid(v, e, k):
    table = build_tid2eid_round_robin(v, e, k)
    assert table.dtype == torch.int32 and table.shape == (v, k)
    validate_tid2eid(table, num_experts=e, topk=k, vocab_size=v)


def test_balanced_is_deterministic_valid_and_balanced():
    g = torch.Generator().manual_seed(0)
    counts = (torch.rand(500, generator=g) ** 8 * 1e6).floor()  # heavy-tailed corpus frequencies
    counts[:40] = 0  # unseen ids
    table = build_tid2eid_balanced(counts, 16, 4, seed=1)
    validate_tid2eid(table, num_experts=16, topk=4, vocab_size=500)
    assert torch.equal(table, build_tid2eid_balanced(counts, 16, 4, seed=1))
    assert not torch.equal(table, build_tid2eid_balanced(counts, 16, 4, seed=2))
    bal = _expected_load(table, counts)
    rr = _expected_load(build_tid2eid_round_robin(500, 16, 4), counts)
    assert bal.max() / bal.mean() < 1.05 < rr.max() / rr.mean()
    # zero-frequency ids spread evenly over the experts (by assignment count)
    zero_ids = table[counts == 0].long().reshape(-1)
    per_expert = torch.bincount(zero_ids, minlength=16)
    assert per_expert.max() - per_expert.min() <= 1


def test_balanced_accepts_frequencies_and_rejects_bad_counts():
    validate_tid2eid(build_tid2eid_balanced(torch.rand(30), 5, 5), num_experts=5, topk=5)
    with pytest.raises(ValueError, match="non-negative"):
        build_tid2eid_balanced(torch.tensor([1.0, -1.0]), 4, 2)
    with pytest.raises(ValueError, match="1-D"):
        build_tid2eid_balanced(torch.ones(2, 2), 4, 2)
    with pytest.raises(ValueError, match="topk"):
        build_tid2eid_balanced(torch.ones(3), 2, 3)


def test_validate_rejects_bad_tables():
    with pytest.raises(ValueError, match="repeats"):
        validate_tid2eid(torch.tensor([[0, 1], [2, 2]]), num_experts=4, topk=2)
    with pytest.raises(ValueError, match="range"):
        validate_tid2eid(torch.tensor([[0, 4]]), num_experts=4, topk=2)
    with pytest.raises(ValueError, match="integer"):
        validate_tid2eid(torch.zeros(3, 2), num_experts=4, topk=2)
    with pytest.raises(ValueError, match="vocab_size"):
        validate_tid2eid(torch.tensor([[0, 1]]), num_experts=4, topk=2, vocab_size=3)


def test_load_from_state_dict_tensor_and_file(tmp_path):
    table = build_tid2eid_round_robin(12, 6, 3).long()  # checkpoints store int64
    sd = {"layers.0.ffn.gate.tid2eid": table, "layers.0.ffn.gate.weight": torch.zeros(6, 4)}
    got = load_tid2eid(sd, num_experts=6, topk=3, vocab_size=12)
    assert got.dtype == torch.int32 and torch.equal(got.long(), table)
    path = tmp_path / "ckpt.pt"
    torch.save(sd, path)
    assert torch.equal(load_tid2eid(path, num_experts=6, topk=3), got)
    assert torch.equal(load_tid2eid(table, num_experts=6, topk=3), got)
    two = {**sd, "layers.1.ffn.gate.tid2eid": table}
    with pytest.raises(ValueError, match="key="):
        load_tid2eid(two, num_experts=6, topk=3)
    assert torch.equal(load_tid2eid(two, num_experts=6, topk=3, key="layers.1.ffn.gate.tid2eid"), got)
    with pytest.raises(ValueError, match="not in the checkpoint"):
        load_tid2eid(two, num_experts=6, topk=3, key="nope")
    with pytest.raises(ValueError, match="range"):
        load_tid2eid(table, num_experts=4, topk=3)


def test_hash_layers_count_moe_layers_not_pattern_symbols():
    # upstream pitfall: "WEWECE" with 3 hash layers must hash all three E's, not just the first
    assert hash_moe_layer_numbers("WEWECE", 3) == [2, 4, 6]
    assert hash_moe_layer_flags("WEWE|CEHE/WE", 2) == [False, True, False, True, False, False, False, False]
    with pytest.raises(ValueError, match="first pipeline stage"):  # the hash layers need input_ids: stage 1
        hash_moe_layer_flags("WE|WECEHE/WE", 2)
    assert hash_moe_layer_flags("WEWE", 0) == [False] * 4
    with pytest.raises(ValueError, match="MoE layers"):
        hash_moe_layer_flags("WEWE/WE", 3)  # MTP layers never count


def test_token_id_check_under_graph_capture_is_a_device_assert():
    """While a CUDA graph is captured the range check cannot read the host: it becomes ``torch._assert_async``
    (checked at every replay). On CPU the same assert fails at once, which is what this exercises."""
    from hash_moe.routing import _check_token_id_range

    _check_token_id_range(torch.tensor([0, 9]), 10, asynchronous=True)
    _check_token_id_range(torch.tensor([], dtype=torch.long), 10, asynchronous=True)
    for bad in ([3, 10], [-1, 2]):
        with pytest.raises(RuntimeError, match="vocab=10"):
            _check_token_id_range(torch.tensor(bad), 10, asynchronous=True)
