"""Streaming token ids -> text deltas, with stop strings.

The concatenated deltas (and `flush`) are the output's text as it continues the prompt: what
`Tokenizer.decode(prompt_tail + output_ids)` adds to `Tokenizer.decode(prompt_tail)`, as in vLLM. For most
tokenizers that is `Tokenizer.decode(output_ids)`; a SentencePiece one whose decoder strips the first leading
space (Llama 2, Mistral: "▁Paris" alone decodes as "Paris") keeps the space of a first output word that
continues the prompt (" Paris"). Two ways to get there:

- byte-level BPE tokenizers (decoder `ByteLevel` alone): a table of each id's bytes and an incremental
  UTF-8 decoder (`sluice.engine.text.byte_level`), the fast path;
- any other (SentencePiece's byte fallback and leading-space rule, WordPiece, ...):
  `tokenizers.decoders.DecodeStream`, which re-decodes a short window of recent ids and emits only the new
  suffix once it does not end in a partial UTF-8 character (U+FFFD).
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

from sluice.engine.sampling_params import SamplingParams
from sluice.engine.text.byte_level import ByteLevelStream
from sluice.engine.text.stop_strings import StopStringMatcher
from sluice.engine.text.tokenizer import Tokenizer

# Ids kept before the undecoded tail, so `flush` decodes it in context (leading spaces, merges).
_CONTEXT_IDS = 4
# Ids held at most before the decoded ones beyond the last _CONTEXT_IDS are dropped.
_MAX_IDS = 64
# The prompt's last ids that `_WindowStream` starts after (vLLM's choice: the shortest tail of at least 4 ids
# that decodes with no partial character, looked for up to 24 ids back).
_PROMPT_CONTEXT_IDS = range(4, 25)
# A SentencePiece byte-fallback token: one byte of a character the vocabulary lacks.
_FALLBACK_BYTE = re.compile(r"<0x([0-9A-F]{2})>")


class IncrementalDetokenizer:
    """One request's output text, produced a delta at a time.

    `stop_string` is set once one of `params.stop` ends in the text of a token after the first
    `params.min_tokens` (as in vLLM, it may start in theirs); the text from it on (after it, with
    `params.include_stop_str_in_output`) is never emitted and later tokens are ignored.
    `prompt_token_ids`: the prompt, whose last ids the output's text continues.
    """

    def __init__(
        self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: Sequence[int] = ()
    ) -> None:
        vocab = tokenizer.byte_level_vocab
        self._stream: ByteLevelStream | _WindowStream = (
            _WindowStream(tokenizer.backend, params.skip_special_tokens, prompt_token_ids)
            if vocab is None
            else ByteLevelStream(vocab, params.skip_special_tokens)
        )
        include = params.include_stop_str_in_output
        self._stops = StopStringMatcher(params.stop, include) if params.stop else None
        self.includes_stop_token = include  # the text of a stop token that ends the output (vLLM's)
        self._min_tokens = params.min_tokens  # stop strings end no output shorter (as in vLLM)
        self.num_tokens = 0  # ids taken in: all fed ones up to the one that completed a stop string

    @property
    def stop_string(self) -> str | None:
        return None if self._stops is None else self._stops.matched

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Feed newly sampled ids; return the text that is safe to emit now."""
        stops, step = self._stops, self._stream.step
        if stops is None:
            self.num_tokens += len(token_ids)
            return step(token_ids[0]) if len(token_ids) == 1 else "".join(map(step, token_ids))
        text = ""
        for token_id in token_ids:
            if stops.matched is not None:
                break
            self.num_tokens += 1
            piece = step(token_id)
            if piece:
                # Within the first min_tokens tokens, text that may begin a stop string is still held.
                text += stops.push(piece, match=self.num_tokens > self._min_tokens)
        return text

    def flush(self, match: bool = True) -> str:
        """The request ended without a stop string: return everything still held back. The held bytes of a
        partial character come out as U+FFFD, which may complete a stop string; not with `match` False
        (an output the core aborted or failed: the end it gives stands)."""
        stops = self._stops
        if stops is None:
            return self._stream.flush()
        if stops.matched is not None:
            return ""
        tail = stops.push(self._stream.flush(), match=match and self.num_tokens > self._min_tokens)
        return tail + stops.flush()


