"""A tool-call parser that raises ends its own request with an error and loses nothing else: the output
processor's other requests keep their text, the failed request leaves no state behind, and where the core
still holds it (a stop string ended it on the frontend's side) its id goes back for the core to abort."""

from __future__ import annotations

import pytest
from tokenizer_fixtures import build_byte_level_bpe
from tool_schemas import forecast_tool

from sluice.engine.frontend.output_processor import OutputProcessor
from sluice.engine.messages import AddRequest, CoreOutput
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.tool_calls import ToolUse
from sluice.engine.text.tokenizer import Tokenizer

TEXT = "Hello world, stop here please and more text"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_byte_level_bpe(tmp_path_factory.mktemp("bpe")))


def _core_output(request_id: str, ids: list[int], finish_reason: str | None = None) -> CoreOutput:
    return CoreOutput(request_id, ids, None, 0, 0, None, None, finish_reason=finish_reason)


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

    first = processor.process([_core_output("tools", ids[:2]), _core_output("plain", ids[:2])])
    assert [out.finish_reason for out in first.outputs] == [None, None]  # not parsed before the end

    core_finish = "length" if ended_by == "the core" else None
    last = processor.process(
        [_core_output("tools", ids[2:], core_finish), _core_output("plain", ids[2:], "length")]
    )
    failed, plain = last.outputs
    assert failed.request_id == "tools" and failed.finish_reason == "error"
    assert failed.error == "tool call parsing failed: a parser bug"
    assert (failed.tool_calls, failed.content, failed.stop_reason) == ((), "", None)
    assert first.outputs[0].text + failed.text == (TEXT if not stop else "Hello world, ")
    assert plain.finish_reason == "length" and first.outputs[1].text + plain.text == TEXT
    assert processor.num_live_samples == 0 and processor.owner("tools") is None
    assert last.to_abort == ([] if ended_by == "the core" else ["tools"])
