"""``StaticDecodeStep``: the whole model's lockstep decode step on static shapes, optionally as a CUDA graph.

After the prefill (:meth:`CachedDecoder.extend <hybrid_model.generation.decoder.CachedDecoder.extend>`), every
decode step feeds one token to every sequence. With the lengths in a device buffer the step has fixed shapes and
reads nothing back to the host::

    tokens [B]  (static input buffer)  ->  DSv4Model.forward(tokens [1, B], no packed_seq_params)
        every DSv4 attention -> AttentionCache.extend_static(rows [B, d], lengths [B])   (bound hook)
        everything else per token (embedding, mHC, MoE with hash routing by token id, head)
    -> logits [B, V] (static output buffer);  lengths += 1 (on the device)

The model sees ``[1, B]`` as one sequence of ``B`` tokens, but nothing outside attention mixes tokens, and attention
is the cache's. ``cuda_graph=True`` (CUDA only) runs one eager warm-up step on a side stream, then captures the next
step in a ``torch.cuda.CUDAGraph`` and replays it for every later step (each replay reads the token and length
buffers and advances the lengths itself). Sequences that stopped (EOS) keep being fed; their tokens are ignored.
The hash layers do not range-check the ids (``hash_moe.token_ids_checked``: no host read per layer); a call checks
them once on the device, or not at all for sampled ids (``ids_checked=True``).
"""

from __future__ import annotations

import contextlib

import torch

from dsv4_attention.decode import StepIndices, bind_static_decode_step
from hash_moe import token_ids_checked
from hybrid_model.generation.decoder import CachedDecoder, assert_token_ids


class StaticDecodeStep:
    """Lockstep decode steps of ``decoder``'s sequences (after its prefill).

    Args:
        decoder: a :class:`CachedDecoder` whose sequences all hold at least one token.
        cuda_graph: capture the step in a CUDA graph (the model must be on a CUDA device).
    """

    def __init__(self, decoder: CachedDecoder, *, cuda_graph: bool = False) -> None:
        if min(decoder.lengths) < 1:
            raise ValueError(
                "a static decode step continues prefilled sequences: call decoder.extend(prompts) first"
            )
        device = next(decoder.model.parameters()).device
        if cuda_graph and device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs the model on a CUDA device, it is on {device}")
        self.decoder = decoder
        self.cuda_graph = cuda_graph
        self.tokens = torch.zeros(decoder.batch_size, dtype=torch.long, device=device)  # [B]
        self.lengths = torch.tensor(decoder.lengths, dtype=torch.long, device=device)  # [B]
        self.logits: torch.Tensor | None = None  # [B, V] fp32, written by every step
        self._graph: torch.cuda.CUDAGraph | None = None

    @torch.no_grad()
    def _forward(self) -> None:
        dec = self.decoder
        # this step's index tensors, shared by every layer
        indices = StepIndices(self.lengths, dec.batch_size)
        with contextlib.ExitStack() as bound:
            bound.enter_context(token_ids_checked())  # checked once per step in __call__ (or sampled ids)
            for layer, cache in zip(dec.layers, dec.caches):
                bound.enter_context(bind_static_decode_step(layer, cache, self.lengths, lambda: indices))
            logits = dec.model(self.tokens[None], None, None)[0].float()  # [B, V]
        if self.logits is None:
            self.logits = torch.empty_like(logits)
        self.logits.copy_(logits)
        self.lengths.add_(1)

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward()  # warm-up: allocations, Triton compilation, cached tables
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._forward()
        self._graph = graph

    def __call__(self, tokens: torch.Tensor, *, ids_checked: bool = False) -> torch.Tensor:
        """Append ``tokens [B]`` (one per sequence) and return the logits ``[B, V]`` of the new positions (a buffer
        the next step overwrites: copy it to keep it). ``ids_checked``: the ids are known to lie in the vocabulary
        (sampled over it), no range check; otherwise one asynchronous device-side check per step (no host sync;
        outside the CUDA graph), not one per hash layer."""
        dec = self.decoder
        if tokens.shape != self.tokens.shape:
            raise ValueError(
                f"a decode step takes one token per sequence [{dec.batch_size}], got {tuple(tokens.shape)}"
            )
        new_lengths = tuple(n + 1 for n in dec.lengths)
        if max(new_lengths) > dec.max_length:
            raise ValueError(
                f"a sequence would hold {max(new_lengths)} tokens, more than the decoder's max_length={dec.max_length}"
            )
        model = dec.model
        was_training = model.training
        model.eval()
        try:
            self.tokens.copy_(tokens)
            if not ids_checked:
                assert_token_ids(self.tokens, model.model_config.vocab_size)
            if not self.cuda_graph:
                self._forward()
            elif self._graph is None:
                self._capture()  # the warm-up step is this step; the captured one is replayed from the next
            else:
                self._graph.replay()
        finally:
            model.train(was_training)
        dec.lengths = new_lengths
        for cache in dec.caches:
            cache.advance(new_lengths)
        return self.logits
