"""The incremental detokenizer on random ids against the tokenizer's whole-sequence decode (the `tokenizers`
library's, which nobody here wrote): the embedded SmolLM2's byte-level BPE and the test BPE (decoded by
table, `sluice.engine.text.byte_level`) and mistral-common's SentencePiece model (`DecodeStream`), with
special tokens kept and skipped, characters split across ids, outputs ending mid-character, and ids past
the vocabulary."""

from __future__ import annotations

import random

import pytest
from tokenizer_fixtures import build_byte_level_bpe, build_sentencepiece_llama

from sluice.engine.loading.default_model import default_model_path
from sluice.engine.loading.gguf_loader import load_gguf
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.text.detokenizer import IncrementalDetokenizer
from sluice.engine.text.stop_strings import StopStringMatcher
from sluice.engine.text.tokenizer import Tokenizer

MULTI_BYTE_TEXTS = [
    "😀🚀 👍🏽 ❤️ 🇫🇷",
    "你好，世界。今天天气很好。",
    "Café naïve Straße \u9fff",
    "ü 你 😀\n\tend",
]
NUM_SEQUENCES = 150


@pytest.fixture(scope="module")
def tokenizers_by_name(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "smollm2": load_gguf(default_model_path()).tokenizer,
        "bpe": Tokenizer.from_pretrained(build_byte_level_bpe(root / "bpe")),
        "sentencepiece": Tokenizer.from_pretrained(build_sentencepiece_llama(root / "sp")),
    }


@pytest.fixture(params=["smollm2", "bpe", "sentencepiece"])
def tokenizer(request: pytest.FixtureRequest, tokenizers_by_name: dict[str, Tokenizer]) -> Tokenizer:
    return tokenizers_by_name[request.param]


def random_ids(tokenizer: Tokenizer, rng: random.Random) -> list[int]:
    """Up to 40 ids: any of the vocabulary, the first 300 (specials, single bytes), the added tokens, runs
    of the ids of multi-byte text cut anywhere (characters split across ids, outputs ending inside one)
    and, for byte-level tokenizers, ids past the vocabulary.

    SentencePiece's byte fallback decodes a run of byte tokens that is not valid UTF-8 as one U+FFFD per
    token (also a run cut at the output's end), which no streaming decode can match before the run ends
    (`DecodeStream` does not): for it, byte tokens come only as whole characters of whole texts."""
    byte_level = tokenizer.byte_level_vocab is not None
    vocab_size = tokenizer.vocab_size
    added = list(tokenizer.backend.get_added_tokens_decoder())
    is_byte = lambda i: not byte_level and (tokenizer.id_to_token(i) or "").startswith("<0x")
    ids: list[int] = []
    while len(ids) < rng.randrange(1, 40):
        kind = rng.randrange(5)
        if kind == 0:
            ids.append(rng.randrange(vocab_size))
        elif kind == 1:
            ids.append(rng.randrange(min(300, vocab_size)))
        elif kind == 2:
            ids.append(rng.choice(added))
        elif kind == 3:
            text_ids = tokenizer.encode(rng.choice(MULTI_BYTE_TEXTS), add_special_tokens=False)
            start = rng.randrange(len(text_ids)) if byte_level else 0
            ids += text_ids[start : start + rng.randrange(1, 6)] if byte_level else text_ids
        elif byte_level:
            ids.append(vocab_size + rng.randrange(64))  # a padded lm_head's id no token has
        ids = [i for i in ids if not is_byte(i) or kind == 3]
    return ids


def stream(tokenizer: Tokenizer, ids: list[int], params: SamplingParams, chunk: int) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, params)
    deltas = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detok.flush()


def test_fast_path_is_taken_for_byte_level_tokenizers_only(tokenizers_by_name: dict[str, Tokenizer]) -> None:
    assert tokenizers_by_name["smollm2"].byte_level_vocab is not None
    assert tokenizers_by_name["bpe"].byte_level_vocab is not None
    assert tokenizers_by_name["sentencepiece"].byte_level_vocab is None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])
def test_random_ids_concatenate_to_full_decode(
    tokenizer: Tokenizer, skip_special_tokens: bool, chunk: int
) -> None:
    rng = random.Random(f"{tokenizer.name}:{skip_special_tokens}:{chunk}")
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    num_split, num_special = 0, 0
    for _ in range(NUM_SEQUENCES):
        ids = random_ids(tokenizer, rng)
        deltas, tail = stream(tokenizer, ids, params, chunk)
        whole = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) + tail == whole, ids
        if "\ufffd" not in whole:
            assert not any("\ufffd" in delta for delta in deltas), ids
        num_split += any("\ufffd" in tokenizer.decode([i]) for i in ids)
        num_special += any(tokenizer.backend.id_to_token(i) in tokenizer.special_tokens.values() for i in ids)
    # The draws really held split characters and special tokens.
    assert num_split > 0 and num_special > 0


