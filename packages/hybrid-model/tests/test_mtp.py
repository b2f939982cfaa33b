"""DSv4 MTP (spec §8, oracle T1): structure, input math, t+2 targets with packed-document masking, loss weight."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from hybrid_model.mtp import router_cu_seqlens
from hybrid_model.presets import get_preset


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _reference_roll(x: torch.Tensor, cu_padded: list[int]) -> torch.Tensor:
    """Loop reference: ``out[g] = x[g+1]`` inside one padded document, 0 elsewhere (tail rows too)."""
    out = torch.zeros_like(x)
    for s, e in itertools.pairwise(cu_padded):
        for g in range(s, e - 1):
            out[..., g] = x[..., g + 1]
    return out


def test_mtp_roll_left_never_crosses_padded_documents():
    from hybrid_model.mtp import mtp_roll_left

    cu_q = torch.tensor([0, 3, 5, 5, 8], dtype=torch.int32)  # lengths 3, 2, 0 (empty), 3
    cu_p = [0, 4, 6, 6, 9]  # doc 0 padded to 4; 2 tail rows after 9
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_q,
        cu_seqlens_q_padded=torch.tensor(cu_p, dtype=torch.int32),
        cu_seqlens_kv_padded=torch.tensor(cu_p, dtype=torch.int32),
    )  # fmt: skip
    x = torch.arange(1, 12)[None]  # [1, 11]
    got = mtp_roll_left(x, psp)
    assert torch.equal(got, _reference_roll(x, cu_p))
    # the last row of document 1 (row 5) must not receive document 3's first token (row 6)
    assert got[0, 5] == 0 and got[0, 4] == x[0, 5]
    no_pad = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_q)
    assert torch.equal(mtp_roll_left(x[:, :8], no_pad), _reference_roll(x[:, :8], cu_q.tolist()))
    sbhd = torch.arange(10.0).reshape(2, 5)
    assert torch.equal(mtp_roll_left(sbhd), torch.tensor([[1.0, 2, 3, 4, 0], [6, 7, 8, 9, 0]]))


def test_mtp_t1_structure(megatron_cpu):
    """T1: the MTP block is window-only (no compressor/indexer), plain RoPE base 10000 (no YaRN), learned routing,
    its own HyperHead and norm; its compress_ratios entry is the last one and is 0."""
    from hybrid_model.model import build_model

    cfg = get_preset("tiny")
    assert cfg.num_nextn_predict_layers == 1 and cfg.compress_ratios[-1] == 0
    assert len(cfg.compress_ratios) == cfg.num_layers + 1
    model = build_model(cfg)
    attn = model.mtp.block[0].inner_layer.self_attention
    assert attn.compress_ratio == 0
    names = [n for n, _ in model.mtp.named_parameters()] + [n for n, _ in model.mtp.named_buffers()]
    assert not [n for n in names if "compressor" in n or "indexer" in n]
    assert attn.rope_cfg.base == cfg.rope_theta == 10000.0 and attn.rope_cfg.yarn is None
    compressed = model.decoder.layers[2].inner_layer.self_attention  # a CSA layer of the main model
    assert (
        compressed.compress_ratio == 4 and compressed.rope_cfg.yarn is not None
    )  # YaRN is on where expected
    moe = model.mtp.block[1].inner_layer.mlp
    assert not moe.is_hash_layer
    assert not [n for n in names if "tid2eid" in n]
    assert model.mtp.hyper_head is not model.decoder.hyper_head
    own = {id(p) for p in model.mtp.parameters()}
    assert not own & {id(p) for p in model.decoder.parameters()}
    assert not own & {id(p) for p in model.output_layer.parameters()}  # the output head is shared, not copied
    assert model.mtp.e_proj.weight.shape == model.mtp.h_proj.weight.shape == (cfg.hidden_size,) * 2


def _recorder(seen: dict, key: str):
    """Forward pre-hook storing the first call's positional args under ``key`` (returns None: args unchanged)."""

    def hook(module, args):
        seen.setdefault(key, args)

    return hook


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _padded_pack() -> PackedSeqParams:
    """Three documents of 3, 1, 5 tokens padded to 4, 2, 5 rows (11 rows)."""
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=_i32([0, 3, 4, 9]),
        cu_seqlens_kv=_i32([0, 3, 4, 9]),
        cu_seqlens_q_padded=_i32([0, 4, 6, 11]),
        cu_seqlens_kv_padded=_i32([0, 4, 6, 11]),
    )


def test_router_cu_seqlens_cover_the_pack():
    """The routers' intervals are the padded documents plus the static-shape tail rows; they end at T."""
    psp = _padded_pack()
    assert router_cu_seqlens(psp, 11).tolist() == [0, 4, 6, 11]
    assert router_cu_seqlens(psp, 16).tolist() == [0, 4, 6, 11, 16]  # tail rows: one more interval
    assert router_cu_seqlens(None, 16) is None
    unpadded = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_i32([0, 3, 4]), cu_seqlens_kv=_i32([0, 3, 4]))
    assert router_cu_seqlens(unpadded, 4).tolist() == [0, 3, 4]
    with pytest.raises(ValueError, match="cover 11 rows"):
        router_cu_seqlens(psp, 10)


