"""The micro-batch a TP rank feeds the model (``dsv4_train.sequence_parallel``, ``context_parallel.local_batch``
under ``--tp``): the whole pack, ``[B, S]`` as a THD pack of ``B`` documents, rows padded to a multiple of the TP
size outside every document; and the padding changes no loss and no gradient of the tiny model (one process)."""

from types import SimpleNamespace

import torch
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

from dsv4_attention import get_indexer_loss_tracker
from dsv4_primitives.cp_partial_loss import cp_partial_mean
from dsv4_train.context_parallel import local_batch
from dsv4_train.determinism import use_deterministic_cpu_kernels
from dsv4_train.sequence_parallel import pad_pack_rows
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset
from thd_packing import PackedSeqs, StaticShapeConfig, pad_to_static_shape

_NAMES = ("tokens", "labels", "loss_mask", "position_ids", "padding_mask")


def _pack(lengths, total, vocab, seed=0):
    """A packed micro-batch as the batch iterator makes it (documents of ``lengths``, the dummy tail to ``total``)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    ids, labels, mask = torch.zeros(t, dtype=torch.long), torch.zeros(t, dtype=torch.long), torch.zeros(t)
    start = 0
    for n in lengths:
        doc = torch.randint(1, vocab - 2, (n,), generator=g)
        ids[start : start + n] = doc
        labels[start : start + n - 1] = doc[1:]
        mask[start : start + n - 1] = 1.0
        start += n
    packed = PackedSeqs.from_lengths(lengths, total_tokens=t)
    sp = pad_to_static_shape(
        packed,
        {"tokens": ids, "labels": labels, "loss_mask": mask},
        StaticShapeConfig(total, len(lengths) + 1),
    )
    return SimpleNamespace(
        **sp.tensors,
        position_ids=sp.packed.position_ids,
        padding_mask=sp.padding_mask,
        packed_seqs=sp.packed,
        packed_seq_params=sp.packed.to_packed_seq_params,
        cp_rank=0,
        cp_size=1,
    )


def test_pad_pack_rows_appends_masked_rows_outside_every_document():
    mb = _pack([5, 20, 30], 63, 50)
    fields = {k: getattr(mb, k) for k in _NAMES}
    same, pack = pad_pack_rows(fields, mb.packed_seqs, 1)
    assert same is fields and pack is mb.packed_seqs
    padded, pack = pad_pack_rows(fields, mb.packed_seqs, 4)  # 63 -> 64 rows
    assert pack.total_tokens == 64 and all(v.shape == (64,) for v in padded.values())
    assert torch.equal(pack.cu_seqlens, mb.packed_seqs.cu_seqlens)  # no new document: the row is outside all
    assert torch.equal(pack.cu_seqlens_padded, mb.packed_seqs.cu_seqlens_padded)
    assert int(pack.seq_ids[-1]) == -1
    for k in _NAMES:
        assert torch.equal(padded[k][:63], fields[k]), k
    assert padded["loss_mask"][63] == 0 and padded["tokens"][63] == 0 and bool(padded["padding_mask"][63])


def test_local_batch_under_tp_feeds_the_whole_pack():
    """``[B, S]`` under TP: one THD pack ``[1, B·S]`` of ``B`` documents (``B·S`` odd: padded by one row);
    ``--packed``: the iterator's pack, padded the same way."""
    g = torch.Generator().manual_seed(0)
    b, s = 3, 7
    tokens = torch.randint(0, 50, (b, s), generator=g)
    pad = torch.zeros(b, s, dtype=torch.bool)
    pad[1, 5:] = True  # row 1 has a padding tail
    sbhd = SimpleNamespace(
        tokens=tokens,
        labels=torch.roll(tokens, -1, 1),
        loss_mask=(~pad).float(),
        padding_mask=pad,
        position_ids=torch.arange(s).expand(b, s),
        cp_size=1,
    )
    lb = local_batch(sbhd, packed=False, cp_rank=0, cp_size=1, device=torch.device("cpu"), tp_size=2)
    assert lb.tokens.shape == (1, 22)  # 21 rows + 1 padding row
    assert torch.equal(lb.tokens[0, :21], tokens.reshape(-1))
    assert torch.equal(lb.padding_mask[0, :21], pad.reshape(-1)) and bool(lb.padding_mask[0, 21])
    assert lb.loss_mask[0, 21] == 0
    assert lb.packed_seq_params.cu_seqlens_q.tolist() == [0, 7, 14, 21]
    assert lb.position_ids[0, :21].tolist() == list(range(7)) * 3
    plain = local_batch(sbhd, packed=False, cp_rank=0, cp_size=1, device=torch.device("cpu"))
    assert plain.tokens.shape == (b, s) and plain.packed_seq_params is None  # TP 1: [B, S] unchanged
    mb = _pack([5, 20, 30], 63, 50)
    lb = local_batch(mb, packed=True, cp_rank=0, cp_size=1, device=torch.device("cpu"), tp_size=2)
    assert lb.tokens.shape == (1, 64) and lb.packed_seq_params.total_tokens == 64


