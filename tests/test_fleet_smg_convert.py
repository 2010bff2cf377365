"""sluice.service.smg_convert: SMG's vllm.grpc.engine messages to engine types and back (pure functions),
and the tokenizer bundle GetTokenizer serves, read back by transformers (for a Hugging Face directory
and for the embedded SmolLM2 GGUF, whose vocabulary the bundle exports as tokenizer.json)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
from checkpoints import copy_with_tool_use_template
from smg_grpc_proto import vllm_engine_pb2 as smg

from sluice.engine.errors import ContextLengthError, InvalidRequestError
from sluice.engine.loading.default_model import default_model_path
from sluice.engine.loading.gguf_file import GGUFFile
from sluice.engine.loading.gguf_tokenizer import gguf_tokenizer
from sluice.engine.model_info import ModelInfo
from sluice.engine.outputs import (
    NO_OUTPUT_LOGPROBS,
    NO_PROMPT_LOGPROBS,
    OutputLogprobs,
    PromptLogprobs,
    RequestOutput,
    Usage,
)
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint
from sluice.engine.text.tokenizer import Tokenizer
from sluice.service import smg_convert
from sluice.service.convert import PROMPT_LOGPROBS_PER_SLICE

INFO = ModelInfo(
    name="tiny",
    architecture="LlamaForCausalLM",
    max_model_len=64,
    vocab_size=512,
    eos_token_ids=(1,),
    block_size=16,
    num_kv_blocks=8,
)
TEXTS = ("Hello there!", "def f(x):\n    return x ** 2  # 0 1 42", "naïve café, 東京 ✓")


STRUCTURAL_TAG = '{"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}'


def _request(**sampling: object) -> smg.GenerateRequest:
    return smg.GenerateRequest(
        request_id="r",
        tokenized=smg.TokenizedInput(input_ids=[5, 6, 7, 8]),
        sampling_params=smg.SamplingParams(**sampling),
        stream=True,
    )


def test_proto3_defaults_read_as_vllm_reads_them() -> None:
    spec = smg_convert.generation_spec_from_smg(_request(), INFO, None)
    assert spec.prompt.token_ids == (5, 6, 7, 8)
    # temperature unset: 1; top_p 0 and repetition_penalty 0: off; n 0: 1; max_tokens: the rest;
    # skip_special_tokens as sent (false unset: only Sluice's stop-string matching reads it).
    assert spec.params == SamplingParams(temperature=1.0, max_tokens=60, skip_special_tokens=False)


def test_sampling_fields_map_one_to_one() -> None:
    request = _request(
        temperature=0.0,
        top_p=0.75,
        top_k=5,
        min_p=0.125,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.25,
        max_tokens=7,
        min_tokens=2,
        stop=["\n\n"],
        stop_token_ids=[3],
        ignore_eos=True,
        n=3,
        logprobs=2,
        prompt_logprobs=1,
        seed=11,
        logit_bias={9: 2.5},
        json_schema='{"type": "object"}',
        skip_special_tokens=True,
    )
    params = smg_convert.generation_spec_from_smg(request, INFO, None).params
    assert params == SamplingParams(
        temperature=0.0,
        top_p=0.75,
        top_k=5,
        min_p=0.125,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.25,
        max_tokens=7,
        min_tokens=2,
        stop=("\n\n",),
        stop_token_ids=(3,),
        ignore_eos=True,
        n=3,
        logprobs=2,
        prompt_logprobs=1,
        seed=11,
        logit_bias={9: 2.5},
        constraint=Constraint(json_schema='{"type": "object"}'),
    )


@pytest.mark.parametrize(
    ("constraint", "expected"),
    [
        ({"regex": "[0-9]+"}, Constraint(regex="[0-9]+")),
        ({"grammar": 'root ::= "a"'}, Constraint(grammar='root ::= "a"')),
        ({"choice": smg.ChoiceConstraint(choices=["yes", "no"])}, Constraint(choice=("yes", "no"))),
        ({"json_object": True}, Constraint(json_object=True)),
        ({"structural_tag": STRUCTURAL_TAG}, Constraint(structural_tag=STRUCTURAL_TAG)),
    ],
)
def test_constraints(constraint: dict, expected: Constraint) -> None:
    assert (
        smg_convert.generation_spec_from_smg(_request(**constraint), INFO, None).params.constraint == expected
    )


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (_request(truncate_prompt_tokens=0), "sampling_params.truncate_prompt_tokens"),
        (_request(max_tokens=61), "sampling_params.max_tokens"),
        (smg.GenerateRequest(tokenized=smg.TokenizedInput(input_ids=list(range(64)))), "tokenized.input_ids"),
        (smg.GenerateRequest(), "input"),
        (smg.GenerateRequest(tokenized=smg.TokenizedInput(input_ids=[])), "tokenized.input_ids"),
        (smg.GenerateRequest(text="hi"), "text"),  # no tokenizer to encode it with
        (smg.GenerateRequest(tokenized=smg.TokenizedInput(input_ids=[1]), mm_inputs={}), "mm_inputs"),
        # Each named as sent (both were named mm_inputs).
        (
            smg.GenerateRequest(
                tokenized=smg.TokenizedInput(input_ids=[1]), extra_mm_inputs=[smg.MultimodalInputs()]
            ),
            "extra_mm_inputs",
        ),
        (smg.GenerateRequest(tokenized=smg.TokenizedInput(input_ids=[1]), media_refs={}), "media_refs"),
        # Prefill/decode disaggregation and data parallelism, which this worker does not do (they were
        # ignored: no KV handed over, any rank accepted).
        (
            smg.GenerateRequest(tokenized=smg.TokenizedInput(input_ids=[1]), kv_transfer_params_json="{}"),
            "kv_transfer_params_json",
        ),
        (
            smg.GenerateRequest(tokenized=smg.TokenizedInput(input_ids=[1]), kv_transfer_params={}),
            "kv_transfer_params",
        ),
        (
            smg.GenerateRequest(tokenized=smg.TokenizedInput(input_ids=[1]), data_parallel_rank=5),
            "data_parallel_rank",
        ),
    ],
)
def test_what_sluice_cannot_do_is_invalid_argument_naming_the_field(request_, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        smg_convert.generation_spec_from_smg(request_, INFO, None)
    assert info.value.field == field


class _OneTokenAWord:
    def encode(self, text: str, context: int | None = None) -> list[int]:
        return [7] * len(text.split())


def test_a_refusal_names_the_field_as_smgs_request_spells_it() -> None:
    """A text prompt was blamed on tokenized.input_ids, which the caller never sent, and a structural tag's
    inner paths lost their sampling_params. prefix."""
    long_text = smg.GenerateRequest(text="word " * 64)
    with pytest.raises(InvalidRequestError) as info:
        smg_convert.generation_spec_from_smg(long_text, INFO, _OneTokenAWord())
    assert info.value.field == "text"
    engine_refusal = ContextLengthError("prompt", "its 60 tokens and one generated need 5 KV blocks")
    assert smg_convert.smg_refusal(engine_refusal, "text").field == "text"
    assert smg_convert.smg_refusal(engine_refusal).field == "tokenized.input_ids"
    inner = InvalidRequestError("structural_tag.structures[0]", "must be an object with begin, schema, end")
    assert smg_convert.smg_refusal(inner).field == "sampling_params.structural_tag.structures[0]"


def test_unset_max_tokens_is_what_the_context_and_the_kv_cache_leave() -> None:
    """A KV cache smaller than the context (Sluice starts where vLLM would refuse) refused every request
    that left max_tokens unset, naming max_tokens; min_tokens past that default was refused too."""
    small = dataclasses.replace(INFO, num_kv_blocks=2)  # 32 tokens of KV, context 64
    assert smg_convert.generation_spec_from_smg(_request(), small, None).params.max_tokens == 28
    # What one request can hold, as the engine reports it (a window, the step budget without chunking).
    held = dataclasses.replace(INFO, num_kv_blocks=2, max_request_tokens=40)
    assert smg_convert.generation_spec_from_smg(_request(), held, None).params.max_tokens == 36
    assert smg_convert.generation_spec_from_smg(_request(), INFO, None).params.max_tokens == 60
    params = smg_convert.generation_spec_from_smg(_request(min_tokens=61), INFO, None).params
    assert (params.max_tokens, params.min_tokens) == (60, 60)
    with pytest.raises(ValueError, match=r"^min_tokens: must be in \[0, max_tokens\]"):  # given: checked
        smg_convert.generation_spec_from_smg(_request(min_tokens=9, max_tokens=8), INFO, None)


def test_a_bad_value_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="^top_p: must be in"):
        smg_convert.generation_spec_from_smg(_request(top_p=1.5), INFO, None)


def _output(
    tokens,
    index=0,
    finish=None,
    logprobs=NO_OUTPUT_LOGPROBS,
    prompt_logprobs=NO_PROMPT_LOGPROBS,
    stop_reason=None,
) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        token_ids=tuple(tokens),
        text="",
        logprobs=logprobs,
        finish_reason=finish,
        stop_reason=stop_reason,
        usage=Usage(prompt_tokens=4, completion_tokens=0, cached_tokens=2),
        index=index,
        prompt_logprobs=prompt_logprobs,
    )


def _sent(responses: smg_convert.SmgResponses, *outputs: RequestOutput) -> list[smg.GenerateResponse]:
    async def collect() -> list[smg.GenerateResponse]:
        return [response for output in outputs async for response in responses.responses(output)]

    return asyncio.run(collect())


def _lp(token_id: int, logprob: float, *top: tuple[int, float]) -> OutputLogprobs:
    """One sampled token's logprobs, with its top."""
    return OutputLogprobs([token_id], [logprob], len(top), [t for t, _ in top], [v for _, v in top])


