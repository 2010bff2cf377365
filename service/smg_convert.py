"""Pure conversions between SMG's `vllm.grpc.engine` messages (PyPI smg-grpc-proto) and engine types.
No I/O, no grpc calls.

SMG (Shepherd Model Gateway) speaks to a worker in token ids: it applies the chat template, tokenizes,
parses tool calls and reasoning, and detokenizes itself; the worker takes `tokenized.input_ids` and
sampling parameters and streams token ids back. Streaming (`stream`): one GenerateStreamChunk per
engine output (the new token ids, "delta" semantics) and, per sample, a GenerateComplete after its
last chunk with the finish reason and the usage. Not streaming: one GenerateComplete per sample with
all its token ids.
"""

from __future__ import annotations

import functools
import json
import re
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from smg_grpc_proto import vllm_engine_pb2 as smg

from sluice.engine.errors import ContextLengthError, InvalidRequestError
from sluice.engine.model_info import ModelInfo
from sluice.engine.outputs import (
    NO_PROMPT_LOGPROBS,
    EngineStats,
    OutputLogprobs,
    PromptLogprobs,
    RequestOutput,
)
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint
from sluice.engine.text.tokenizer import TOOL_USE_TEMPLATE, Tokenizer
from sluice.service.convert import in_slices
from sluice.service.generation_spec import GenerationSpec, Prompt

# What GetServerInfo calls this server; SMG files it away as a label.
SERVER_TYPE = "sluice-grpc"


# The fields the checks shared with sluice.v1 name as Sluice does, and SMG's GenerateRequest otherwise.
_SMG_PROMPT_FIELDS = ("prompt", "token_ids")
_SMG_SAMPLING_FIELDS = frozenset(smg.SamplingParams.DESCRIPTOR.fields_by_name)


def smg_refusal(exc: ValueError, prompt_field: str = "tokenized.input_ids") -> ValueError:
    """A refused request (`exc`: "field: message", from SamplingParams, the prompt checks or the engine)
    as INVALID_ARGUMENT naming the field as SMG's GenerateRequest does (`sampling_params.top_p`,
    `sampling_params.structural_tag.format...`, the prompt as `prompt_field`: `tokenized.input_ids` or
    `text`, whichever the request sent). A ContextLengthError becomes INVALID_ARGUMENT too, vLLM's 400:
    SMG would retry a RESOURCE_EXHAUSTED. A message that names no field is kept."""
    field, sep, message = str(exc).partition(": ")
    if not sep or " " in field:
        return exc
    if field in _SMG_PROMPT_FIELDS:
        field = prompt_field
    elif re.split(r"[.\[]", field, maxsplit=1)[0] in _SMG_SAMPLING_FIELDS:
        field = f"sampling_params.{field}"
    return InvalidRequestError(field, message)


def smg_prompt_field(request: smg.GenerateRequest) -> str:
    """The field a request's prompt came in: `text`, or `tokenized.input_ids`."""
    return "text" if request.WhichOneof("input") == "text" else "tokenized.input_ids"


def generation_spec_from_smg(
    request: smg.GenerateRequest, model_info: ModelInfo, tokenizer: Tokenizer | None
) -> GenerationSpec:
    """Raises InvalidRequestError naming a bad field. A prompt given as text is tokenized here (SMG
    always sends token ids), so the rest of the context is known: it is `max_tokens` when unset, as in
    vLLM, and a prompt with `max_tokens` past the context is INVALID_ARGUMENT (vLLM's 400), not
    RESOURCE_EXHAUSTED, which SMG would retry. `truncate_prompt_tokens` keeps the prompt's last tokens
    before any of that."""
    context = None if request.sampling_params.HasField("truncate_prompt_tokens") else model_info.max_model_len
    token_ids = truncated(prompt_token_ids(request, tokenizer, context), request.sampling_params, model_info)
    num_free = model_info.max_model_len - len(token_ids)
    if num_free < 1:
        raise InvalidRequestError(
            smg_prompt_field(request),
            f"the prompt has {len(token_ids)} tokens; the model's context is {model_info.max_model_len}",
        )
    # Unset max_tokens: the rest of the context, but no more than one request can hold after the prompt
    # (the KV cache, as a window reaches it; the step budget with chunked prefill off): vLLM refuses to
    # start where it could not; Sluice starts, and would refuse every such request.
    most = model_info.max_request_tokens or model_info.kv_capacity_tokens
    room = most - len(token_ids)
    default_max_tokens = min(num_free, room) if room > 0 else num_free
    params = sampling_params_from_smg(request.sampling_params, default_max_tokens=default_max_tokens)
    if params.max_tokens > num_free:
        raise InvalidRequestError(
            "sampling_params.max_tokens",
            f"{params.max_tokens} tokens after a {len(token_ids)}-token prompt exceed the model's "
            f"context of {model_info.max_model_len}",
        )
    return GenerationSpec(prompt=Prompt(token_ids=token_ids), params=params)


