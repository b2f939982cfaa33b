"""``generate``: sample continuations of token-id prompts from a :class:`~hybrid_model.model.DSv4Model`.

One :class:`~hybrid_model.generation.decoder.CachedDecoder` for the batch: the prompts are prefilled together (a THD
pack, one document per prompt: no padding, so prompts of any lengths batch exactly), then every step feeds each
unfinished sequence its last token and picks the next one from the new logits
(:mod:`~hybrid_model.generation.sampling`). The chosen tokens stay on the device (a step of every sequence:
:meth:`CachedDecoder.step <hybrid_model.generation.decoder.CachedDecoder.step>`, no upload; sampled ids need no range
check) and reach the host once at the end, or every step where a host decision needs them (``eos_token_id``,
``on_token``). A CLI is a thin wrapper: tokenize, call :func:`generate`, detokenize (``on_token`` streams the tokens
as they come).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from hybrid_model.generation.decoder import CachedDecoder
from hybrid_model.generation.sampling import SamplingConfig, next_tokens
from hybrid_model.generation.speculative import SPECULATIVE_MODES, SpeculationStats, speculative_generate
from hybrid_model.generation.static_speculative import static_speculative_generate
from hybrid_model.generation.static_step import StaticDecodeStep
from hybrid_model.generation.support import check_generation_support

#: ``generate(decode=...)``: how the decode steps run
DECODE_MODES = ("eager", "static", "graph")


def _check_prompts(prompt_ids, vocab_size: int, max_positions: int, max_new_tokens) -> list[list[int]]:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if isinstance(prompt_ids, str | bytes) or not isinstance(prompt_ids, Sequence) or not prompt_ids:
        raise ValueError("prompt_ids must be a non-empty list of prompts, each a list of token ids")
    prompts = []
    for i, prompt in enumerate(prompt_ids):
        if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence):
            raise ValueError(f"prompt_ids[{i}] must be a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError(
                f"prompt_ids[{i}] is empty: every prompt needs at least one token (e.g. a BOS token)"
            )
        for j, tok in enumerate(prompt):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
                raise ValueError(
                    f"prompt_ids[{i}][{j}] = {tok!r} is not a token id of this model (ints in [0, {vocab_size}))"
                )
        if len(prompt) > max_positions:
            raise ValueError(
                f"prompt_ids[{i}] has {len(prompt)} tokens, longer than the model's max_position_embeddings="
                f"{max_positions}: shorten the prompt"
            )
        if len(prompt) + max_new_tokens > max_positions:
            raise ValueError(
                f"prompt_ids[{i}] ({len(prompt)} tokens) + max_new_tokens={max_new_tokens} exceeds the model's "
                f"max_position_embeddings={max_positions}: lower max_new_tokens to at most "
                f"{max_positions - len(prompt)} or shorten the prompt"
            )
        prompts.append([int(t) for t in prompt])
    return prompts


def generate(
    model,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    *,
    eos_token_id: int | None = None,
    on_token: Callable[[int, int], None] | None = None,
    decode: str = "eager",
    speculative: str | None = None,
    stats: SpeculationStats | None = None,
) -> list[list[int]]:
    """Continue every prompt by up to ``max_new_tokens`` tokens with cached decoding.

    Args:
        model: a :class:`~hybrid_model.model.DSv4Model` (``build_model`` / ``load_hf_checkpoint``); supported
            patterns: :func:`~hybrid_model.generation.check_generation_support`. Run in eval mode, no gradients;
            its training mode is restored afterwards.
        prompt_ids: one non-empty list of token ids per sequence (any lengths; batched without padding).
        max_new_tokens: tokens to generate per sequence (>= 1); ``len(prompt) + max_new_tokens`` must not exceed the
            model's ``max_position_embeddings``.
        temperature: 0 = greedy (argmax), else the softmax temperature (finite, > 0).
        top_p: nucleus mass in ``(0, 1]`` for sampling (1 = the whole vocabulary).
        seed: seed of the sampling generator (``None``: torch's global generator); the same seed, prompts and model
            give the same tokens.
        eos_token_id: a sequence stops after generating this token (it is included in the output).
        on_token: streaming callback ``on_token(sequence_index, token_id)``, called for every generated token in
            order (per step: sequence 0 first). With ``on_token`` or ``eos_token_id`` the chosen tokens come to the
            host every step; without both they stay on the device and are copied once, at the end.
        decode: how the decode steps run (the prefill is always one eager call): ``"eager"`` (host plans; a
            finished sequence is no longer fed), ``"static"`` (:class:`~hybrid_model.generation.StaticDecodeStep`:
            every sequence fed each step, device-side lengths, no host reads), ``"graph"`` (``"static"`` captured
            in a CUDA graph; CUDA only). All three give the same tokens (fp32: the same logits within 1e-5).
        speculative: ``None`` (plain decoding) or ``"mtp"``: the model's MTP depth 1 drafts one token per step and
            the main model verifies it (:mod:`~hybrid_model.generation.speculative`; greedy: plain greedy's tokens,
            sampling: the speculative-sampling rule, the main model's distribution); the model needs an MTP depth.
            With ``decode="static"`` / ``"graph"`` the verify steps run on static shapes with acceptance and the
            rejected rows' rollback on the device (:class:`~hybrid_model.generation.StaticSpeculativeStep`, one host
            read per step; ``"graph"``: CUDA graphs): greedy, the eager loop's tokens and counters; sampling, the
            same distribution and, while no sequence has stopped, the eager loop's draws and tokens (a stopped
            sequence keeps drawing here, not in the eager loop, so later draws of a batch differ).
        stats: a :class:`~hybrid_model.generation.SpeculationStats` that a speculative generation fills
            (drafts, accepted drafts, verify steps; ``acceptance_rate``).
    Returns:
        the generated tokens of each sequence (prompts not included).
    Raises:
        ValueError: an unsupported model, an empty or too long prompt, a token id outside the vocabulary, a bad
            ``max_new_tokens`` / ``temperature`` / ``top_p`` / ``seed`` / ``eos_token_id``.
    """
    check_generation_support(model)
    cfg = model.model_config
    prompts = _check_prompts(prompt_ids, cfg.vocab_size, cfg.max_position_embeddings, max_new_tokens)
    sampling = SamplingConfig(temperature, top_p, seed)
    if eos_token_id is not None and (
        isinstance(eos_token_id, bool)
        or not isinstance(eos_token_id, int)
        or not 0 <= eos_token_id < cfg.vocab_size
    ):
        raise ValueError(
            f"eos_token_id must be None or a token id in [0, {cfg.vocab_size}), got {eos_token_id!r}"
        )
    if decode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(map(repr, DECODE_MODES))}, got {decode!r}")
    if speculative not in SPECULATIVE_MODES:
        raise ValueError(f"speculative must be None or 'mtp', got {speculative!r}")
    if stats is not None and speculative is None:
        raise ValueError("stats counts speculative drafts: pass it with speculative='mtp'")
    if speculative is not None:
        run = (
            speculative_generate
            if decode == "eager"
            else partial(static_speculative_generate, cuda_graph=decode == "graph")
        )
        return run(
            model,
            prompts,
            max_new_tokens,
            sampling,
            eos_token_id=eos_token_id,
            on_token=on_token,
            stats=stats,
        )
    # the last generated token is never fed back: the caches hold at most prompt + max_new_tokens - 1 tokens
    decoder = CachedDecoder(model, len(prompts), max(len(p) for p in prompts) + max_new_tokens - 1)
    last = torch.cat(decoder.extend(prompts, last_only=True))  # [B, V] prefill
    static = None if decode == "eager" else StaticDecodeStep(decoder, cuda_graph=decode == "graph")
    generator = sampling.generator(last.device)
    # the ids go to the host every step only where a host decision needs them (EOS, streaming); otherwise the
    # tokens stay on the device (sampled ids: in range, no check) and are copied once at the end
    per_step = eos_token_id is not None or on_token is not None
    kept: list[torch.Tensor] = []  # [B] per step, on the device (not per_step)
    out: list[list[int]] = [[] for _ in prompts]
    active = [True] * len(prompts)
    for step in range(max_new_tokens):
        chosen_t = next_tokens(last, sampling, generator)  # [B] on the logits' device
        if per_step:
            for b, tok in enumerate(chosen_t.tolist()):
                if active[b]:
                    out[b].append(tok)
                    if on_token is not None:
                        on_token(b, tok)
                    active[b] = tok != eos_token_id
        else:
            kept.append(chosen_t)
        if step + 1 == max_new_tokens or not any(active):
            break
        if static is not None:  # every sequence fed (a finished one: its logits are unused)
            last = static(chosen_t, ids_checked=True)  # [B, V] the step's output buffer
        elif all(active):
            last = decoder.step(chosen_t, ids_checked=True)  # [B, V]
        else:
            feed = [[seq[-1]] if alive else [] for seq, alive in zip(out, active)]
            rows = decoder.extend(feed, last_only=True)
            last = torch.stack(
                [r[-1] if len(r) else prev for r, prev in zip(rows, last)]
            )  # finished rows: unused
    if kept:
        out = torch.stack(kept, dim=1).tolist()  # [B, steps]: the one host copy
    return out
