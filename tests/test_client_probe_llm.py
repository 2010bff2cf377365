"""The offline `LLM.generate` given vLLM's prompt dicts: TextPrompt {"prompt": text} and TokensPrompt
{"prompt_token_ids": ids}, alone or in a list, are the prompts they hold; any other dict is refused
naming the prompt, before a request is queued."""

from __future__ import annotations

import pytest

from sluice import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir: str) -> LLM:
    return LLM(llama_dir, attention_backend="torch", num_blocks=64)


def test_vllm_prompt_dicts_are_the_prompts_they_hold(llm: LLM) -> None:
    """A dict, alone or in a list, was read as token ids: KeyError 0, or "token_ids: must be integers"."""
    expected = [c.token_ids for c in llm.generate(["Hello", [5, 6, 7]], GREEDY)]
    dicts = [{"prompt": "Hello"}, {"prompt_token_ids": [5, 6, 7]}]
    assert [c.token_ids for c in llm.generate(dicts, GREEDY)] == expected
    assert [llm.generate(d, GREEDY)[0].token_ids for d in dicts] == expected


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        (
            {"text": "Hello"},
            r"^prompts\[0\]: a prompt dict holds one of \('prompt', 'prompt_token_ids'\), "
            r"got keys \['text'\]$",
        ),
        (
            ["Hello", {"prompt": "a", "multi_modal_data": {}}],
            r"^prompts\[1\]: a prompt dict holds one of .*got keys \['prompt', 'multi_modal_data'\]$",
        ),
        ([{"prompt": [5, 6]}], r"^prompts\[0\]: 'prompt' takes text$"),
        ([{"prompt_token_ids": "Hello"}], r"^prompts\[0\]: 'prompt_token_ids' takes token ids$"),
    ],
    ids=["unknown key", "extra key", "ids as prompt", "text as ids"],
)
def test_other_prompt_dicts_are_refused_naming_the_prompt(llm: LLM, prompts: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY)
    assert not llm.engine.has_unfinished_requests()