def _step(model, lb):
    """One forward + backward of ``model`` on ``lb``: the masked LM mean, the MTP loss, the indexer and balance
    losses recorded by the trackers, the routers' expert loads and every gradient."""
    get_indexer_loss_tracker().reset()
    get_moe_metrics_tracker().clear()
    model.zero_grad(set_to_none=True)
    for m in model.decoder.moe_layers():
        loads = getattr(m.router, "local_tokens_per_expert", None)
        if loads is not None:
            loads.zero_()
    out = model(
        lb.tokens, lb.position_ids, None, labels=lb.labels, loss_mask=lb.loss_mask,
        packed_seq_params=lb.packed_seq_params, padding_mask=lb.padding_mask,
    )  # fmt: skip
    loss = cp_partial_mean(out, lb.loss_mask.float(), None)
    (loss + model.last_mtp_loss).backward()
    balance = get_moe_metrics_tracker().metrics["seq_load_balancing_loss"].values.clone()
    loads = [
        m.router.local_tokens_per_expert.clone() for m in model.decoder.moe_layers() if not m.is_hash_layer
    ]
    grads = {n: p.grad for n, p in model.named_parameters()}
    return (
        loss.detach(),
        model.last_mtp_loss.detach(),
        get_indexer_loss_tracker().values.clone(),
        balance,
        loads,
        grads,
    )


def test_rows_padded_for_tp_change_no_loss_and_no_gradient(megatron_cpu):
    """The tiny model (every DSv4 attention kind, hash and learned MoE, mHC, MTP) on a pack of 63 rows and on the
    same pack padded to 64 (``--tp 2``'s padding, one process): the same LM / MTP / indexer / balance losses, expert
    loads and gradients. The padded run's GEMMs have one more row (another blocking): a few fp32 ulps of each
    tensor's scale (1e-5 of its largest value)."""
    restore = use_deterministic_cpu_kernels(torch.device("cpu"))
    cfg = get_preset("tiny")
    mb = _pack(
        [9, 24, 3, 21], 63, cfg.vocab_size, seed=1
    )  # the last document ends 6 rows before the dummy tail
    torch.manual_seed(0)
    model = build_model(cfg).train()
    try:
        cpu = torch.device("cpu")
        ref = _step(model, local_batch(mb, packed=True, cp_rank=0, cp_size=1, device=cpu))
        got = _step(model, local_batch(mb, packed=True, cp_rank=0, cp_size=1, device=cpu, tp_size=2))
    finally:
        restore()

    def close(a, b):
        return float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()) + 1e-7

    for name, a, b in zip(("lm", "mtp", "indexer", "balance"), got[:4], ref[:4], strict=True):
        assert a.shape == b.shape and close(a, b), (name, a, b)
    assert float(ref[2].abs().sum()) > 0 and float(ref[3].abs().sum()) > 0  # both losses are recorded
    for a, b in zip(got[4], ref[4], strict=True):
        assert torch.equal(a, b)  # padding rows route nowhere
    for name, g in ref[5].items():
        assert (g is None) == (got[5][name] is None), name
        assert g is None or close(got[5][name], g), name