class _WindowStream:
    """`DecodeStream` started after the prompt's last ids, plus the recent ids to decode a tail left
    incomplete at the end."""

    def __init__(
        self, backend: tokenizers.Tokenizer, skip_special_tokens: bool, prompt_token_ids: Sequence[int] = ()
    ) -> None:
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # _ids: recent ids; the last _num_undecoded of them produced no text yet (partial character).
        self._ids: list[int] = []
        self._num_undecoded = 0
        # The prompt's text DecodeStream holds back, to emit with the output's first text: a U+FFFD the
        # prompt ends in (it holds any text ending in one, as maybe a partial character).
        self._held_prompt_text = ""
        context = self._prompt_context(prompt_token_ids)
        try:
            emitted = "".join(self._stream.step(backend, token_id) or "" for token_id in context)
        except Exception:  # a decoder DecodeStream cannot follow over these ids: start without them
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        else:
            self._ids += context
            text = backend.decode(context, skip_special_tokens=skip_special_tokens)
            self._held_prompt_text = text[len(emitted) :] if text.startswith(emitted) else ""

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt's shortest tail of at least 4 ids that decodes whole (no partial character at
        either end); none if there is no such tail within 24 ids (a prompt ending mid-character)."""
        if not prompt_token_ids:
            return []
        for num_ids in _PROMPT_CONTEXT_IDS:
            tail = list(prompt_token_ids[-num_ids:])
            if self._decodes_whole(tail):
                return tail
            if num_ids >= len(prompt_token_ids):
                break
        return []

    def _decodes_whole(self, ids: list[int]) -> bool:
        """No partial character at either end of `ids`' text. A U+FFFD in it is one (vLLM's test) unless
        the tokenizer falls back to byte tokens ("<0xE2>") and those at the ends of `ids` cut no
        character: then it is the prompt's own U+FFFD (pasted text holds them), and the output's first
        word still gets its leading space after it."""
        if "\ufffd" not in self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens):
            return True
        if self._backend.token_to_id("<0x80>") is None:  # not byte fallback: a byte-level tokenizer's
            return False  # bytes show as no such tokens, so a U+FFFD may be a cut character
        first = _fallback_byte(self._backend.id_to_token(ids[0]))
        if first is not None and 0x80 <= first < 0xC0:  # a continuation byte: cut at the start
            return False
        last_bytes = bytearray()
        for token_id in reversed(ids):
            byte = _fallback_byte(self._backend.id_to_token(token_id))
            if byte is None:
                break
            last_bytes.insert(0, byte)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        decoder.decode(bytes(last_bytes))
        return not decoder.getstate()[0]  # no bytes held for a character still to come

    def step(self, token_id: int) -> str:
        ids = self._ids
        ids.append(token_id)
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception as e:
            # DecodeStream's state breaks when a decoder is not prefix-monotonic (vLLM issue 17448), as
            # when held-back byte tokens turn out to be no valid UTF-8: restarted from this token, as vLLM
            # does, after emitting what a whole decode shows for the held-back ids and this one.
            if "Invalid prefix" not in str(e):
                raise
            text = self._tail_text(self._num_undecoded + 1)  # after the prompt's text, held or not
            self._held_prompt_text = ""
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            self._stream.step(self._backend, token_id)
        if text is None:
            self._num_undecoded += 1
            return ""
        self._num_undecoded = 0
        if self._held_prompt_text:
            held, self._held_prompt_text = self._held_prompt_text, ""
            text = text.removeprefix(held)
        if len(ids) > _MAX_IDS:  # trimmed now and then, not at every token
            del ids[:-_CONTEXT_IDS]
        return text

    def flush(self) -> str:
        """The undecoded tail, decoded after a little context (an incomplete character comes out as
        U+FFFD, exactly as a whole decode of the output shows it)."""
        if self._num_undecoded == 0:
            return ""
        text = self._tail_text(self._num_undecoded)
        self._num_undecoded = 0
        return text

    def _tail_text(self, num_ids: int) -> str:
        """The text of the last `num_ids` ids, decoded after a little context (so that a leading space
        stays, and bytes of no valid character come out as U+FFFD, as in a whole decode)."""
        end = len(self._ids) - num_ids
        context = self._ids[max(0, end - _CONTEXT_IDS) : end]
        decode = lambda ids: self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
        prefix, full = decode(context), decode(context + self._ids[end:])
        return full[len(prefix) :] if full.startswith(prefix) else decode(self._ids[end:])


def _fallback_byte(token: str | None) -> int | None:
    """The byte a byte-fallback token stands for; None for any other token."""
    match = None if token is None else _FALLBACK_BYTE.fullmatch(token)
    return None if match is None else int(match[1], 16)
