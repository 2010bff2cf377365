"""Where the output's text follows vLLM's detokenizer: a SentencePiece output continues its prompt (the first
word keeps its leading space), and a stop string completed after min_tokens tokens may start in their text."""

from __future__ import annotations

import random

import pytest
from tokenizer_fixtures import tokenizers_of_both_kinds

from sluice.engine.frontend.output_processor import OutputProcessor
from sluice.engine.messages import AddRequest, CoreOutput
from sluice.engine.outputs import OutputLogprobs
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.text.detokenizer import IncrementalDetokenizer
from sluice.engine.text.stop_strings import StopStringMatcher
from sluice.engine.text.tokenizer import Tokenizer

# (prompt, output) pairs, the output starting a new word, a multi-byte character, or mid-word.
CONTINUATIONS = [
    ("The capital of France is", " Paris, and then some"),
    ("Emoji time:", " 😀🚀 👍🏽 done"),
    ("你好，", "世界。今天天气很好。"),
    ("Straß", "e and café naïve"),
    ("a", " b"),
    # A prompt ending in its own U+FFFD (pasted text holds them) is whole: SentencePiece's output still
    # starts " Paris"; after a 4-byte character of byte tokens, its shortest tail of 4 ids would start
    # mid-character (the context is 5).
    ("Garbled \ufffd", " Paris"),
    ("\U00020000\ufffd", " Paris"),
]


