"""Incremental detokenization and stop strings; the reference is the tokenizer's whole-sequence decode."""

from __future__ import annotations

import dataclasses

import pytest
from tokenizer_fixtures import tokenizers_of_both_kinds

from sluice.engine.sampling_params import SamplingParams
from sluice.engine.text.detokenizer import IncrementalDetokenizer
from sluice.engine.text.stop_strings import StopStringMatcher
from sluice.engine.text.tokenizer import Tokenizer

TEXTS = [
    "Hello world! Streaming tokens one at a time.",
    "Café naïve résumé Straße jalapeño",
    "你好，世界。今天天气很好。",
    "Emoji 😀🚀 👍🏽 ❤️ 🇫🇷 done",
    "mixed: ü 你 😀\n\tend\u9fff",
]


@pytest.fixture(scope="module")
def tokenizers_by_kind(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    return tokenizers_of_both_kinds(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture(params=["bpe", "sentencepiece"])
def tokenizer(request: pytest.FixtureRequest, tokenizers_by_kind: dict[str, Tokenizer]) -> Tokenizer:
    return tokenizers_by_kind[request.param]


def stream(
    tokenizer: Tokenizer, ids: list[int], params: SamplingParams, chunk: int = 1
) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, params)
    deltas = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detok.flush()


@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_full_decode(tokenizer: Tokenizer, chunk: int) -> None:
    held_back_mid_character = 0
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        deltas, tail = stream(tokenizer, ids, SamplingParams(), chunk)
        assert "".join(deltas) + tail == tokenizer.decode(ids) == text
        assert tail == ""
        assert not any("\ufffd" in delta for delta in deltas)
        held_back_mid_character += deltas.count("")
    # One token at a time, the texts split characters across tokens: some steps had nothing safe to emit.
    assert held_back_mid_character > 0 or chunk > 1


def test_characters_really_span_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("😀\u9fff", add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_stop_string_across_tokens_is_not_emitted(tokenizer: Tokenizer) -> None:
    text = "Hello world, stop here please and more text"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    first_with_stop = next(i for i, piece in enumerate(pieces) if "stop here" in piece)
    assert "stop" in pieces[first_with_stop - 1]  # the stop string starts before the token that completes it
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=("stop here",)))
    emitted = [detok.add_tokens([i]) for i in ids]
    assert "".join(emitted) == "Hello world, "
    assert detok.stop_string == "stop here"
    assert all(delta == "" for delta in emitted[first_with_stop + 1 :])
    assert detok.add_tokens(ids) == ""
    assert detok.flush() == ""


def test_a_stop_string_in_the_first_min_tokens_tokens_does_not_stop(tokenizer: Tokenizer) -> None:
    """As in vLLM, stop strings count only once min_tokens outputs exist (it stopped after 3 of 10)."""
    ids = tokenizer.encode("the quick brown fox, the quick end", add_special_tokens=False)
    first_stop = next(i for i in range(len(ids)) if "quick" in tokenizer.decode(ids[: i + 1]))
    params = SamplingParams(max_tokens=len(ids), min_tokens=first_stop + 1, stop=("quick",))
    deltas, tail = stream(tokenizer, ids, params)
    text = tokenizer.decode(ids)
    assert "".join(deltas) + tail == text[: text.index("quick", text.index("quick") + 1)]
    deltas, tail = stream(tokenizer, ids, dataclasses.replace(params, min_tokens=0))
    assert "".join(deltas) + tail == text[: text.index("quick")]


def test_earliest_stop_string_wins_and_multibyte_stop(tokenizer: Tokenizer) -> None:
    text = "Emoji 😀🚀 then 你好，世界 and Straße"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, tail = stream(tokenizer, ids, SamplingParams(stop=("Straße", "世界", "🚀 then")))
    assert "".join(deltas) + tail == "Emoji 😀"
    deltas, tail = stream(tokenizer, ids, SamplingParams(stop=("世界",)))
    assert "".join(deltas) + tail == "Emoji 😀🚀 then 你好，"


def test_the_32nd_stop_string_still_stops(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world, stop here please", add_special_tokens=False)
    stops = (*(f"absent {i}" for i in range(31)), "stop here")  # MAX_STOP; one more is refused
    deltas, tail = stream(tokenizer, ids, SamplingParams(stop=stops))
    assert "".join(deltas) + tail == "Hello world, "
    with pytest.raises(ValueError, match=r"^stop: at most 32 strings, got 33$"):
        SamplingParams(stop=(*stops, "one more"))


def test_hold_back_is_bounded_and_flush_releases(tokenizer: Tokenizer) -> None:
    text = "abc abd abe the end ab"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=("abz", "the ended")))
    emitted = ""
    for i, token_id in enumerate(ids):
        emitted += detok.add_tokens([token_id])
        decoded = tokenizer.decode(ids[: i + 1])
        assert decoded.startswith(emitted)
        assert len(decoded) - len(emitted) <= len("the ended") - 1
    assert emitted == "abc abd abe the end "
    assert detok.flush() == "ab"
    assert detok.stop_string is None


def test_flush_after_partial_character_matches_decode(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok \u9fff", add_special_tokens=False)  # a rare CJK char: three byte tokens
    truncated = ids[:-1]
    assert tokenizer.decode(truncated).endswith("\ufffd")
    deltas, tail = stream(tokenizer, truncated, SamplingParams())
    assert "".join(deltas) + tail == tokenizer.decode(truncated)
    assert "\ufffd" not in "".join(deltas)


def test_long_output_ending_mid_character_matches_decode(tokenizer: Tokenizer) -> None:
    """Past the ids the detokenizer trims now and then, a flush still decodes its tail in context."""
    ids = tokenizer.encode(" ".join(TEXTS * 4) + " ok \u9fff", add_special_tokens=False)[:-1]
    assert len(ids) > 200 and tokenizer.decode(ids).endswith("\ufffd")
    deltas, tail = stream(tokenizer, ids, SamplingParams())
    assert "".join(deltas) + tail == tokenizer.decode(ids)
    assert tail.endswith("\ufffd") and "\ufffd" not in "".join(deltas)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_skip_special_tokens(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    eos = tokenizer.eos_token_ids[0]
    ids = tokenizer.encode("Hi 你好", add_special_tokens=True) + [eos] + tokenizer.encode("x", False) + [eos]
    deltas, tail = stream(tokenizer, ids, SamplingParams(skip_special_tokens=skip_special_tokens))
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) + tail == expected
    assert (tokenizer.eos_token in expected) is not skip_special_tokens


def test_stop_string_matcher_holds_only_possible_prefixes() -> None:
    matcher = StopStringMatcher(["</answer>", "STOP"])
    assert matcher.push("abc<") == "abc"
    assert matcher.push("/ans") == ""
    assert matcher.push("wer!") == "</answer!"
    assert matcher.push("ST") == ""
    assert matcher.push("OP tail") == ""
    assert matcher.matched == "STOP"
    assert matcher.push("more") == ""
    assert matcher.flush() == ""
    plain = StopStringMatcher([])
    assert plain.push("anything") == "anything"
    assert plain.flush() == ""
