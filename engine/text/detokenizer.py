"""Streaming token ids -> text deltas, with stop strings.

Decoding uses `tokenizers.decoders.DecodeStream`, which re-decodes a short window of recent ids and emits
only the new suffix once it does not end in a partial UTF-8 character (U+FFFD). That handles byte-level BPE,
SentencePiece byte fallback and SentencePiece's leading-space rule alike, so the concatenated deltas equal
`Tokenizer.decode(all_output_ids)`.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers.decoders import DecodeStream

from sluice.engine.sampling_params import SamplingParams
from sluice.engine.text.stop_strings import StopStringMatcher
from sluice.engine.text.tokenizer import Tokenizer

# Ids kept before the undecoded tail, so `flush` decodes it in context (leading spaces, merges).
_CONTEXT_IDS = 4
# Ids held at most before the decoded ones beyond the last _CONTEXT_IDS are dropped.
_MAX_IDS = 64


class IncrementalDetokenizer:
    """One request's output text, produced a delta at a time.

    `stop_string` is set once one of `params.stop` appears; the text from it on is never emitted and
    later tokens are ignored.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._backend = tokenizer.backend
        self._skip_special_tokens = params.skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        self._stops = StopStringMatcher(params.stop)
        # _ids: recent ids; the last _num_undecoded of them produced no text yet (partial character).
        self._ids: list[int] = []
        self._num_undecoded = 0
        self.num_tokens = 0  # ids taken in: all fed ones up to the one that completed a stop string

    @property
    def stop_string(self) -> str | None:
        return self._stops.matched

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Feed newly sampled ids; return the text that is safe to emit now."""
        stops = self._stops
        pieces = []
        for token_id in token_ids:
            if stops.matched is not None:
                break
            self.num_tokens += 1
            text = self._step(token_id)
            if text:
                pieces.append(stops.push(text))
        return pieces[0] if len(pieces) == 1 else "".join(pieces)

    def flush(self) -> str:
        """The request ended without a stop string: return everything still held back."""
        if self._stops.matched is not None:
            return ""
        tail = self._decode_undecoded_tail()
        return self._stops.push(tail) + self._stops.flush()

    def _step(self, token_id: int) -> str | None:
        ids = self._ids
        ids.append(token_id)
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception as e:
            # DecodeStream's state breaks when a decoder is not prefix-monotonic (vLLM issue 17448);
            # restart it from this token, as vLLM does.
            if "Invalid prefix" not in str(e):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            text = self._stream.step(self._backend, token_id)
        if text is None:
            self._num_undecoded += 1
            return None
        self._num_undecoded = 0
        if len(ids) > _MAX_IDS:  # trimmed now and then, not at every token
            del ids[:-_CONTEXT_IDS]
        return text

    def _decode_undecoded_tail(self) -> str:
        if self._num_undecoded == 0:
            return ""
        # Decode the tail after a little context and keep what the context did not produce; an incomplete
        # character comes out as U+FFFD, exactly as a whole decode of the output shows it.
        end = len(self._ids) - self._num_undecoded
        context = self._ids[max(0, end - _CONTEXT_IDS) : end]
        decode = lambda ids: self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
        prefix, full = decode(context), decode(context + self._ids[end:])
        self._num_undecoded = 0
        return full[len(prefix) :] if full.startswith(prefix) else decode(self._ids[end:])
