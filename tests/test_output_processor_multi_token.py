"""The output processor takes a step's run of several tokens (accepted drafts): a stop string completed
in the middle of the run ends the request there, and the tokens after it are dropped. A tool-call parser
that raises ends its own request with an error and loses nothing else: the other requests keep their text,
the failed request leaves no state behind, and where the core still holds it (a stop string ended it on
the frontend's side) its id goes back for the core to abort."""

from __future__ import annotations

import pytest
from tokenizer_fixtures import build_byte_level_bpe
from tool_schemas import forecast_tool

from sluice.engine.frontend.output_processor import OutputProcessor
from sluice.engine.messages import AddRequest, CoreOutput
from sluice.engine.outputs import Logprobs, OutputLogprobs, TokenLogprob
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.tool_calls import ToolUse
from sluice.engine.text.tokenizer import Tokenizer

TEXT = "Hello world, stop here please and more text"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_byte_level_bpe(tmp_path_factory.mktemp("bpe")))


def _core_output(ids: list[int], finish_reason: str | None = None, request_id: str = "r") -> CoreOutput:
    logprobs = OutputLogprobs(ids, [-1.0] * len(ids), 1, [i + 1 for i in ids], [-2.0] * len(ids))
    return CoreOutput(
        request_id,
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


@pytest.mark.parametrize("finish_reason", ["abort", "error"])
def test_a_stop_string_the_final_flush_would_complete_ends_no_aborted_or_failed_output(
    tokenizer: Tokenizer, finish_reason: str
) -> None:
    """An output ending mid-character is aborted (or fails): the held byte comes out as U+FFFD, which
    would complete the stop string "\ufffd"; the output stays aborted (it came back as finished by the
    stop string, "stop")."""
    ids = [*tokenizer.encode("Hello", add_special_tokens=False)]
    partial = tokenizer.encode("\U0001f600", add_special_tokens=False)[0]
    processor = OutputProcessor(tokenizer)
    processor.add_request(AddRequest("r", [1, 2, 3], SamplingParams(stop=("\ufffd",), max_tokens=20), 0.0))
    (first,) = processor.process([_core_output([*ids, partial])]).outputs
    (output,) = processor.process([_core_output([], finish_reason=finish_reason)]).outputs
    assert (output.finish_reason, output.stop_reason) == (finish_reason, None)
    assert first.text + output.text == "Hello\ufffd"


@pytest.mark.parametrize("ended_by", ["the core", "a stop string"])
def test_a_tool_parser_that_raises_fails_its_request_alone(tokenizer, monkeypatch, ended_by) -> None:
    def parse(self: ToolUse, text: str) -> tuple:
        raise RuntimeError("a parser bug")

    monkeypatch.setattr(ToolUse, "parse", parse)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stop = ("stop here",) if ended_by == "a stop string" else ()
    processor = OutputProcessor(tokenizer)
    tools = SamplingParams(max_tokens=100, stop=stop)
    processor.add_request(AddRequest("tools", [1, 2, 3], tools, 0.0), ToolUse((forecast_tool(8),)))
    processor.add_request(AddRequest("plain", [1, 2, 3], SamplingParams(max_tokens=100), 0.0))

    first = processor.process(
        [_core_output(ids[:2], request_id="tools"), _core_output(ids[:2], request_id="plain")]
    )
    assert [out.finish_reason for out in first.outputs] == [None, None]  # not parsed before the end

    core_finish = "length" if ended_by == "the core" else None
    last = processor.process(
        [
            _core_output(ids[2:], core_finish, request_id="tools"),
            _core_output(ids[2:], "length", request_id="plain"),
        ]
    )
    failed, plain = last.outputs
    assert failed.request_id == "tools" and failed.finish_reason == "error"
    assert failed.error == "tool call parsing failed: a parser bug"
    assert (failed.tool_calls, failed.content, failed.stop_reason) == ((), "", None)
    assert first.outputs[0].text + failed.text == (TEXT if not stop else "Hello world, ")
    assert plain.finish_reason == "length" and first.outputs[1].text + plain.text == TEXT
    assert processor.num_live_samples == 0 and processor.owner("tools") is None
    assert last.to_abort == ([] if ended_by == "the core" else ["tools"])