def test_streaming_sends_token_deltas_then_one_complete_per_sample() -> None:
    spec = smg_convert.generation_spec_from_smg(_request(n=2, max_tokens=3), INFO, None)
    responses = smg_convert.SmgResponses(spec, stream=True)
    sent = _sent(
        responses,
        _output([10]),
        _output([20], index=1),
        _output([11, 12], finish="length"),
        _output([], index=1, finish="stop", stop_reason=1),
    )
    kinds = [r.WhichOneof("response") for r in sent]
    assert kinds == ["chunk", "chunk", "chunk", "complete", "complete"]
    assert [list(r.chunk.token_ids) for r in sent[:3]] == [[10], [20], [11, 12]]
    assert [r.chunk.index for r in sent[:3]] == [0, 1, 0]
    first, second = sent[3].complete, sent[4].complete
    assert (first.index, first.finish_reason, first.completion_tokens) == (0, "length", 3)
    assert list(first.output_ids) == [11, 12]  # the last delta, as vLLM sends it
    assert (first.prompt_tokens, first.cached_tokens) == (4, 2)
    assert (second.index, second.finish_reason, second.completion_tokens) == (1, "stop", 1)
    assert second.matched_token_id == 1


def test_not_streaming_sends_one_complete_with_every_token_and_logprob() -> None:
    spec = smg_convert.generation_spec_from_smg(
        _request(max_tokens=2, logprobs=1, prompt_logprobs=1), INFO, None
    )
    responses = smg_convert.SmgResponses(spec, stream=False)
    prompt_lps = PromptLogprobs([6, 7, 8], [-1.0, -2.0, -3.0], 1, [6, 9, 8], [-1.0, -0.5, -3.0])
    sent = _sent(
        responses,
        _output([10], logprobs=_lp(10, -0.1, (10, -0.1)), prompt_logprobs=prompt_lps),
        _output([11], finish="stop", logprobs=_lp(11, -0.2, (11, -0.2)), stop_reason="\n"),
    )
    (response,) = sent
    complete = response.complete
    assert list(complete.output_ids) == [10, 11] and complete.completion_tokens == 2
    assert complete.matched_stop_str == "\n"
    assert list(complete.output_logprobs.token_ids) == [10, 11]
    assert list(complete.output_logprobs.token_logprobs) == pytest.approx([-0.1, -0.2])
    assert [list(t.token_ids) for t in complete.output_logprobs.top_logprobs] == [[10], [11]]
    prompt = complete.input_logprobs
    assert list(prompt.token_ids) == [5, 6, 7, 8]
    assert [v.HasField("value") for v in prompt.token_logprobs] == [False, True, True, True]
    assert [v.value for v in prompt.token_logprobs[1:]] == pytest.approx([-1.0, -2.0, -3.0])
    assert [list(t.token_ids) for t in prompt.top_logprobs] == [[], [6], [9], [8]]