def truncated(token_ids: tuple[int, ...], message: smg.SamplingParams, info: ModelInfo) -> tuple[int, ...]:
    """The prompt's last `truncate_prompt_tokens` tokens (-1: the model's context), as vLLM keeps them."""
    if not message.HasField("truncate_prompt_tokens"):
        return token_ids
    keep = message.truncate_prompt_tokens
    if keep != -1 and keep < 1:
        raise InvalidRequestError(
            "sampling_params.truncate_prompt_tokens", f"must be -1 (the model's context) or >= 1, got {keep}"
        )
    keep = info.max_model_len if keep == -1 else keep
    return token_ids[-keep:]


def prompt_token_ids(
    request: smg.GenerateRequest, tokenizer: Tokenizer | None, context: int | None = None
) -> tuple[int, ...]:
    """The prompt's token ids: `tokenized.input_ids`, or `text` encoded with the model's tokenizer (past
    `context`, when given, refused from a prefix: `Tokenizer.encode`)."""
    for media, given in (
        ("mm_inputs", request.HasField("mm_inputs")),
        ("extra_mm_inputs", bool(request.extra_mm_inputs)),
        ("media_refs", request.HasField("media_refs")),
    ):
        if given:
            raise InvalidRequestError(media, "this server serves text models only")
    for transfer in ("kv_transfer_params", "kv_transfer_params_json"):
        if request.HasField(transfer):
            raise InvalidRequestError(transfer, "prefill/decode disaggregation is not supported by Sluice")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidRequestError("data_parallel_rank", "this worker has one data-parallel rank, 0")
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        if not request.tokenized.input_ids:
            raise InvalidRequestError("tokenized.input_ids", "must not be empty")
        return tuple(request.tokenized.input_ids)
    if kind == "text" and request.text:
        if tokenizer is None:
            raise InvalidRequestError("text", "this model has no tokenizer: send tokenized.input_ids")
        try:
            return tuple(tokenizer.encode(request.text, context=context))
        except ContextLengthError as exc:  # INVALID_ARGUMENT, as the context check below
            raise smg_refusal(exc, "text") from None
    raise InvalidRequestError("input", "is empty: give tokenized.input_ids or text")


def sampling_params_from_smg(message: smg.SamplingParams, *, default_max_tokens: int) -> SamplingParams:
    """vLLM's reading of the proto3 defaults: an unset `temperature` is 1, `top_p` 0 and
    `repetition_penalty` 0 mean off (1), `n` 0 is 1, `top_k` 0 and `min_p` 0 are off.
    (`truncate_prompt_tokens` is applied to the prompt by `generation_spec_from_smg`.)"""
    return SamplingParams(
        temperature=message.temperature if message.HasField("temperature") else 1.0,
        top_k=message.top_k,
        top_p=message.top_p or 1.0,
        min_p=message.min_p,
        repetition_penalty=message.repetition_penalty or 1.0,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        seed=message.seed if message.HasField("seed") else None,
        max_tokens=message.max_tokens if message.HasField("max_tokens") else default_max_tokens,
        # With max_tokens unset, vLLM holds min_tokens to nothing but the length limit.
        min_tokens=message.min_tokens
        if message.HasField("max_tokens")
        else min(message.min_tokens, default_max_tokens),
        stop=tuple(message.stop),
        include_stop_str_in_output=message.include_stop_str_in_output,
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs if message.HasField("logprobs") else None,
        skip_special_tokens=message.skip_special_tokens,
        logit_bias=dict(message.logit_bias),
        constraint=constraint_from_smg(message),
        n=message.n or 1,
        prompt_logprobs=message.prompt_logprobs if message.HasField("prompt_logprobs") else None,
    )


def constraint_from_smg(message: smg.SamplingParams) -> Constraint | None:
    """Maps the `constraint` oneof (json_object: any JSON object); unset is None."""
    kind = message.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        return Constraint(choice=tuple(message.choice.choices))
    if kind == "json_object":
        return Constraint(json_object=True) if message.json_object else None
    return Constraint(**{kind: getattr(message, kind)})