@pytest.mark.parametrize("chunk", [1, 3])
def test_sentencepiece_bytes_of_no_character_are_shown_not_dropped(tokenizers_by_name, chunk: int) -> None:
    """Held-back byte tokens that turn out to be no valid UTF-8 (a stream cannot know before the next
    token) once vanished from the stream, with the next token's leading space: now they come out as the
    whole decode shows them (U+FFFD), after what was already streamed of them."""
    tokenizer = tokenizers_by_name["sentencepiece"]
    byte = lambda b: tokenizer.token_to_id(f"<0x{b:02X}>")
    hello = tokenizer.encode("Say hello", add_special_tokens=False)
    cases = [
        ([byte(0xC3), byte(0xA9), byte(0x80), *hello], "\u00e9\ufffd Say hello"),  # é, then a lone byte
        ([hello[0], byte(0xE4), *hello[1:]], "Say\ufffd hello"),  # a character's first byte alone
    ]
    for ids, text in cases:
        deltas, tail = stream(tokenizer, ids, SamplingParams(), chunk)
        assert "".join(deltas) + tail == text, (ids, deltas)


@pytest.mark.parametrize("chunk", [1, 3])
def test_random_ids_stop_at_a_stop_string_of_their_text(tokenizer: Tokenizer, chunk: int) -> None:
    """A stop string drawn from the whole decode (2-4 characters, often a character split across ids or
    spanning several tokens) ends the text where it first occurs there, and no delta holds any of it."""
    rng = random.Random(f"{tokenizer.name}:stop:{chunk}")
    num_stopped = 0
    for _ in range(NUM_SEQUENCES):
        ids = random_ids(tokenizer, rng)
        whole = tokenizer.decode(ids)
        if len(whole) < 4:
            continue
        start = rng.randrange(len(whole) - 3)
        stop = whole[start : start + rng.randrange(2, 5)]
        detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=(stop, "\x00never")))
        deltas = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
        text = "".join(deltas) + detok.flush()
        assert (text, detok.stop_string) == (whole[: whole.find(stop)], stop), (ids, stop)
        assert 0 < detok.num_tokens <= len(ids)
        num_stopped += 1
    assert num_stopped > NUM_SEQUENCES // 2


def test_stop_string_matcher_on_random_pieces() -> None:
    """Over a 3-letter alphabet (many partial matches): the emitted text is the input up to the first stop
    string (the first listed on a tie), and what is held back is exactly the longest suffix that is a proper
    prefix of a stop string."""
    rng = random.Random(7)
    for _ in range(2000):
        stops = ["".join(rng.choices("abc", k=rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        matcher = StopStringMatcher(stops)
        text, emitted = "", ""
        while matcher.matched is None and len(text) < 30:
            piece = "".join(rng.choices("abc", k=rng.randrange(1, 4)))
            text += piece
            emitted += matcher.push(piece)
            if matcher.matched is None:
                held = text[len(emitted) :]
                assert emitted + held == text
                longest = max((k for s in stops for k in range(len(s)) if text.endswith(s[:k])), default=0)
                assert len(held) == longest, (stops, text, emitted)
        if matcher.matched is not None:
            first = min(stops, key=lambda s: (text.find(s), stops.index(s)) if s in text else (len(text), 0))
            assert (emitted, matcher.matched) == (text[: text.find(first)], first), (stops, text)


def test_added_tokens_outside_the_byte_alphabet_decode_as_tokenizers_does(tmp_path) -> None:
    """Added tokens are decoded through the byte-level alphabet when all their characters are in it
    ("naïve": ï stands for a byte) and as their own UTF-8 otherwise ("<tool call>": the space is not)."""
    tokenizer = Tokenizer.from_pretrained(build_byte_level_bpe(tmp_path / "bpe"))
    tokenizer.backend.add_tokens(["<tool call>", "naïve", "😀x"])
    tokenizer.backend.add_special_tokens(["<|special one|>"])
    assert tokenizer.byte_level_vocab is not None
    added = [tokenizer.token_to_id(t) for t in ("<tool call>", "naïve", "😀x", "<|special one|>")]
    rng = random.Random(3)
    words = tokenizer.encode("Café 😀 done", add_special_tokens=False)
    for skip_special_tokens in (True, False):
        for _ in range(50):
            ids = [rng.choice(added + words) for _ in range(rng.randrange(1, 12))]
            deltas, tail = stream(tokenizer, ids, SamplingParams(skip_special_tokens=skip_special_tokens), 1)
            assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), (
                ids
            )
