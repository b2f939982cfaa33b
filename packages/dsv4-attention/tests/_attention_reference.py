"""An independent dense reference of one DSv4 attention layer (spec §2–§5), written from the spec, for tests.

It shares no code with the package or with csa-kernels: explicit per-document loops, a block-by-block compressor,
a dense ``[H, L, L + n]`` logit matrix with ``-inf`` masks, the sink in the denominator, a stable-sort top-k
(ties toward the lower entry index), and the indexer KL teacher from the full attention probabilities. Only
``apply_rope_ref`` / ``rms_norm_ref`` of dsv4-primitives are reused (tested there against R1–R3).
"""

from __future__ import annotations

import torch

from dsv4_primitives import apply_rope_ref


def _rms(x, w=None, eps=1e-6):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def params_of(module, dtype=torch.float64, requires_grad=True) -> dict[str, torch.Tensor]:
    """Detached copies of every parameter (leaves, so autograd gives reference gradients)."""
    return {
        n: p.detach().to(dtype).clone().requires_grad_(requires_grad) for n, p in module.named_parameters()
    }


def _compress(x, p, prefix, ratio, cfg_rope, eps):
    """Block-by-block compressor of one document: ``x [L, d]`` -> ``[L // ratio, c]`` (spec §3.2 / §3.3)."""
    kv = x @ p[prefix + "linear_wkv.weight"].T
    sc = x @ p[prefix + "linear_wgate.weight"].T
    ape = p[prefix + "ape"]
    n = x.shape[0] // ratio
    overlap = ratio == 4
    c = kv.shape[1] // 2 if overlap else kv.shape[1]
    out = []
    for w in range(n):
        own = slice(w * ratio, (w + 1) * ratio)  # the block's tokens, slot j = token w*ratio + j
        if overlap:
            if w == 0:  # previous half empty: kv 0, logit -inf
                prev_kv = x.new_zeros(ratio, c)
                prev_lg = x.new_full((ratio, c), float("-inf"))
            else:
                prev = slice((w - 1) * ratio, w * ratio)
                prev_kv, prev_lg = kv[prev, :c], sc[prev, :c] + ape[:, :c]
            slots_kv = torch.cat((prev_kv, kv[own, c:]), 0)  # [2m, c]
            slots_lg = torch.cat((prev_lg, sc[own, c:] + ape[:, c:]), 0)
        else:
            slots_kv, slots_lg = kv[own], sc[own] + ape  # [m, c]
        out.append((torch.softmax(slots_lg, 0) * slots_kv).sum(0))
    if not out:
        return x.new_zeros(0, c)
    ent = _rms(torch.stack(out), p[prefix + "norm.weight"], eps)
    pos = torch.arange(n, dtype=torch.int64) * ratio
    return apply_rope_ref(ent, pos, cfg_rope)


def reference_document(module, p, x, *, dense=None, pos_offset=0):
    """One document ``x [L, d]`` through the layer. Returns ``(y [L, d], extras)`` with the indexer KL terms."""
    cfg = module.config
    ratio = module.compress_ratio
    rope = module.rope_cfg
    eps = cfg.layernorm_epsilon
    nh, c = cfg.num_attention_heads, cfg.v_head_dim
    L = x.shape[0]
    pos = torch.arange(L, dtype=torch.int64) + pos_offset
    cq = _rms(x @ p["linear_q_down_proj.weight"].T, p["q_layernorm.weight"], eps)
    q = _rms((cq @ p["linear_q_up_proj.weight"].T).view(L, nh, c), None, eps)
    q = apply_rope_ref(q, pos, rope)
    kv = apply_rope_ref(_rms(x @ p["linear_kv_proj.weight"].T, p["kv_layernorm.weight"], eps), pos, rope)
    t = torch.arange(L)
    keys = [kv]
    allowed = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - cfg.csa_window_size)  # [L, L]
    extras = {}
    n = 0
    if ratio:
        ent = _compress(x, p, "core_attention.compressor.", ratio, rope, eps)
        if pos_offset:
            ent = apply_rope_ref(ent, torch.full((ent.shape[0],), pos_offset, dtype=torch.int64), rope)
        n = ent.shape[0]
        keys.append(ent)
        vis = torch.arange(n)[None, :] < ((t + 1) // ratio)[:, None]  # [L, n]
        sel = vis
        if ratio == 4:
            pre = "core_attention.indexer."
            hi, di = cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim
            qi = apply_rope_ref((cq @ p[pre + "linear_wq_b.weight"].T).view(L, hi, di), pos, rope)
            ki = _compress(x, p, pre + "compressor.", 4, rope, eps)
            if pos_offset:
                ki = apply_rope_ref(ki, torch.full((ki.shape[0],), pos_offset, dtype=torch.int64), rope)
            wi = (x @ p[pre + "linear_weights_proj.weight"].T) * di**-0.5 * hi**-0.5
            scores = (wi[:, :, None] * torch.relu(torch.einsum("thd,sd->ths", qi, ki))).sum(1)  # [L, n]
            scores = scores.masked_fill(~vis, float("-inf"))
            extras["scores"] = scores
            use_dense = module.dense_attention if dense is None else dense
            if not use_dense and n:
                k = min(cfg.dsa_indexer_topk, n)
                order = torch.sort(scores.detach(), dim=1, descending=True, stable=True).indices[:, :k]
                sel = torch.zeros_like(vis).scatter(1, order, True) & vis
            extras["selected"] = sel
            extras["visible"] = vis
        allowed = torch.cat((allowed, sel), 1)
    K = torch.cat(keys, 0)  # [L + n, c]
    logits = torch.einsum("thc,jc->htj", q, K) * c**-0.5
    z = logits.masked_fill(~allowed[None], float("-inf"))
    sink = p["core_attention.attn_sink"][:, None, None].expand(nh, L, 1)
    full = torch.cat((z, sink), -1)
    prob = torch.softmax(full, -1)[..., :-1]  # [H, L, L + n] sink takes the rest
    o = torch.einsum("htj,jc->thc", prob, K)
    o = apply_rope_ref(o, pos, rope, inverse=True)
    g, r = cfg.output_projection_groups, cfg.output_projection_lora_rank
    wa = p["linear_o_group_proj.weight"].view(g, r, nh * c // g)
    u = torch.einsum("tgi,gri->tgr", o.reshape(L, g, nh * c // g), wa).reshape(L, g * r)
    y = u @ p["linear_proj.weight"].T
    # teacher mass of every compressed entry under the attention's actual (full) denominator, attended or not
    extras["comp_mass"] = torch.exp(logits[:, :, L:] - torch.logsumexp(full, -1, keepdim=True))  # [H, L, n]
    return y, extras


def reference_indexer_kl(extras, loss_set) -> tuple[torch.Tensor, int]:
    """Sum over rows of KL(teacher || softmax(scores)) on ``loss_set [L, n]`` and the number of rows with entries."""
    teacher = extras["comp_mass"].detach().sum(0).masked_fill(~loss_set, 0.0)  # [L, n]
    rows = loss_set.any(1)
    total = extras["scores"].new_zeros(())
    for t in torch.nonzero(rows).flatten().tolist():
        m = loss_set[t]
        pt = teacher[t, m] / teacher[t, m].sum()
        lq = torch.log_softmax(extras["scores"][t, m], 0)
        total = total + (pt * (pt.log() - lq)).sum()
    return total, int(rows.sum())


def reference_forward(module, p, x_docs, **kw):
    """``x_docs``: list of ``[L_i, d]`` documents -> list of ``(y_i, extras_i)``."""
    return [reference_document(module, p, x, **kw) for x in x_docs]