def add_output_logprobs(message: smg.OutputLogProbs, values: OutputLogprobs) -> None:
    """Appends the sampled tokens' logprobs to `message`, and the top `values.num_top` at each position
    when the request asked for any (its `logprobs`), straight from the columns."""
    message.token_logprobs.extend(values.logprobs)
    message.token_ids.extend(values.token_ids)
    num_top = values.num_top
    if num_top:
        add_top = message.top_logprobs.add
        for start in range(0, len(values.top_token_ids), num_top):
            top = slice(start, start + num_top)
            add_top(values=values.top_logprobs[top], token_ids=values.top_token_ids[top])


def add_input_logprobs(message: smg.InputLogProbs, values: PromptLogprobs, start: int, end: int) -> None:
    """Appends entries [start, end) of the prompt's logprobs to `message`, after `input_logprobs_head`."""
    add_value, add_top = message.token_logprobs.add, message.top_logprobs.add
    num_top = values.num_top
    for position in range(start, end):
        add_value(value=values.logprobs[position])
        if num_top:
            top = slice(position * num_top, (position + 1) * num_top)
            add_top(values=values.top_logprobs[top], token_ids=values.top_token_ids[top])


def input_logprobs_head(
    message: smg.InputLogProbs, values: PromptLogprobs, prompt_token_ids: Sequence[int]
) -> None:
    """The prompt's tokens that have logprobs, and the first token's entries: no value set (it has none)."""
    message.token_ids.extend(prompt_token_ids[: len(values) + 1])
    message.token_logprobs.add()
    if values.num_top:
        message.top_logprobs.add()


@dataclass
class _Sample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[OutputLogprobs] = field(default_factory=list)  # joined once, for the complete
    sent_first_chunk: bool = False


class SmgResponses:
    """Turns one request's engine outputs (all its samples, interleaved) into GenerateResponses; the
    prompt's logprobs go in slices, the event loop served in between (`in_slices`). Not streaming, the
    samples' completes go out together once the last finished, in sample order, as vLLM's servicer sends
    them (FINAL_ONLY): SMG numbers non-streamed choices by arrival, not by `index`."""

    def __init__(self, spec: GenerationSpec, stream: bool) -> None:
        self._params = spec.params
        self._prompt_token_ids = spec.prompt.token_ids or ()
        self._stream = stream
        self._samples: dict[int, _Sample] = {}
        self._completes: dict[int, smg.GenerateResponse] = {}  # not streaming: held until all finished
        self._prompt_logprobs: PromptLogprobs | None = None  # once sample 0's first tokens came

    async def responses(self, output: RequestOutput) -> AsyncIterator[smg.GenerateResponse]:
        sample = self._samples.setdefault(output.index, _Sample())
        carries_prompt_logprobs = self._take_prompt_logprobs(output, sample)
        sample.token_ids += output.token_ids
        if output.logprobs and not self._stream:
            sample.logprobs.append(output.logprobs)
        if self._stream and (output.token_ids or not sample.sent_first_chunk):
            response = smg.GenerateResponse(chunk=self._chunk(output, sample))
            if carries_prompt_logprobs:
                await self._add_input_logprobs(response.chunk.input_logprobs)
            sample.sent_first_chunk = True
            yield response
        if not output.finished:
            return
        response = smg.GenerateResponse(complete=self._complete(output, sample))
        if self._stream:
            yield response
            return
        if self._prompt_logprobs is not None:
            await self._add_input_logprobs(response.complete.input_logprobs)
        self._completes[output.index] = response
        if len(self._completes) == self._params.n:
            for index in sorted(self._completes):
                yield self._completes[index]

    def _take_prompt_logprobs(self, output: RequestOutput, sample: _Sample) -> bool:
        """Whether `output`, a sample's first with tokens, carries the prompt's logprobs when they were
        asked for: every sample's first chunk does, as vLLM's servicer sends them. They come with sample
        0's (the other samples start after it answered) and are kept then. A one-token prompt has none,
        but as in vLLM its first token's entry still goes out."""
        num_top = self._params.prompt_logprobs
        if num_top is None or sample.token_ids or not output.token_ids:
            return False
        if output.index == 0:
            self._prompt_logprobs = output.prompt_logprobs or PromptLogprobs([], [], num_top)
        return self._prompt_logprobs is not None

    def _chunk(self, output: RequestOutput, sample: _Sample) -> smg.GenerateStreamChunk:
        chunk = smg.GenerateStreamChunk(
            token_ids=output.token_ids,
            prompt_tokens=len(self._prompt_token_ids),
            completion_tokens=len(output.token_ids),
            cached_tokens=output.usage.cached_tokens if output.usage else 0,
            index=output.index,
        )
        if self._params.logprobs is not None and output.logprobs:
            add_output_logprobs(chunk.output_logprobs, output.logprobs)
        return chunk

    def _complete(self, output: RequestOutput, sample: _Sample) -> smg.GenerateComplete:
        """Streaming: `output_ids` is the last delta (as vLLM sends it; SMG takes the text from the
        chunks); otherwise every token of the sample. Usage is the sample's whole."""
        token_ids, logprobs = (
            (output.token_ids, output.logprobs)
            if self._stream
            else (sample.token_ids, OutputLogprobs.joined(sample.logprobs))
        )
        usage = output.usage
        complete = smg.GenerateComplete(
            output_ids=token_ids,
            finish_reason=output.finish_reason,
            prompt_tokens=usage.prompt_tokens if usage else len(self._prompt_token_ids),
            completion_tokens=len(sample.token_ids),
            cached_tokens=usage.cached_tokens if usage else 0,
            index=output.index,
            spec_accepted_tokens=usage.accepted_draft_tokens if usage else 0,
            spec_draft_tokens=usage.draft_tokens if usage else 0,
        )
        if self._params.logprobs is not None and logprobs:
            add_output_logprobs(complete.output_logprobs, logprobs)
        if isinstance(output.stop_reason, str):
            complete.matched_stop_str = output.stop_reason
        elif isinstance(output.stop_reason, int):
            complete.matched_token_id = output.stop_reason
        return complete

    async def _add_input_logprobs(self, message: smg.InputLogProbs) -> None:
        values = self._prompt_logprobs if self._prompt_logprobs is not None else NO_PROMPT_LOGPROBS
        input_logprobs_head(message, values, self._prompt_token_ids)
        await in_slices(len(values), functools.partial(add_input_logprobs, message, values))