@pytest.fixture(scope="module")
def tokenizers_by_kind(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    return tokenizers_of_both_kinds(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture(params=["bpe", "sentencepiece"])
def tokenizer(request: pytest.FixtureRequest, tokenizers_by_kind: dict[str, Tokenizer]) -> Tokenizer:
    return tokenizers_by_kind[request.param]


def _split(tokenizer: Tokenizer, prompt: str, output: str) -> tuple[list[int], list[int], str]:
    """The prompt's ids, the output's, and the text the output adds to the prompt's."""
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
    output_ids = tokenizer.encode(output, add_special_tokens=False)
    prompt_text = tokenizer.decode(prompt_ids)
    whole = tokenizer.decode(prompt_ids + output_ids)
    assert whole.startswith(prompt_text) and whole.replace(" ", "") == (prompt + output).replace(" ", "")
    return prompt_ids, output_ids, whole[len(prompt_text) :]


def _core_output(ids: list[int], finish_reason: str | None = None) -> CoreOutput:
    logprobs = OutputLogprobs(ids, [-1.0] * len(ids), 0, [], [])
    return CoreOutput("r", ids, logprobs, 0, 0, None, None, finish_reason=finish_reason)


def test_the_first_output_word_keeps_its_leading_space(tokenizers_by_kind: dict[str, Tokenizer]) -> None:
    """Llama 2 / Mistral SentencePiece: "▁Paris" alone decodes as "Paris", after the prompt as " Paris"
    (vLLM, TGI); a client appending the output to its prompt must not get "isParis"."""
    tokenizer = tokenizers_by_kind["sentencepiece"]
    prompt_ids, output_ids, _ = _split(tokenizer, "The capital of France is", " Paris")
    assert tokenizer.decode(output_ids) == "Paris"  # the first piece's space is stripped in a lone decode
    processor = OutputProcessor(tokenizer)
    processor.add_request(AddRequest("r", prompt_ids, SamplingParams(max_tokens=len(output_ids)), 0.0))
    (out,) = processor.process([_core_output(output_ids, finish_reason="length")]).outputs
    assert (out.text, out.token_ids) == (" Paris", tuple(output_ids))


@pytest.mark.parametrize("prompt,output", CONTINUATIONS)
def test_streamed_output_continues_the_prompt(tokenizer: Tokenizer, prompt: str, output: str) -> None:
    """One id at a time through the output processor, the deltas join to what the output adds to the
    prompt's text, with no partial character (U+FFFD) in any delta."""
    prompt_ids, output_ids, expected = _split(tokenizer, prompt, output)
    processor = OutputProcessor(tokenizer)
    processor.add_request(AddRequest("r", prompt_ids, SamplingParams(max_tokens=len(output_ids)), 0.0))
    deltas = [
        processor.process([_core_output([token_id], "length" if last else None)]).outputs[0].text
        for last, token_id in ((i == len(output_ids) - 1, t) for i, t in enumerate(output_ids))
    ]
    assert "".join(deltas) == expected
    assert expected == output or tokenizer.byte_level_vocab is None  # SentencePiece: "e" alone is "▁e"
    assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_tokens_text_is_in_the_output_only_with_include_stop_str_in_output(
    tokenizer: Tokenizer, include: bool
) -> None:
    """As vLLM's detokenizer: the token that stopped the output is left out of the text unless
    include_stop_str_in_output (it was left out either way)."""
    prompt_ids, output_ids, _ = _split(tokenizer, "The capital of France is", " Paris, and then")
    stop = output_ids[-1]
    params = SamplingParams(stop_token_ids=[stop], include_stop_str_in_output=include)
    processor = OutputProcessor(tokenizer)
    processor.add_request(AddRequest("r", prompt_ids, params, 0.0))
    core_output = _core_output(output_ids, finish_reason="stop")
    core_output.stop_reason = stop
    (out,) = processor.process([core_output]).outputs
    kept = output_ids if include else output_ids[:-1]
    whole = tokenizer.decode(prompt_ids + kept, skip_special_tokens=False)
    assert out.text == whole[len(tokenizer.decode(prompt_ids, skip_special_tokens=False)) :]
    assert out.token_ids == tuple(output_ids)
    assert out.text.endswith(" then") == include


def test_a_prompt_ending_mid_character_is_not_decoded_into_the_output(tokenizer: Tokenizer) -> None:
    """The prompt's last ids are bytes of a character its output completes: the output's text is its own
    decode (U+FFFD for the bytes it lacks), never the prompt's bytes."""
    ids = tokenizer.encode("ok \u9fff\u9fff", add_special_tokens=False)  # a rare CJK char: byte tokens
    prompt_ids = ids[:-1]
    assert tokenizer.decode(prompt_ids).endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(), prompt_ids)
    text = detok.add_tokens(ids[-1:]) + detok.flush()
    assert text == tokenizer.decode(ids[-1:]) == "\ufffd"


@pytest.mark.parametrize("output", ["\ufffd", "\ufffd\ufffd then", " \ufffd"])
def test_u_fffd_in_an_output_after_a_prompt_ending_in_one_stays(tokenizer: Tokenizer, output: str) -> None:
    """The prompt's held-back U+FFFD is left out of the output's text, not one of the output's own."""
    prompt_ids, output_ids, expected = _split(tokenizer, "Garbled \ufffd", output)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(), prompt_ids)
    text = "".join(detok.add_tokens([token_id]) for token_id in output_ids) + detok.flush()
    assert text == expected and text.count("\ufffd") == output.count("\ufffd")


def test_a_stop_string_completed_after_min_tokens_may_start_within_them(tokenizer: Tokenizer) -> None:
    """vLLM checks stop strings once min_tokens outputs exist, over the new text and the stop string's
    length before it: "fox j" here starts in the first min_tokens tokens' text and ends after it."""
    ids = tokenizer.encode("the quick brown fox jumps over the fox jumps", add_special_tokens=False)
    min_tokens = next(i for i in range(len(ids)) if tokenizer.decode(ids[:i]).endswith("fox"))
    assert not tokenizer.decode(ids[min_tokens : min_tokens + 1]).lstrip().startswith("fox")
    params = SamplingParams(max_tokens=len(ids), min_tokens=min_tokens, stop=("fox j",))
    detok = IncrementalDetokenizer(tokenizer, params)
    deltas = [detok.add_tokens([token_id]) for token_id in ids]
    assert "".join(deltas) + detok.flush() == "the quick brown "
    assert detok.stop_string == "fox j"
    completes = next(i for i in range(len(ids)) if "fox j" in tokenizer.decode(ids[: i + 1]))
    assert detok.num_tokens == completes + 1 > min_tokens  # the tokens up to the one completing it count
    # A stop string wholly inside the first min_tokens tokens' text still does not stop the output.
    params = SamplingParams(max_tokens=len(ids), min_tokens=min_tokens + 3, stop=("fox j",))
    detok = IncrementalDetokenizer(tokenizer, params)
    text = detok.add_tokens(ids) + detok.flush()
    assert text == "the quick brown fox jumps over the "


