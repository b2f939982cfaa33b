"""Regression gate of the device-resident decode step (issue 37): the host syncs / uploads of one eager decode step
of the ``tiny`` preset (W C H C H C + hash / learned MoE), counted on CPU by
:func:`~hybrid_model.generation.step_count.decode_step_counts`.

Gate: no sync and no upload in any attention layer (window, CSA, HCA); the whole step's syncs are megatron's
all-gather token dispatcher's only (``MoEAllGatherTokenDispatcher.dispatch_postprocess``: ``tokens_per_expert
.cpu()`` and a ``masked_select`` of the local probs, 2 per MoE layer) and its one upload the new token ids. Two
steps are counted: one that completes no compressed block (position 9) and one that completes a CSA block
(position 11: (11 + 1) mod 4 = 0).
"""

from __future__ import annotations

import pytest
import torch

from hybrid_model.generation import CachedDecoder, StaticDecodeStep, generate
from hybrid_model.generation.op_count import count_ops, total
from hybrid_model.generation.step_count import decode_step_counts, layer_scopes, layers_per_scope
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset

ATTENTION = ("window", "csa", "hca")
DISPATCHER_SYNCS_PER_MOE_LAYER = 2


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("prompt_length", [8, 10], ids=["no-block", "csa-block"])
def test_decode_step_has_no_attention_sync(megatron_cpu, batch, prompt_length):
    torch.manual_seed(0)
    model = build_model(get_preset("tiny")).eval()
    counts = decode_step_counts(model, batch, prompt_length)
    layers = layers_per_scope(model)
    for kind in ATTENTION:
        assert kind in counts, f"no {kind} layer ran"
        c = counts[kind]
        assert (c.syncs, c.uploads) == (0, 0), (
            f"{kind}: {c.syncs} syncs, {c.uploads} uploads: {dict(c.sites)}"
        )
    syncs = sum(c.syncs for c in counts.values())
    uploads = sum(c.uploads for c in counts.values())
    sites = {name: dict(c.sites) for name, c in counts.items() if c.sites}
    assert syncs <= DISPATCHER_SYNCS_PER_MOE_LAYER * layers["moe"], sites
    assert all("token_dispatcher.py" in site for site in counts["moe"].sites), sites
    assert uploads <= 1, sites  # the token ids


def _sync_sites(counts) -> dict[str, int]:
    """Host syncs per call site, without megatron's all-gather token dispatcher (2 per MoE layer and forward)."""
    sites = total(counts).sites
    return {s: n for s, n in sites.items() if s.startswith("sync ") and "token_dispatcher.py" not in s}


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_generate_copies_the_tokens_to_the_host_once(megatron_cpu, decode):
    """Without EOS / streaming, ``generate`` keeps the chosen tokens on the device: one host copy for the whole call
    (none per generated token), no upload per decode step, and the hash layers never read the ids back."""
    torch.manual_seed(0)
    model = build_model(get_preset("tiny")).eval()
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8]]
    runs = {}
    for new in (2, 6):
        with count_ops() as counts:
            runs[new] = generate(model, prompts, new, decode=decode)
        runs[new, "syncs"] = _sync_sites(counts)
        runs[new, "uploads"] = total(counts).uploads
    assert [seq[:2] for seq in runs[6]] == runs[2] and [len(seq) for seq in runs[6]] == [6, 6]
    # no sync per generated token (the prefill's are the same in both runs)
    assert sum(runs[6, "syncs"].values()) == sum(runs[2, "syncs"].values()), runs[6, "syncs"]
    in_generate = {site: n for site, n in runs[6, "syncs"].items() if site.startswith("sync generate.py")}
    assert sum(in_generate.values()) == 1, runs[6, "syncs"]  # the final copy of all tokens
    assert runs[6, "uploads"] == runs[2, "uploads"], "an upload per decode step"


def test_generate_with_eos_reads_each_step(megatron_cpu):
    """With ``eos_token_id`` (a host decision per step) the tokens come to the host once per generated token."""
    torch.manual_seed(0)
    model = build_model(get_preset("tiny")).eval()
    with count_ops() as counts:
        out = generate(model, [[3, 1, 4, 1, 5]], 5, eos_token_id=511)
    assert out == generate(model, [[3, 1, 4, 1, 5]], 5)
    in_generate = {site: n for site, n in _sync_sites(counts).items() if site.startswith("sync generate.py")}
    assert sum(in_generate.values()) == len(out[0]) == 5, _sync_sites(counts)


def test_decoder_step_equals_extend(megatron_cpu):
    """``CachedDecoder.step`` (device ids) is ``extend`` of one token per sequence, bitwise; a bad id fails."""
    torch.manual_seed(0)
    model = build_model(get_preset("tiny")).eval()
    logits = []
    for use_step in (False, True):
        dec = CachedDecoder(model, 2, 16)
        dec.extend([[3, 1, 4], [1, 5, 9, 2, 6]], last_only=True)
        for tok in ([7, 8], [9, 10], [11, 12]):
            if use_step:
                logits.append(dec.step(torch.tensor(tok)))
            else:
                logits.append(torch.cat(dec.extend([[t] for t in tok], last_only=True)))
        assert dec.lengths == (6, 8)
    for a, b in zip(logits[:3], logits[3:]):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="token ids must lie in"):
        dec.step(torch.tensor([1, model.model_config.vocab_size]))
    with pytest.raises(ValueError, match="one integer token id per sequence"):
        dec.step(torch.tensor([1]))


def test_static_step_checks_ids_once_not_per_hash_layer(megatron_cpu):
    """The eager static step reads no id back to the host (its hash layers run under ``token_ids_checked``); one
    device-side range check per call (none with ``ids_checked=True``)."""
    torch.manual_seed(0)
    model = build_model(get_preset("tiny")).eval()
    dec = CachedDecoder(model, 2, 16)
    dec.extend([[3, 1, 4], [1, 5, 9, 2, 6]], last_only=True)
    step = StaticDecodeStep(dec)
    step(torch.tensor([7, 8]))  # warm-up
    with count_ops(layer_scopes(model)) as counts:
        step(torch.tensor([9, 10]))
    assert not _sync_sites(counts), _sync_sites(counts)
    with count_ops() as checked:
        step(torch.tensor([9, 10]), ids_checked=True)
    assert total(checked).ops < total(counts).ops
    with pytest.raises(RuntimeError, match="token ids must lie in"):
        step(torch.tensor([-1, 2]))
