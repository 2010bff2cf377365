"""Streaming decode for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM2), by table.

A tokenizer whose decoder is `ByteLevel` alone decodes ids as: each token's string (added tokens included,
special ones dropped with skip_special_tokens, unknown ids dropped) mapped back to bytes through GPT-2's
byte <-> character alphabet (a token with a character outside the alphabet is taken as its own UTF-8), the
bytes concatenated and decoded as UTF-8 with each invalid sequence replaced by U+FFFD. So each id's bytes
can be tabled once, and Python's incremental UTF-8 decoder (the same replacement rule) turns the stream into
text, holding back only a character still incomplete: about 0.15 us a token against 1.1 us for
`tokenizers.decoders.DecodeStream` (docs/BENCHMARKS.md, "Figures behind the code").
"""

from __future__ import annotations

import codecs

import tokenizers
from tokenizers import decoders


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode`, inverted: the printable character standing for each byte -> the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]
    return dict(zip(chars, printable + others, strict=True))


_CHAR_TO_BYTE = _byte_alphabet()


class ByteLevelVocab:
    """Each token id's bytes, with and without the special tokens (empty bytes for those skipped)."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        vocab = backend.get_vocab(with_added_tokens=True)  # token string -> id
        size = max(vocab.values(), default=-1) + 1
        self.token_bytes: list[bytes] = [b""] * size  # ids absent from the vocabulary decode to nothing
        for token, token_id in vocab.items():
            self.token_bytes[token_id] = _token_bytes(token)
        special = [i for i, added in backend.get_added_tokens_decoder().items() if added.special]
        self.token_bytes_skipping_special = list(self.token_bytes)
        for token_id in special:
            self.token_bytes_skipping_special[token_id] = b""

    @classmethod
    def of(cls, backend: tokenizers.Tokenizer) -> ByteLevelVocab | None:
        """The table, when `backend` decodes with `ByteLevel` alone; else None."""
        return cls(backend) if type(backend.decoder) is decoders.ByteLevel else None


def _token_bytes(token: str) -> bytes:
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in token)
    except KeyError:  # an added token written in plain text
        return token.encode("utf-8")


class ByteLevelStream:
    """One request's text from its ids. `step` returns the text completed by one more id."""

    def __init__(self, vocab: ByteLevelVocab, skip_special_tokens: bool) -> None:
        self._token_bytes = vocab.token_bytes_skipping_special if skip_special_tokens else vocab.token_bytes
        self._held = b""  # the bytes of an incomplete last character

    def step(self, token_id: int) -> str:
        # What codecs' incremental UTF-8 decoder does, without its Python frame. Sampled ids are never
        # negative; one past the tokenizer's vocabulary (a padded lm_head) is dropped.
        try:
            data = self._held + self._token_bytes[token_id]
        except IndexError:
            return ""
        text, num_consumed = codecs.utf_8_decode(data, "replace", False)
        self._held = data[num_consumed:]
        return text

    def flush(self) -> str:
        """The held-back bytes of an incomplete last character, as U+FFFD (as a whole decode shows them)."""
        held, self._held = self._held, b""
        return codecs.utf_8_decode(held, "replace", True)[0]
