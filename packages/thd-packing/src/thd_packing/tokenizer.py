"""Tokenizers for the raw-text datasets: a built-in byte-level tokenizer (no download) and a Hugging Face
``tokenizers`` JSON file.

Both expose ``encode(text) -> list[int]``, ``encode_batch(texts)``, ``decode(ids)``, ``eod``, ``pad_id`` and
``vocab_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    """What the datasets need from a tokenizer."""

    @property
    def eod(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids ``0..255`` are bytes, ``256`` is EOD, ``257`` is padding (vocab 258)."""

    eod = 256
    pad_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


_EOD_CANDIDATES = (
    "<|endoftext|>",
    "<|end_of_text|>",
    "<｜end▁of▁sentence｜>",
    "</s>",
    "<eos>",
    "<|eos|>",
    "[SEP]",
)


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file (``tokenizer.json``), loaded locally.

    Args:
        path: the JSON file.
        eod_token: the end-of-document token; default: the first of a few common names present in the vocab.
        pad_token: the padding token; default: the EOD id (padding is always masked out of the loss).
    """

    def __init__(
        self, path: str | Path, *, eod_token: str | None = None, pad_token: str | None = None
    ) -> None:
        from tokenizers import Tokenizer as _HF

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer file {path} does not exist; pass a Hugging Face tokenizer.json")
        try:
            self._tok = _HF.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"{path}: not a valid Hugging Face tokenizers JSON file ({err})") from err
        self.path = path
        self._eod = self._lookup(eod_token, _EOD_CANDIDATES, "eod_token")
        self._pad = self._eod if pad_token is None else self._lookup(pad_token, (), "pad_token")
        self._vocab = self._tok.get_vocab_size(with_added_tokens=True)

    def _lookup(self, token: str | None, candidates: Sequence[str], what: str) -> int:
        names = (token,) if token is not None else candidates
        for name in names:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return int(tid)
        if token is not None:
            raise ValueError(f"{self.path}: {what} {token!r} is not in the vocabulary")
        raise ValueError(
            f"{self.path}: none of the usual end-of-document tokens {list(candidates)} is in the vocabulary; "
            f"pass {what}=... naming the tokenizer's EOD token"
        )

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, eod={self._eod})"


def load_tokenizer(spec: str | Path | Tokenizer | None = None, **kwargs) -> Tokenizer:
    """``None`` or ``"byte"``: :class:`ByteTokenizer`; a path to a ``.json`` file: :class:`HFTokenizer`;
    a tokenizer object is returned unchanged."""
    if spec is None or spec == "byte":
        return ByteTokenizer()
    if isinstance(spec, (str, Path)):
        return HFTokenizer(spec, **kwargs)
    if isinstance(spec, Tokenizer):
        return spec
    raise ValueError(f"tokenizer must be 'byte', a tokenizer.json path or a tokenizer object, got {spec!r}")
