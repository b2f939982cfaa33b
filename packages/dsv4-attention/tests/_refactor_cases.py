"""Before/after cases of the core/adapter split (dsv4-attention 0.3): one function computes, per case, the state
dict and the outputs and every gradient of a tiny layer built through the megatron spec path; the values recorded at
commit ``784234d`` (before the split) live in ``data/refactor_fixture.pt`` and ``test_refactor_fixture.py``
compares the current code to them with the tolerance rule (fp64 of the same case as the
accurate value).

Regenerate (only at a commit whose numerics are the reference): ``python packages/dsv4-attention/tests/data/
make_refactor_fixture.py``.
"""

from __future__ import annotations

import torch
from _attention_testconfig import tiny_config
from megatron.core.packed_seq_params import PackedSeqParams

# name -> (ratio, config overrides, lengths (THD) or None (SBHD [37 or 131, 2, 64]))
CASES = {
    "window-sbhd": (0, {}, None),
    "csa-sbhd-sparse": (4, {}, None),
    "csa-sbhd-dense": (4, {"csa_dense_mode": True}, None),
    "csa-sbhd-sparse-loss": (4, {"dsa_indexer_use_sparse_loss": True}, None),
    "hca-sbhd": (128, {}, None),
    "csa-thd": (4, {}, [5, 0, 37, 16]),
    "hca-thd": (128, {}, [131, 3, 0, 129]),
}


#: cases whose default-initialised state dict is recorded too (one per layer kind)
INIT_CASES = ("window-sbhd", "csa-sbhd-sparse", "hca-sbhd")


def _psp(lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    n = max(lengths)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n
    )


def run_case(name: str, pg, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """State dict (default init, then re-drawn), output, input and parameter gradients of case ``name``.

    ``dtype=torch.float64`` evaluates the same layer (built, initialised and re-drawn in fp32 exactly as the
    fp32 case, then cast) and the same inputs in fp64: the accurate value the fp32 numbers are checked against.
    """
    from megatron.core.transformer.spec_utils import build_module

    from dsv4_attention import IndexerLossAutoScaler, get_indexer_loss_tracker
    from dsv4_attention.megatron import get_dsv4_attention_spec

    ratio, overrides, lengths = CASES[name]
    torch.manual_seed(0)
    cfg = tiny_config(**overrides)
    m = build_module(get_dsv4_attention_spec(ratio), config=cfg, layer_number=1, pg_collection=pg)
    out = {}
    if name in INIT_CASES:
        out = {f"init.{k}": v.detach().clone() for k, v in m.state_dict().items() if v is not None}
    out["keys"] = sorted(m.state_dict())
    with torch.no_grad():  # as the tests' `build` fixture: no term trivially 0
        for pname, p in m.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    m.to(dtype).train()
    gen = torch.Generator().manual_seed(1)
    if lengths is None:
        s = 131 if ratio == 128 else 37
        x = torch.randn(s, 2, 64, generator=gen).to(dtype).requires_grad_(True)
        psp = None
    else:
        x = torch.randn(sum(lengths), 1, 64, generator=gen).to(dtype).requires_grad_(True)
        psp = _psp(lengths)
    w = torch.randn(x.shape, generator=gen).to(dtype)
    get_indexer_loss_tracker().reset()
    IndexerLossAutoScaler.set_loss_scale(0.5)
    try:
        y, _ = m(x, packed_seq_params=psp)
        (y * w).sum().backward()
    finally:
        IndexerLossAutoScaler.reset()
    out["y"] = y.detach().clone()
    out["grad.x"] = x.grad.clone()
    for pname, p in m.named_parameters():
        out[f"grad.{pname}"] = p.grad.clone() if p.grad is not None else torch.zeros(0)
    vals = get_indexer_loss_tracker().values
    out["tracker"] = vals.clone() if vals is not None else torch.zeros(0)
    get_indexer_loss_tracker().reset()
    return out