def test_not_streaming_sends_the_samples_completes_together_in_sample_order() -> None:
    """SMG numbers non-streamed choices by the order their completes arrive, not by `index`: each went out
    as its sample finished, and choice i was not sample i (seed + i) when a later sample ended first."""
    spec = smg_convert.generation_spec_from_smg(_request(n=3, max_tokens=2), INFO, None)
    responses = smg_convert.SmgResponses(spec, stream=False)
    assert _sent(responses, _output([30, 1], index=2, finish="stop", stop_reason=1)) == []
    assert _sent(responses, _output([10, 11], finish="length")) == []
    sent = _sent(responses, _output([20, 21], index=1, finish="length"))
    assert [(r.complete.index, list(r.complete.output_ids)) for r in sent] == [
        (0, [10, 11]),
        (1, [20, 21]),
        (2, [30, 1]),
    ]


def test_streaming_sends_a_long_prompts_logprobs_whole_in_the_first_chunk_in_slices(monkeypatch) -> None:
    n = 2 * PROMPT_LOGPROBS_PER_SLICE + 3
    request = _request(max_tokens=2, prompt_logprobs=2)
    request.tokenized.input_ids[:] = range(n + 1)
    spec = smg_convert.generation_spec_from_smg(request, dataclasses.replace(INFO, max_model_len=n + 8), None)
    responses = smg_convert.SmgResponses(spec, stream=True)
    values = PromptLogprobs(
        [*range(1, n + 1)], [-(i % 64) / 8 for i in range(n)], 2, [*range(2 * n)], [-0.5] * (2 * n)
    )
    slices: list[tuple[int, int]] = []
    add_slice = smg_convert.add_input_logprobs

    def recorded(message: smg.InputLogProbs, values: PromptLogprobs, start: int, end: int) -> None:
        slices.append((start, end))
        add_slice(message, values, start, end)

    monkeypatch.setattr(smg_convert, "add_input_logprobs", recorded)
    sent = _sent(responses, _output([10], prompt_logprobs=values), _output([11], finish="length"))
    first, second = sent[:2]  # the two chunks; then the complete
    prompt = first.chunk.input_logprobs
    step = PROMPT_LOGPROBS_PER_SLICE
    assert slices == [(0, step), (step, 2 * step), (2 * step, n)]
    assert list(prompt.token_ids) == [*range(n + 1)]
    assert [v.value for v in prompt.token_logprobs[1:]] == values.logprobs
    assert [list(t.token_ids) for t in prompt.top_logprobs[1:]] == [[2 * i, 2 * i + 1] for i in range(n)]
    assert not second.chunk.HasField("input_logprobs")


