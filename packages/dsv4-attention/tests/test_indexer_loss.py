"""Indexer loss: detached inputs (I3), value and gradients vs the reference teacher, the auto-scaler (identity
forward, scaled loss gradient for gradient accumulation), the per-layer tracker with MTP slots, and its reduction
across pipeline / data-parallel groups (gloo, 2 ranks)."""

from __future__ import annotations

import pytest
import torch
from _attention_reference import params_of, reference_forward, reference_indexer_kl

from dsv4_attention import IndexerLossAutoScaler, IndexerLossTracker, get_indexer_loss_tracker
from dsv4_testkit import assert_close_to_ref, run_distributed


@pytest.fixture(autouse=True)
def _clean_state():
    IndexerLossAutoScaler.reset()
    get_indexer_loss_tracker().reset()
    yield
    IndexerLossAutoScaler.reset()
    get_indexer_loss_tracker().reset()


def _indexer_only_grads(m, x, scale=1.0, **fwd):
    """Backward of the indexer loss alone (the LM output gets a zero gradient)."""
    IndexerLossAutoScaler.set_loss_scale(scale)
    m.zero_grad(set_to_none=True)
    y, _ = m(x, **fwd)
    (y * 0).sum().backward()
    return {n: p.grad for n, p in m.named_parameters()}


def test_indexer_trained_only_by_its_loss(build):
    """I3: the indexer-loss gradient of every non-indexer parameter is exactly 0, of every indexer parameter not."""
    m = build(4)
    grads = _indexer_only_grads(m, torch.randn(40, 2, 64))
    for n, g in grads.items():
        if ".indexer." in n:
            assert g is not None and torch.count_nonzero(g) > 0, n
        else:
            assert g is None or torch.count_nonzero(g) == 0, n


def test_autoscaler_identity_forward_and_scaled_backward(build):
    m = build(4)
    x = torch.randn(40, 1, 64)
    with torch.no_grad():
        y_eval, _ = m.eval()(x)
    m.train()
    y_train, _ = m(x)
    torch.testing.assert_close(y_train.detach(), y_eval, rtol=0, atol=0)  # attaching the loss is the identity
    g1 = _indexer_only_grads(m, x, 1.0)
    g4 = _indexer_only_grads(m, x, 0.25)  # e.g. 1 / num_microbatches
    for n in g1:
        if ".indexer." in n:
            torch.testing.assert_close(g4[n], 0.25 * g1[n], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    ("dense_mode", "sparse_loss"),
    [(True, False), (False, False), (False, True)],
    ids=["dense-phase", "sparse-phase-dense-loss", "sparse-phase-sparse-loss"],
)
def test_loss_value_and_indexer_grads_match_reference(build, dense_mode, sparse_loss):
    coeff = 0.5
    m = build(
        4, csa_dense_mode=dense_mode, dsa_indexer_use_sparse_loss=sparse_loss, dsa_indexer_loss_coeff=coeff
    )
    x = torch.randn(40, 2, 64)
    grads = _indexer_only_grads(m, x)
    tracked = float(get_indexer_loss_tracker().values[0])

    def ref(dtype):
        p = params_of(m, dtype)
        total, rows = 0.0, 0
        for _y, ex in reference_forward(m, p, [x[:, b].to(dtype) for b in range(2)]):
            loss_set = ex["selected"] if (sparse_loss and not dense_mode) else ex["visible"]
            s, r = reference_indexer_kl(ex, loss_set)
            total, rows = total + s, rows + r
        kl = coeff * total / rows
        names = [n for n in p if ".indexer." in n]
        return kl, dict(zip(names, torch.autograd.grad(kl, [p[n] for n in names])))

    kl64, g64 = ref(torch.float64)
    _kl32, g32 = ref(torch.float32)
    assert tracked == pytest.approx(float(kl64), rel=1e-4)
    for n in g64:
        assert_close_to_ref(f"d{n}", grads[n], g64[n], g32[n])