class _RowsGroup:
    """Rank ``rank`` of a ``size``-rank row group (TP x CP: rank ``c*TP + t``); only what the clipping reads."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_router_cu_seqlens_over_a_row_group_tile_the_pack():
    """Over a row group of 4 ranks (TP 2 x CP 2: rank ``c*2 + t`` holds rows ``[4r, 4r + 4)`` of 16), every rank keeps
    all ``D + 1`` entries, clipped to its rows; the per-rank document lengths add up to the one-rank ones."""
    psp = _padded_pack()
    whole = router_cu_seqlens(psp, 16)  # [0, 4, 6, 11, 16]
    parts = [router_cu_seqlens(psp, 4, _RowsGroup(r, 4)) for r in range(4)]
    assert [p.tolist() for p in parts] == [[0, 4, 4, 4, 4], [0, 0, 2, 4, 4], [0, 0, 0, 3, 4], [0, 0, 0, 0, 4]]
    assert torch.stack([p.diff() for p in parts]).sum(0).tolist() == whole.diff().tolist()


def _thd_batch(cfg, lengths, padded, tail, seed):
    """A packed ``[1, T]`` batch with per-document padding and tail rows; labels/mask per document."""
    from thd_packing import PackedSeqs

    g = torch.Generator().manual_seed(seed)
    t = sum(padded) + tail
    ids, labels = torch.zeros(1, t, dtype=torch.long), torch.zeros(1, t, dtype=torch.long)
    mask, pos = torch.zeros(1, t), torch.zeros(1, t, dtype=torch.long)
    start = 0
    for n, p in zip(lengths, padded, strict=True):
        doc = torch.randint(1, cfg.vocab_size, (n,), generator=g)
        ids[0, start : start + n] = doc
        labels[0, start : start + n - 1] = doc[1:]
        mask[0, start : start + n - 1] = 1.0
        pos[0, start : start + p] = torch.arange(p)
        start += p
    packs = PackedSeqs.from_lengths(lengths, padded, total_tokens=t)
    return ids, labels, mask, pos, packs.to_packed_seq_params()


def test_mtp_input_targets_and_masking_thd(megatron_cpu):
    """T1 input math (pre-HyperHead streams, per-stream h_proj, broadcast e_proj of token t+1) and the MTP loss:
    position t predicts token t+2 of its own document; the last two positions of every document are masked; the reported MTP loss is the unweighted mean, separate from the per-token main loss."""
    from hybrid_model.model import build_model

    torch.manual_seed(0)
    cfg = get_preset("tiny")
    model = build_model(cfg).train()
    with torch.no_grad():  # non-trivial norm weights, so swapped enorm/hnorm would show
        model.mtp.enorm.weight.uniform_(0.5, 1.5)
        model.mtp.hnorm.weight.uniform_(0.5, 1.5)
    # per-document padding and tail rows (the routers' balance loss runs over the padded intervals + the tail)
    lengths = [7, 1, 6, 2]
    ids, labels, mask, pos, psp = _thd_batch(cfg, lengths, [8, 2, 6, 4], tail=3, seed=1)
    cu_p = psp.cu_seqlens_q_padded.tolist()

    seen = {}
    hooks = [
        model.decoder.hyper_head.register_forward_pre_hook(_recorder(seen, "pre_head")),
        model.mtp.register_forward_pre_hook(_recorder(seen, "mtp_in")),
        model.mtp.block[0].register_forward_pre_hook(_recorder(seen, "block_in")),
    ]
    loss = model(ids, pos, None, labels=labels, loss_mask=mask, packed_seq_params=psp)
    for h in hooks:
        h.remove()
    streams, e = seen["mtp_in"]
    s, b, n, d = streams.shape
    # the MTP input is exactly the stream tensor the main HyperHead collapses
    assert torch.equal(streams.reshape(s, b, n * d), seen["pre_head"][0].reshape(s, b, n * d))
    assert not torch.allclose(
        streams[:, :, 0], streams[:, :, 1]
    )  # the streams differ: per-stream h_proj matters
    next_ids = _reference_roll(ids, cu_p)
    assert torch.equal(e, model.embedding(input_ids=next_ids, position_ids=pos))
    eps = cfg.rms_norm_eps
    mtp = model.mtp
    ref = _rms(streams, mtp.hnorm.weight, eps) @ mtp.h_proj.weight.double().T  # [s, b, n, d]
    ref = ref + (_rms(e, mtp.enorm.weight, eps) @ mtp.e_proj.weight.double().T)[:, :, None, :]
    torch.testing.assert_close(seen["block_in"][0].double().reshape(s, b, n, d), ref, rtol=1e-5, atol=1e-5)

    # reference MTP loss with targets/mask from the document table, not from any roll
    targets, tmask = torch.zeros_like(ids), torch.zeros(1, ids.shape[1])
    for start, length in zip(cu_p[:-1], lengths, strict=True):
        for t in range(start, start + length - 2):
            targets[0, t], tmask[0, t] = ids[0, t + 2], 1.0
    with torch.no_grad():
        mtp.block[1].inner_layer.mlp.set_input_ids(next_ids, router_cu_seqlens(psp, ids.shape[1]))
        h = mtp(streams, e, attention_mask=None, packed_seq_params=psp, padding_mask=None)
        logits, _ = model.output_layer(h)  # the shared head
        ce = F.cross_entropy(logits[:, 0].float(), targets[0], reduction="none")
        want = (ce * tmask[0]).sum() / tmask.sum()
    torch.testing.assert_close(model.last_mtp_loss, want, rtol=1e-5, atol=1e-6)
    # the returned loss is the main per-token loss only (MTP reaches the graph through MTPLossAutoScaler)
    main_logits, _ = model.output_layer(
        model.decoder.final_norm(model.decoder.hyper_head(seen["pre_head"][0]))
    )
    main_ce = F.cross_entropy(main_logits[:, 0].float(), labels[0], reduction="none")
    torch.testing.assert_close(loss[0].detach(), main_ce.detach(), rtol=1e-5, atol=1e-5)


def test_mtp_sbhd_targets_and_loss_weight(megatron_cpu):
    """SBHD: targets ids[t+2], the last two positions masked; the MTP gradient scales with ``mtp_loss_weight``."""
    from hybrid_model.model import build_model

    torch.manual_seed(0)
    cfg = get_preset("tiny")
    model = build_model(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    labels = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
    mask = torch.ones(2, 9)
    mask[:, -1] = 0
    seen = {}
    hook = model.mtp.register_forward_pre_hook(_recorder(seen, "streams"))
    grads = {}
    for weight in (0.3, 0.6, 0.0):
        model.set_step_state(mtp_loss_weight=weight)
        model.zero_grad(set_to_none=True)
        model(ids, None, None, labels=labels, loss_mask=mask).sum().backward()
        grads[weight] = model.mtp.e_proj.weight.grad.clone()
    hook.remove()
    # e_proj also gets the MTP MoE's balance-loss gradient (weight-independent): the CE part is linear in the weight
    ce_part = grads[0.3] - grads[0.0]
    assert ce_part.abs().max() > 10 * grads[0.0].abs().max()
    torch.testing.assert_close(
        grads[0.6] - grads[0.3], ce_part, rtol=1e-4, atol=1e-4 * ce_part.abs().max().item()
    )
    with torch.no_grad():
        logits = model.mtp_logits(seen["streams"][0], ids)  # [s, b, V]
        ce = F.cross_entropy(logits[:-2].float().reshape(-1, cfg.vocab_size), ids[:, 2:].T.reshape(-1))
    torch.testing.assert_close(model.last_mtp_loss, ce, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weight", [-0.1])
def test_negative_mtp_loss_weight_rejected(weight):
    from hybrid_model.config import DSv4ModelConfig

    cfg = get_preset("tiny")
    with pytest.raises(ValueError, match="mtp_loss_weight"):
        DSv4ModelConfig(**{**cfg.__dict__, "mtp_loss_weight": weight})


def _balance_losses() -> list[float]:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    entry = tracker.metrics.get("seq_load_balancing_loss")
    vals = [] if entry is None else entry.values[entry.values != 0].tolist()
    tracker.clear()
    return vals


def test_padding_rows_never_count_in_the_balance_loss(megatron_cpu):
    """A pack with per-document padding and static-shape tail rows, given its padding mask, has the MoE balance
    losses of the same documents packed without any padding (padding rows are not tokens of any sequence)."""
    from hybrid_model.model import build_model

    torch.manual_seed(0)
    cfg = get_preset("tiny")
    model = build_model(cfg).train()
    lengths = [7, 1, 6, 2]
    _balance_losses()
    ids, labels, mask, pos, psp = _thd_batch(cfg, lengths, lengths, tail=0, seed=3)
    model(ids, pos, None, labels=labels, loss_mask=mask, packed_seq_params=psp)
    plain = _balance_losses()
    ids_p, labels_p, mask_p, pos_p, psp_p = _thd_batch(cfg, lengths, [8, 2, 6, 4], tail=5, seed=3)
    pad = torch.ones_like(ids_p, dtype=torch.bool)
    for start, n in zip(psp_p.cu_seqlens_q_padded.tolist()[:-1], lengths, strict=True):
        pad[0, start : start + n] = False
    assert torch.equal(ids_p[~pad], ids[0])  # the same real tokens
    model(ids_p, pos_p, None, labels=labels_p, loss_mask=mask_p, packed_seq_params=psp_p, padding_mask=pad)
    padded = _balance_losses()
    assert len(plain) == len(padded) > 0
    torch.testing.assert_close(torch.tensor(padded), torch.tensor(plain), rtol=1e-5, atol=1e-7)
    # without the mask the padding rows (one more "sequence" of tail rows) change the loss
    model(ids_p, pos_p, None, labels=labels_p, loss_mask=mask_p, packed_seq_params=psp_p)
    assert not torch.allclose(torch.tensor(_balance_losses()), torch.tensor(plain), rtol=1e-3)
