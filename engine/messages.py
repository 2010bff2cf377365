"""What crosses between a frontend and the engine core: requests in, one message per step out.

    frontend                                   engine core (owns torch)
    --------                                   ------------------------
    CoreConfig        ---------------------->  loads the model
                      <----------------------  CoreReady(model_info, tokenizer)  | CoreFailed(error)
    AddRequest        ---------------------->  scheduler
    AbortRequests     ---------------------->  frees blocks before the next step
                      <----------------------  CoreOutputs(outputs, stats, kv_events): every request's
                                                                 new tokens (and the prefix cache's changes)
                      <----------------------  CoreHeartbeat (when idle)
                      <----------------------  CoreFailed(error): the core is dead
    StartProfile      ---------------------->  profiles the next steps into a directory
    StopProfile       ---------------------->  ends that profile early
    Shutdown          ---------------------->  exits

Pure data (msgspec structs over msgpack), no torch: the frontend imports this module too.
"""

from __future__ import annotations

import operator

import msgspec

from sluice.engine.config import EngineConfig
from sluice.engine.errors import ContextLengthError, InvalidRequestError
from sluice.engine.kv_cache.kv_events import KVEvent
from sluice.engine.model_info import ModelInfo
from sluice.engine.outputs import EngineStats, OutputLogprobs, PromptLogprobs
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.text.tokenizer import TokenizerSpec

# The frontend's temporary directory of the two ipc:// sockets is named with this prefix; its core removes
# it when the frontend died without doing so.
SOCKET_DIRECTORY_PREFIX = "sluice-core-"


class CoreConfig(msgspec.Struct, tag=True):
    config: EngineConfig
    heartbeat_seconds: float
    kv_events: bool = False  # record the prefix cache's changes (CoreOutputs.kv_events)


class CoreReady(msgspec.Struct, tag=True):
    model_info: ModelInfo
    tokenizer: TokenizerSpec | None
    pid: int


class CoreFailed(msgspec.Struct, tag=True):
    """The core could not load, or died; `error` says why."""

    error: str


class CoreHeartbeat(msgspec.Struct, tag=True):
    stats: EngineStats


class CoreBusy(msgspec.Struct, tag=True):
    """Sent while a long step runs on the CPU and the core keeps using it (`StepWatch`): the core is slow,
    not hung. `step_seconds`: how long the step has run."""

    step_seconds: float


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    use_speculation: bool = True  # False: this request never verifies draft tokens


def checked_priority(priority: object) -> int:
    """`priority` as an AddRequest carries it (an int; lower runs first), or InvalidRequestError: the
    core's decoder refuses anything else, and a scheduler's queue cannot order it."""
    if not isinstance(priority, bool):
        try:
            return operator.index(priority)
        except TypeError:
            pass
    raise InvalidRequestError("priority", f"must be an integer, got {priority!r}")


def checked_cache_salt(cache_salt: object) -> str | None:
    """`cache_salt` as an AddRequest carries it (a string or None), or InvalidRequestError."""
    if cache_salt is None or isinstance(cache_salt, str):
        return cache_salt
    raise InvalidRequestError("cache_salt", f"must be a string, got {cache_salt!r}")


class AbortRequests(msgspec.Struct, tag=True):
    """Ends the requests now (`error` None: finish_reason "abort"; else "error" with that message)."""

    request_ids: list[str]
    error: str | None = None


class Shutdown(msgspec.Struct, tag=True):
    pass


class StartProfile(msgspec.Struct, tag=True):
    """Profile the next `num_steps` forward steps (0: until StopProfile) into `output_dir`
    (`sluice.engine.core.step_profiler`)."""

    output_dir: str
    num_steps: int
    activities: list[str] = msgspec.field(default_factory=list)  # "CPU", "GPU"; empty: the device's
    record_shapes: bool = False
    with_stack: bool = False


class StopProfile(msgspec.Struct, tag=True):
    """End the running profile now and write it."""


class CoreOutput(msgspec.Struct, array_like=True):
    """One request's advance in one step: the tokens it accepted, and its state after them."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: OutputLogprobs | None  # those of new_token_ids, one entry each, when the request asks
    num_cached_tokens: int
    num_preemptions: int
    first_scheduled: float | None
    first_token: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    finished_time: float | None = None
    # The request was refused before it ran, because of this field (e.g. a json_schema that does not
    # compile): the frontend raises it (`RequestOutput.refusal`) instead of streaming; `too_long`: it was
    # a ContextLengthError (the request does not fit the model's context or the KV cache).
    invalid_field: str | None = None
    too_long: bool = False
    # On the output carrying the first token of a request with prompt_logprobs: one entry per prompt
    # token after the first.
    prompt_logprobs: PromptLogprobs | None = None
    # Prompt tokens this request ran through the model so far (after its prefix-cache hit).
    num_prompt_tokens_computed: int = 0
    # Speculative decoding, the request's totals so far: draft tokens verified, and accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failed(
        cls, request_id: str, error: str, invalid_field: str | None = None, too_long: bool = False
    ) -> CoreOutput:
        """The last output of a request the core could not take."""
        return cls(
            request_id,
            [],
            None,
            0,
            0,
            None,
            None,
            finish_reason="error",
            error=error,
            invalid_field=invalid_field,
            too_long=too_long,
        )

    @classmethod
    def refused(cls, request_id: str, exc: InvalidRequestError) -> CoreOutput:
        """The last output of a request the core refused with `exc`: its field, and whether it was a
        ContextLengthError (RESOURCE_EXHAUSTED at the gRPC edge, not INVALID_ARGUMENT)."""
        return cls.failed(request_id, str(exc), exc.field, isinstance(exc, ContextLengthError))

    @classmethod
    def aborted(cls, request_id: str) -> CoreOutput:
        """The last output of a request aborted before the core ran it."""
        return cls(request_id, [], None, 0, 0, None, None, finish_reason="abort")


class CoreOutputs(msgspec.Struct, tag=True):
    outputs: list[CoreOutput]
    stats: EngineStats
    kv_events: list[KVEvent] = msgspec.field(default_factory=list)  # this step's, in order


FrontendMessage = CoreConfig | AddRequest | AbortRequests | Shutdown | StartProfile | StopProfile
CoreMessage = CoreReady | CoreFailed | CoreHeartbeat | CoreBusy | CoreOutputs

encode = msgspec.msgpack.Encoder().encode
decode_frontend_message = msgspec.msgpack.Decoder(FrontendMessage).decode
decode_core_message = msgspec.msgpack.Decoder(CoreMessage).decode