def test_streaming_sends_the_prompts_logprobs_in_every_samples_first_chunk() -> None:
    """As vLLM's servicer: SMG builds each choice from its own chunks (only sample 0's carried them)."""
    spec = smg_convert.generation_spec_from_smg(_request(n=2, max_tokens=2, prompt_logprobs=1), INFO, None)
    responses = smg_convert.SmgResponses(spec, stream=True)
    prompt_lps = PromptLogprobs([6, 7, 8], [-1.0, -2.0, -3.0], 1, [6, 9, 8], [-1.0, -0.5, -3.0])
    sent = _sent(
        responses,
        _output([10], prompt_logprobs=prompt_lps),
        _output([20], index=1),
        _output([11], finish="length"),
        _output([21], index=1, finish="length"),
    )
    chunks = [r.chunk for r in sent if r.WhichOneof("response") == "chunk"]
    assert [(c.index, list(c.token_ids)) for c in chunks] == [(0, [10]), (1, [20]), (0, [11]), (1, [21])]
    assert [list(c.input_logprobs.token_ids) for c in chunks] == [[5, 6, 7, 8], [5, 6, 7, 8], [], []]
    assert chunks[0].input_logprobs == chunks[1].input_logprobs


def test_loads_and_model_info() -> None:
    from sluice.engine.outputs import EngineStats

    stats = EngineStats(
        3, 2, 8, 4, 0, 0, 0, prefix_cache_queries=10, prefix_cache_hits=4, num_waiting_tokens=37
    )
    (load,) = smg_convert.loads_to_smg(stats, INFO, "now", "0.1.0", gen_throughput=12.5).loads
    assert (load.num_waiting_uncached_tokens, load.gen_throughput) == (37, 12.5)
    assert (load.num_running_reqs, load.num_waiting_reqs, load.num_total_reqs) == (3, 2, 5)
    assert load.token_usage == 0.5 and load.num_used_tokens == 64 and load.max_total_num_tokens == 128
    assert load.cache_hit_rate == pytest.approx(0.4)
    info = smg_convert.model_info_to_smg(INFO, None)
    assert (info.served_model_name, info.max_context_length, list(info.eos_token_ids)) == ("tiny", 64, [1])
    assert (info.model_type, list(info.architectures), info.tokenizer_path) == (
        "llama",
        ["LlamaForCausalLM"],
        "",
    )
    assert smg_convert.model_type("Gemma3ForCausalLM") == "gemma3_text"