def test_zero_coefficient_still_attaches(build):
    """coeff 0: indexer parameters still get (zero) gradients (no DDP bucket gaps, upstream #5643) and nothing is
    logged."""
    m = build(4, dsa_indexer_loss_coeff=0.0)
    grads = _indexer_only_grads(m, torch.randn(40, 1, 64))
    for n, g in grads.items():
        if ".indexer." in n:
            assert g is not None and torch.count_nonzero(g) == 0, n
    assert get_indexer_loss_tracker().values is None


def test_tracker_slots_mtp_and_logging(build):
    """Main layer n -> slot n-1, MTP layer n -> slot num_layers+n-1 (growing the tracker); the logged value is the
    mean over the ratio-4 layers."""
    tracker = get_indexer_loss_tracker()
    main = build(4, layer_number=3, num_layers=4)
    mtp = build(
        4, layer_number=1, num_layers=4, is_mtp_layer=True
    )  # tracker_num_layers = 4 (no mtp_num_layers)
    assert (main.tracker_slot, mtp.tracker_slot) == (2, 4)
    x = torch.randn(40, 1, 64)
    main(x)
    main(x)  # two micro-batches accumulate
    mtp(x)
    vals = tracker.values.clone()
    assert vals.numel() == 5 and torch.count_nonzero(vals[[0, 1, 3]]) == 0
    assert vals[2] > 0 and vals[4] > 0

    class _Writer:
        def __init__(self):
            self.logged = {}

        def add_scalar(self, name, value, it):
            self.logged[name] = (float(value), it)

    from megatron.core.process_groups_config import ProcessGroupCollection

    w = _Writer()
    total = {}
    out = tracker.track_metrics(
        0.5,
        7,
        writer=w,
        total_loss_dict=total,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        num_layers=5,
        num_indexer_layers=2,
        per_layer_logging=True,
    )
    expect = float(vals.sum()) * 0.5 / 2
    assert out["indexer loss"] == pytest.approx(expect)
    assert w.logged["indexer loss"] == (pytest.approx(expect), 7)
    assert out["indexer loss layer 3"] == pytest.approx(float(vals[2]) * 0.5)
    assert float(total["indexer loss"]) == pytest.approx(expect)
    assert torch.count_nonzero(tracker.values) == 0  # cleaned after logging


def test_tracker_rejects_missing_groups():
    with pytest.raises(ValueError, match="ProcessGroupCollection"):
        IndexerLossTracker().reduce(None, 4)


def _reduce_worker(rank, world):
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    single = [dist.new_group([r]) for r in range(world)][rank]
    out = {}
    # pipeline: stage 0 holds layers 1-2 (layer 2 is CSA); stage 1 holds layer 3 (CSA) and the MTP layer (slot 4)
    tracker, pg = IndexerLossTracker(), ProcessGroupCollection()
    pg.pp, pg.dp = dist.group.WORLD, single
    if rank == 0:
        tracker.save(torch.tensor(1.0), 1, 4)
    else:
        tracker.save(torch.tensor(2.0), 2, 4)
        tracker.save(torch.tensor(4.0), 4, 4)  # the MTP slot grows this rank's tracker to 5
    out["pp"] = tracker.reduce(pg, 4).tolist()
    # data parallel: the same layer on both ranks
    tracker, pg = IndexerLossTracker(), ProcessGroupCollection()
    pg.pp, pg.dp = single, dist.group.WORLD
    tracker.save(torch.tensor(float(rank + 1)), 1, 4)
    out["dp"] = tracker.reduce(pg, 4).tolist()
    return out


@pytest.mark.distributed
def test_tracker_reduction_across_pp_and_dp():
    r0, r1 = run_distributed(_reduce_worker, 2)
    assert r0["pp"] == r1["pp"] == [0.0, 1.0, 2.0, 0.0, 4.0]  # summed over stages, sizes negotiated
    assert r0["dp"] == r1["dp"] == [0.0, 1.5, 0.0, 0.0]  # averaged over data-parallel ranks
