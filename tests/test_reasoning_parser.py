"""The reasoning parser (sluice.engine.text.reasoning): vLLM's examples, and streaming equal to the one-shot
split wherever the text is cut."""

from __future__ import annotations

import itertools
import random

import pytest

from sluice.engine.config import ModelConfig
from sluice.engine.text.reasoning import ReasoningParser, prompt_ends_reasoning

PARSERS = ("deepseek_r1", "qwen3")

# The cases of vLLM's deepseek_r1 tests (tests/reasoning/test_deepseekr1_reasoning_parser.py), and a nested
# tag as its one-shot split reads it: output -> (reasoning, content), a missing part as "".
VLLM_EXAMPLES = [
    (
        "<think>This is a reasoning section</think>This is the rest",
        ("This is a reasoning section", "This is the rest"),
    ),
    (
        "This is a reasoning section</think>This is the rest",
        ("This is a reasoning section", "This is the rest"),
    ),
    ("<think>This is a reasoning section</think>", ("This is a reasoning section", "")),
    ("This is a reasoning section</think>", ("This is a reasoning section", "")),
    ("<think>This is a reasoning section", ("This is a reasoning section", "")),
    ("This is a reasoning section", ("This is a reasoning section", "")),
    ("<think></think>This is the rest", ("", "This is the rest")),
    ("</think>This is the rest", ("", "This is the rest")),
    (
        "<think>This is a reasoning section\nThat continues</think>This is the rest\nThat continues",
        ("This is a reasoning section\nThat continues", "This is the rest\nThat continues"),
    ),
    ("<think>Reasoning <think>nested</think>rest</think>end", ("Reasoning <think>nested", "rest</think>end")),
]

TEXTS = [
    "<think>abc</think>answer",
    "abc</think>answer",
    "<think>abc",
    "",
    "</think>",
    "<think>",
    "<th",
    "</thi",
    "a</thinkX</think>b",
    "x<think>y</think>z<think>w",
    "<<think>>a<</think>>b",
    "a<tool_call>\n<function=get>{}</tool_call>b",
    'a<tool_call>  <function name="x">',
    'a<tool_call>{"name": "f"}</tool_call><tool_call>\n<function=g></think>c',
    "a<tool_call> <func",
    "a<tool_call> <functionX</think>b",
    "r</think>c<tool_call>\n<function=f>",
    "é中</think>🙂",
]


@pytest.mark.parametrize("name", PARSERS)
@pytest.mark.parametrize(("text", "split"), VLLM_EXAMPLES)
def test_vllm_examples(name: str, text: str, split: tuple[str, str]) -> None:
    assert ReasoningParser.split(name, text) == split


def test_qwen3_ends_reasoning_at_a_function_call_as_vllm() -> None:
    """vLLM's Qwen3 parser: <tool_call> then <function=...> is an implicit end; a bare one is reasoning."""
    text = "think<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"
    assert ReasoningParser.split("qwen3", text) == ("think", text[len("think") :])
    assert ReasoningParser.split("deepseek_r1", text) == (text, "")
    assert ReasoningParser.split("qwen3", "I may use <tool_call> later") == (
        "I may use <tool_call> later",
        "",
    )


def stream(name: str, pieces: list[str], **kwargs: bool) -> tuple[str, str]:
    parser = ReasoningParser(name, **kwargs)
    parts = [parser.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize("name", PARSERS)
def test_every_two_and_three_way_cut_equals_the_one_shot_split(name: str) -> None:
    num_checked = 0
    for text in TEXTS + [t for t, _ in VLLM_EXAMPLES]:
        whole = ReasoningParser.split(name, text)
        for cut in range(len(text) + 1):
            assert stream(name, [text[:cut], text[cut:]]) == whole, (text, cut)
        for a, b in itertools.combinations(range(len(text) + 1), 2):
            assert stream(name, [text[:a], text[a:b], text[b:]]) == whole, (text, a, b)
            num_checked += 1
    assert num_checked > 1000


@pytest.mark.parametrize("name", PARSERS)
def test_random_texts_cut_into_random_deltas(name: str) -> None:
    rng = random.Random(0)
    fragments = [
        "<think>",
        "</think>",
        "<tool_call>",
        "<function=",
        " ",
        "\n",
        "<",
        "/",
        "a",
        "think>",
        "</th",
    ]
    for _ in range(2000):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 12)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert stream(name, pieces) == ReasoningParser.split(name, text), (text, pieces)


def test_one_character_deltas_hold_back_a_split_tag() -> None:
    parser = ReasoningParser("deepseek_r1")
    parts = [parser.feed(c) for c in "ab</think>cd"] + [parser.feed("", final=True)]
    assert parts[:2] == [("a", ""), ("b", "")]
    assert all(part == ("", "") for part in parts[2:9])  # "</think" held until its ">"
    assert parts[9:] == [("", ""), ("", "c"), ("", "d"), ("", "")]


def test_a_prompt_that_closed_the_think_block_gives_content_only() -> None:
    """Qwen3's template with enable_thinking false ends the prompt with an empty think block."""
    assert prompt_ends_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_ends_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_ends_reasoning("<|im_start|>assistant\n")
    for name in PARSERS:
        assert stream(name, ["An", "swer</think>"], prompt_ends_reasoning=True) == ("", "Answer</think>")


def test_the_option_is_checked_by_name() -> None:
    with pytest.raises(ValueError, match="reasoning_parser: must be one of"):
        ModelConfig(reasoning_parser="deepseek")
    with pytest.raises(ValueError, match="reasoning_parser"):
        ReasoningParser("granite")