def model_info_to_smg(info: ModelInfo, tokenizer: Tokenizer | None) -> smg.GetModelInfoResponse:
    """`tokenizer_path` names no file on purpose: SMG then fetches the tokenizer with GetTokenizer
    (a path that exists where SMG runs would be loaded from there instead)."""
    bos = None if tokenizer is None else tokenizer.bos_token_id
    pad = None if tokenizer is None else tokenizer.token_to_id(tokenizer.special_tokens.get("pad_token", ""))
    return smg.GetModelInfoResponse(
        model_path=info.name,
        is_generation=True,
        max_context_length=info.max_model_len,
        vocab_size=info.vocab_size,
        supports_vision=False,
        served_model_name=info.name,
        tokenizer_path="",
        model_type=model_type(info.architecture),
        architectures=[info.architecture],
        eos_token_ids=info.eos_token_ids,
        pad_token_id=pad or 0,
        bos_token_id=bos or 0,
        max_req_input_len=info.max_model_len - 1,
        default_sampling_params_json="",
    )


def model_type(architecture: str) -> str:
    """The Hugging Face `model_type` of an architecture name: LlamaForCausalLM -> llama,
    Gemma3ForCausalLM -> gemma3_text (the text-only Gemma 3), Qwen2ForCausalLM -> qwen2."""
    base = architecture.removesuffix("ForCausalLM").lower()
    return "gemma3_text" if base == "gemma3" else base


def server_info_to_smg(
    *, num_active_requests: int, uptime_seconds: float, last_receive_timestamp: float, info: ModelInfo
) -> smg.GetServerInfoResponse:
    return smg.GetServerInfoResponse(
        active_requests=num_active_requests,
        is_paused=False,
        last_receive_timestamp=last_receive_timestamp,
        uptime_seconds=uptime_seconds,
        server_type=SERVER_TYPE,
        data_parallel_size=1,
        block_size=info.block_size,
        attention_backend="",
        max_num_seqs=info.max_num_seqs,
        # SMG's requests run no reasoning parser here (the gateway parses reasoning itself), so their
        # grammar applies from the first token: the gateway then leads a forced call's grammar with the
        # model's thought. (A `--reasoning-parser` holds back the constraints of Sluice's own chats only.)
        engine_reasoning_parser="",
        constrained_decoding_start="first_token",
    )