def test_text_held_within_min_tokens_matches_only_stop_strings_ending_after_it() -> None:
    matcher = StopStringMatcher(["ab", "xaby"])
    assert matcher.push("-xab", match=False) == "-"  # "xab" may still begin "xaby"
    assert matcher.push("c") == "xabc"  # "ab" lies wholly in the earlier text: no match (as in vLLM)
    assert matcher.matched is None
    assert matcher.push("ab") == ""
    assert matcher.matched == "ab"


def test_the_text_flushed_within_min_tokens_does_not_stop(tokenizer: Tokenizer) -> None:
    """An output of min_tokens tokens ending mid-character: its flushed U+FFFD is still their text."""
    ids = tokenizer.encode("ok \u9fff", add_special_tokens=False)[:-1]
    params = SamplingParams(max_tokens=len(ids), min_tokens=len(ids), stop=("\ufffd",))
    detok = IncrementalDetokenizer(tokenizer, params)
    text = detok.add_tokens(ids) + detok.flush()
    assert text == tokenizer.decode(ids) and text.startswith("ok \ufffd")
    assert detok.stop_string is None


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string_unheld(tokenizer: Tokenizer) -> None:
    """vLLM's include_stop_str_in_output: the text ends with the stop string (what follows it in the same
    token is dropped), and nothing is held back while it might begin one (vLLM's stop buffer is 0 then)."""
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids), stop=("fox ju", "lazy"), include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, params)
    deltas = [detok.add_tokens([token_id]) for token_id in ids]
    assert "".join(deltas) + detok.flush() == "the quick brown fox ju"
    assert detok.stop_string == "fox ju"
    plain = IncrementalDetokenizer(tokenizer, SamplingParams(max_tokens=len(ids)))
    unheld = [plain.add_tokens([token_id]) for token_id in ids[: len(deltas)]]
    # Up to the token completing the stop string, each delta is what a request without stop strings gets.
    completes = detok.num_tokens - 1
    assert deltas[:completes] == unheld[:completes]


def test_an_included_stop_string_is_found_across_emitted_pieces() -> None:
    rng = random.Random(11)
    for _ in range(2000):
        stops = ["".join(rng.choices("abc", k=rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        matcher = StopStringMatcher(stops, include=True)
        text, emitted = "", ""
        while matcher.matched is None and len(text) < 30:
            piece = "".join(rng.choices("abc", k=rng.randrange(1, 4)))
            text += piece
            emitted += matcher.push(piece)
            if matcher.matched is None:
                assert emitted == text  # nothing held back
        if matcher.matched is not None:
            # The earliest to start (all end in the last piece), on a tie the one listed first, as without
            # `include`; the text ends with it.
            start, _, first = min((text.find(s), stops.index(s), s) for s in stops if s in text)
            assert (emitted, matcher.matched) == (text[: start + len(first)], first), (stops, text)


def test_held_text_is_the_longest_suffix_that_may_begin_a_stop_string() -> None:
    """Against the definition, recomputed from the whole text at every piece: pieces within min_tokens
    (match False) included, stop strings that overlap themselves ("aab", "abab") and each other."""
    rng = random.Random(5)
    for _ in range(3000):
        stops = ["".join(rng.choices("ab", k=rng.randrange(1, 6))) for _ in range(rng.randrange(1, 4))]
        matcher = StopStringMatcher(stops)
        text, emitted, unmatched = "", "", rng.randrange(0, 4)  # the first pieces may not match
        for number in range(12):
            piece = "".join(rng.choices("abc", k=rng.randrange(1, 4)))
            text += piece
            emitted += matcher.push(piece, match=number >= unmatched)
            if matcher.matched is not None:
                break
            held = max(
                (k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0
            )
            assert emitted == text[: len(text) - held], (stops, text)