@pytest.mark.parametrize(
    ("liveness", "silence_ms", "pending"),
    [(None, None, None), ((None, 0), None, 0), ((2.5, 37), 2500, 37), ((1e9, 2**40), 2**32 - 1, 2**32 - 1)],
)
def test_load_records_carry_the_engines_silence_and_prefill_in_hand(liveness, silence_ms, pending) -> None:
    """Set from the frontend's EngineLiveness: the silence only while requests are live (absent is not
    0), both held to the uint32 fields' range."""
    from sluice.engine.frontend.async_engine import EngineLiveness
    from sluice.engine.outputs import EngineStats
    from sluice.service import smg_kv_events

    stats = EngineStats(1, 0, 8, 1, 0, 0, 0)
    given = None if liveness is None else EngineLiveness(*liveness)
    load = smg_kv_events.engine_load(stats, INFO, 1, False, 0.0, given)
    assert load.HasField("engine_reports_steps") == (liveness is not None)
    assert (load.engine_silence_ms if load.HasField("engine_silence_ms") else None) == silence_ms
    assert (load.prefill_pending_tokens if load.HasField("prefill_pending_tokens") else None) == pending


def _bundle_dir(tokenizer: Tokenizer, info: ModelInfo, directory: Path) -> Path:
    for name, text in smg_convert.bundle_files(tokenizer, info).items():
        (directory / name).write_text(text)
    return directory


def _check_against_transformers(ours: Tokenizer, directory: Path) -> None:
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(directory))
    for text in TEXTS:
        assert theirs.encode(text) == ours.encode(text), text
        assert theirs.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[0]}]
    rendered = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == ours.apply_chat_template(messages)
    assert theirs.eos_token == ours.eos_token
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(ours.eos_token_ids)


def test_the_bundle_of_a_hugging_face_directory_loads_in_transformers(llama_dir: str, tmp_path: Path) -> None:
    ours = Tokenizer.from_pretrained(llama_dir)
    info = INFO
    _check_against_transformers(ours, _bundle_dir(ours, info, tmp_path))