class GenerationRate:
    """Tokens generated per second over the last WINDOW_S seconds, from the engine's cumulative count:
    `gen_throughput` of SMG's load records (its least_load policy drains the queued tokens at it)."""

    WINDOW_S = 5.0
    SAMPLE_S = 0.25  # the shortest span a rate is measured over; samples are kept this far apart

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()  # (time.monotonic(), tokens generated)
        self._rate = 0.0

    def __call__(self, num_tokens: int, now: float) -> float:
        if not self._samples or now - self._samples[-1][0] >= self.SAMPLE_S:
            self._samples.append((now, num_tokens))
        while len(self._samples) > 1 and now - self._samples[1][0] >= self.WINDOW_S:
            self._samples.popleft()  # the oldest kept is the last at least WINDOW_S old
        since, num_before = self._samples[0]
        if now - since >= self.SAMPLE_S:
            self._rate = (num_tokens - num_before) / (now - since)
        return self._rate


def loads_to_smg(
    stats: EngineStats, info: ModelInfo, timestamp: str, version: str, gen_throughput: float = 0.0
) -> smg.GetLoadsResponse:
    """One rank: running and waiting requests, KV usage (blocks in use over all blocks), the tokens the
    waiting requests have yet to compute (some may be cached: the engine looks only at admission) and the
    generation rate."""
    queries = stats.prefix_cache_queries
    load = smg.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=stats.num_running,
        num_waiting_reqs=stats.num_waiting,
        num_total_reqs=stats.num_running + stats.num_waiting,
        num_used_tokens=stats.num_kv_blocks_used * info.block_size,
        max_total_num_tokens=info.kv_capacity_tokens,
        token_usage=stats.kv_usage,
        cache_hit_rate=stats.prefix_cache_hits / queries if queries else 0.0,
        num_waiting_uncached_tokens=stats.num_waiting_tokens,
        gen_throughput=gen_throughput,
        max_running_requests=info.max_num_seqs,
    )
    return smg.GetLoadsResponse(timestamp=timestamp, version=version, dp_rank_count=1, loads=[load])


def tokenizer_config(tokenizer: Tokenizer, info: ModelInfo) -> dict[str, object]:
    """tokenizer_config.json for the bundle GetTokenizer sends: the chat template and named special
    tokens (`tokenizer.json` holds the vocabulary, added tokens and post-processor)."""
    config: dict[str, object] = dict(tokenizer.special_tokens)
    config["model_max_length"] = info.max_model_len
    config["add_bos_token"] = False  # tokenizer.json's post-processor adds what is needed
    if tokenizer.chat_template is not None:
        config["chat_template"] = bundled_chat_template(tokenizer)
    return config


# Between a block tag and a template's own text: trim_blocks / lstrip_blocks (transformers' and SMG's
# settings) would otherwise eat a newline that starts it or the indentation that ends it.
_VERBATIM = "{{ '' }}"


def bundled_chat_template(tokenizer: Tokenizer) -> str:
    """The one template SMG reads (it takes `chat_template` as a string only: a list of named templates
    fails every chat, `additional_chat_templates/` is ignored). With a "tool_use" template beside the
    default, both in one: a request with tools renders by "tool_use", as transformers and Sluice pick it."""
    default = tokenizer.chat_template.source
    tool_use = tokenizer.named_chat_templates.get(TOOL_USE_TEMPLATE)
    if tool_use is None:
        return default
    return (
        f"{{% if tools is defined and tools is not none %}}{_VERBATIM}{tool_use.source}{_VERBATIM}"
        f"{{% else %}}{_VERBATIM}{default}{_VERBATIM}{{% endif %}}"
    )


def bundle_files(tokenizer: Tokenizer, info: ModelInfo) -> dict[str, str]:
    """The files of the tokenizer bundle (GetTokenizer), built from the tokenizer the engine uses, so a
    GGUF model's vocabulary is exported as `tokenizer.json` like a Hugging Face directory's."""
    config = {"architectures": [info.architecture], "model_type": model_type(info.architecture)}
    config |= {"max_position_embeddings": info.max_model_len, "vocab_size": info.vocab_size}
    config["eos_token_id"] = list(info.eos_token_ids)
    generation = {"eos_token_id": list(tokenizer.eos_token_ids or info.eos_token_ids)}
    return {
        "tokenizer.json": tokenizer.backend.to_str(),
        "tokenizer_config.json": json.dumps(tokenizer_config(tokenizer, info), indent=2),
        "config.json": json.dumps(config, indent=2),
        "generation_config.json": json.dumps(generation, indent=2),
    }
