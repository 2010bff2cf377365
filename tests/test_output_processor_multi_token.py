"""The output processor takes a step's run of several tokens (accepted drafts): a stop string completed
in the middle of the run ends the request there, and the tokens after it are dropped."""

from __future__ import annotations

import pytest
from tokenizer_fixtures import build_byte_level_bpe

from sluice.engine.frontend.output_processor import OutputProcessor
from sluice.engine.messages import AddRequest, CoreOutput
from sluice.engine.outputs import Logprobs, OutputLogprobs, TokenLogprob
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.text.tokenizer import Tokenizer

TEXT = "Hello world, stop here please and more text"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_byte_level_bpe(tmp_path_factory.mktemp("bpe")))


def _core_output(ids: list[int], finish_reason: str | None = None) -> CoreOutput:
    logprobs = OutputLogprobs(ids, [-1.0] * len(ids), 1, [i + 1 for i in ids], [-2.0] * len(ids))
    return CoreOutput(
        "r",
        ids,
        logprobs,
        0,
        0,
        None,
        None,
        finish_reason=finish_reason,
        num_draft_tokens=9,
        num_accepted_draft_tokens=4,
    )


def test_a_stop_string_inside_a_multi_token_advance_truncates_it(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    completes_stop = next(i for i in range(len(ids)) if "stop here" in tokenizer.decode(ids[: i + 1]))
    assert completes_stop + 2 < len(ids)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(stop=("stop here",), max_tokens=100)
    processor.add_request(AddRequest("r", [1, 2, 3], params, 0.0))
    first = processor.process([_core_output(ids[:2])]).outputs[0]
    processed = processor.process([_core_output(ids[2:])])
    (out,) = processed.outputs
    assert out.token_ids == tuple(ids[2 : completes_stop + 1])
    assert list(out.logprobs) == [
        Logprobs(TokenLogprob(i, -1.0), (TokenLogprob(i + 1, -2.0),)) for i in out.token_ids
    ]
    assert first.text + out.text == "Hello world, "
    assert out.finish_reason == "stop" and out.stop_reason == "stop here"
    assert out.usage.completion_tokens == completes_stop + 1
    assert (out.usage.draft_tokens, out.usage.accepted_draft_tokens) == (9, 4)
    assert processed.to_abort == ["r"]


def test_a_multi_token_advance_without_a_stop_keeps_every_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    processor.add_request(AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=100), 0.0))
    (out,) = processor.process([_core_output(ids, finish_reason="length")]).outputs
    assert out.token_ids == tuple(ids) and out.text == TEXT
    assert out.usage.completion_tokens == len(ids)


def test_a_stop_string_the_final_flush_completes_keeps_the_stop_token(tokenizer: Tokenizer) -> None:
    """An output ending mid-character, then EOS: the flush makes the held byte U+FFFD, which completes
    the stop string "\ufffd". The EOS that ended the output was dropped from token_ids and usage."""
    eos = tokenizer.eos_token_ids[0]
    ids = [
        *tokenizer.encode("Hello", add_special_tokens=False),
        tokenizer.encode("\U0001f600", add_special_tokens=False)[0],
        eos,
    ]
    processor = OutputProcessor(tokenizer)
    processor.add_request(AddRequest("r", [1, 2, 3], SamplingParams(stop=("\ufffd",), max_tokens=20), 0.0))
    core_output = _core_output(ids, finish_reason="stop")
    core_output.stop_reason = eos
    (output,) = processor.process([core_output]).outputs
    assert (output.text, output.stop_reason) == ("Hello", "\ufffd")
    assert list(output.token_ids) == ids
    assert output.usage.completion_tokens == len(ids)