def test_a_tool_use_template_goes_into_the_bundles_one_template(llama_dir: str, tmp_path: Path) -> None:
    """SMG reads one chat template (a string): with a "tool_use" one beside the default, the bundle's
    renders a conversation with tools as transformers renders it by "tool_use", and one without by the
    default, character for character."""
    from transformers import AutoTokenizer

    model = copy_with_tool_use_template(llama_dir, tmp_path / "model")
    ours = Tokenizer.from_pretrained(model)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    _bundle_dir(ours, INFO, bundle)
    original, bundled = AutoTokenizer.from_pretrained(str(model)), AutoTokenizer.from_pretrained(str(bundle))
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for given in (tools, None):
        expected = original.apply_chat_template(
            messages, tools=given, add_generation_prompt=True, tokenize=False
        )
        rendered = bundled.apply_chat_template(
            messages, tools=given, add_generation_prompt=True, tokenize=False
        )
        assert rendered == expected
        assert ("TOOLS: get_weather;" in expected) == (given is not None)
    assert expected == ours.apply_chat_template(messages)


def test_the_bundle_exports_a_gguf_vocabulary_as_tokenizer_json(tmp_path: Path) -> None:
    ours = gguf_tokenizer(GGUFFile(default_model_path()))
    assert ours.chat_template is not None
    info = ModelInfo("smollm2", "LlamaForCausalLM", 8192, ours.vocab_size, ours.eos_token_ids, 16, 8)
    directory = _bundle_dir(ours, info, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    assert (config["model_type"], config["max_position_embeddings"]) == ("llama", 8192)
    _check_against_transformers(ours, directory)


def test_the_generation_rate_is_measured_over_the_last_seconds() -> None:
    rate = smg_convert.GenerationRate()
    assert rate(0, 0.0) == 0.0
    assert rate(10, 0.1) == 0.0  # too short a span to measure
    assert rate(100, 1.0) == pytest.approx(100.0)
    assert rate(400, 3.0) == pytest.approx(400 / 3)
    assert rate(600, 7.0) == pytest.approx(500 / 6)  # since the last sample at least 5 s old: (1.0, 100)
    assert rate(600, 20.0) == 0.0  # idle since


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens_before_the_context_checks() -> None:
    spec = smg_convert.generation_spec_from_smg(_request(truncate_prompt_tokens=2), INFO, None)
    assert spec.prompt.token_ids == (7, 8)
    assert spec.params.max_tokens == INFO.max_model_len - 2  # unset: the rest of the context after them
    whole = smg_convert.generation_spec_from_smg(_request(truncate_prompt_tokens=-1), INFO, None)
    assert whole.prompt.token_ids == (5, 6, 7, 8)
    included = _request(include_stop_str_in_output=True, stop=["x"])
    assert smg_convert.generation_spec_from_smg(included, INFO, None).params.include_stop_str_in_output


@pytest.mark.parametrize("early", [False, True])
async def test_a_stream_waits_for_its_first_batch_without_spinning(monkeypatch, early: bool) -> None:
    """Heartbeats due at once (LOAD_HEARTBEAT_S 0): a subscriber that did not ask for records before the
    first batch is not woken until there is one (its stream polled the engine's load in a loop)."""
    from sluice.engine.frontend.kv_event_log import KVEventLog
    from sluice.engine.kv_cache.kv_events import BlocksRemoved
    from sluice.engine.outputs import EngineStats
    from sluice.service import smg_kv_events

    monkeypatch.setattr(smg_kv_events, "LOAD_HEARTBEAT_S", 0.0)
    log, num_reads = KVEventLog(), 0

    def stats() -> EngineStats:
        nonlocal num_reads
        num_reads += 1
        return EngineStats(0, 0, 8, 0, 0, 0, 0)

    batches = smg_kv_events.smg_batches(log.subscribe(0), 0, stats, INFO, lambda _: 0.0, early)
    reader = asyncio.ensure_future(anext(batches))
    for _ in range(100):
        await asyncio.sleep(0)
    if early:  # a record numbered 0 at once
        assert reader.done() and (await reader).load.load_only and num_reads == 1
        return
    assert not reader.done() and num_reads == 0
    log.publish([BlocksRemoved([5])])
    assert (await reader).sequence_number == 1 and num_reads == 1
