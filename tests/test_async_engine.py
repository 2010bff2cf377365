"""AsyncEngine: a frontend in this process, the engine core in its own; streaming, aborts, abandoned
streams, merged outputs for slow readers, validation, and what happens when the core or a request fails.

The engine serves the long-context tiny Llama, so a request the test ends (abort, cancel, a killed core)
is surely still running when it does, however fast the machine; nothing waits on a sleep."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import msgspec
import pytest
from checkpoints import LONG_CONTEXT
from service_harness import PATIENCE_S, UNENDING_TOKENS

from sluice.engine.config import CacheConfig, EngineConfig, ModelConfig
from sluice.engine.errors import ContextLengthError, EngineDeadError, InvalidRequestError, QueueFullError
from sluice.engine.faults import ENV_VAR as FAULT_VAR
from sluice.engine.frontend.async_engine import AsyncEngine, EngineLiveness
from sluice.engine.frontend.llm import LLM
from sluice.engine.process.threads import core_process_environment
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.text.prompt import resolve_prompt

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
UNENDING = SamplingParams(temperature=0.0, max_tokens=UNENDING_TOKENS, ignore_eos=True)  # until ended


def _config(model_dir: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model_dir), cache=CacheConfig(block_size=16), attention_backend="torch"
    )


@pytest.fixture
async def engine(llama_long_dir):
    # Only the core's exit can tell the frontend it died (test_a_killed_core_...): its silence never
    # counts as death within a test.
    engine = AsyncEngine(_config(llama_long_dir), engine_timeout=3600.0)
    await engine.start()
    yield engine
    await engine.shutdown()


async def _collect(stream):
    return [out async for out in stream]


async def _wait_until(condition, what: str) -> None:
    """Polls `condition` on this loop; fails naming `what` only after PATIENCE_S (a hang)."""
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {PATIENCE_S:.0f} s"
        await asyncio.sleep(0.01)


def _idle(engine: AsyncEngine) -> bool:
    stats = engine.stats()
    return stats.num_kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0


async def _wait_for_free_blocks(engine: AsyncEngine) -> None:
    await _wait_until(lambda: _idle(engine), f"blocks freed ({engine.stats()})")


async def test_concurrent_streams_equal_the_offline_engine(engine, llama_long_dir):
    prompts = ["the quick brown fox", "Hello world! How are you today?", "Numbers: 1 2 3"]
    offline = LLM(llama_long_dir).generate(prompts, PARAMS)
    streams = [await engine.add_request(f"req-{i}", PARAMS, text=p) for i, p in enumerate(prompts)]
    results = await asyncio.gather(*(_collect(s) for s in streams))
    for outputs, expected in zip(results, offline, strict=True):
        assert [t for o in outputs for t in o.token_ids] == expected.token_ids
        assert "".join(o.text for o in outputs) == expected.text
        assert outputs[-1].finish_reason == "length"
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        usage = outputs[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(expected.prompt_token_ids), 8)
        timings = outputs[-1].timings
        assert timings.arrival <= timings.first_scheduled <= timings.first_token <= timings.finished
    await _wait_for_free_blocks(engine)


async def test_a_start_cancelled_while_the_model_loads_leaves_no_core_behind(tmp_path):
    """The core reads its model from a FIFO nobody writes: it loads until the test cancels the start. The
    cancelled start must kill it (a frontend that gives up must not leave an engine core running) and
    remove the sockets' directory."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    engine = AsyncEngine(
        EngineConfig(model=ModelConfig(model=str(fifo), load_format="gguf")), engine_timeout=3600.0
    )
    start = asyncio.create_task(engine.start())
    await _wait_until(lambda: engine._client.process is not None, "the core process started")
    process = engine._client.process
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    assert await asyncio.wait_for(process.wait(), PATIENCE_S) == -signal.SIGKILL
    assert not os.path.exists(engine._client._directory)  # nor the directory of its sockets
    await engine.shutdown()


# A frontend in a fresh interpreter serves a request and a chat with tools (whose checks once imported
# xgrammar, and torch with it) and prints the heavy packages it imported; this
# process cannot tell, since the tests import torch into it.
_FRONTEND_ONLY = """
import asyncio, os, sys
from sluice.engine.config import CacheConfig, EngineConfig, ModelConfig
from sluice.engine.frontend.async_engine import AsyncEngine
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.tool_calls import Tool, ToolUse

async def main():
    model = ModelConfig(model=sys.argv[1])
    config = EngineConfig(model=model, cache=CacheConfig(block_size=16), attention_backend="torch")
    engine = AsyncEngine(config, engine_timeout=3600.0)
    await engine.start()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = [o async for o in await engine.add_request("r", params, text="hello world")]
    tools = ToolUse((Tool("f", "", '{"properties": {"a": {"type": "integer"}}}'),), "auto")
    chat = [{"role": "user", "content": "hi"}]
    outputs += [o async for o in await engine.add_request("t", params, messages=chat, tool_use=tools)]
    core_pid = engine.core_pid
    await engine.shutdown()
    heavy = sorted({name.split(".")[0] for name in sys.modules} & {"torch", "transformers"})
    print(sum(len(o.token_ids) for o in outputs), core_pid not in (None, os.getpid()), heavy)

asyncio.run(main())
"""


def test_the_frontend_process_never_imports_torch(llama_dir):
    result = subprocess.run(
        [sys.executable, "-c", _FRONTEND_ONLY, llama_dir], capture_output=True, text=True, timeout=PATIENCE_S
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "8 True []", result.stdout


def test_the_core_process_imports_nothing_from_the_working_directory(llama_dir, tmp_path):
    """A queue.py where the server is started (the caller's own, unrelated) would shadow the standard
    library's in the core (torch imports queue), as `python -m` puts the working directory first."""
    (tmp_path / "queue.py").write_text("raise ImportError('the working directory was imported')\n")
    result = subprocess.run(  # -P: neither does the test's own interpreter import it
        [sys.executable, "-P", "-c", _FRONTEND_ONLY, llama_dir],
        capture_output=True, text=True, timeout=PATIENCE_S, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "8 True []", result.stdout


async def test_the_core_process_is_started_with_the_core_environment(engine):
    with open(f"/proc/{engine.core_pid}/environ", "rb") as f:
        entries = [entry.decode().partition("=") for entry in f.read().split(b"\0") if entry]
    core_environ = {name: value for name, _, value in entries}
    expected = core_process_environment(os.environ)
    assert core_environ.get("GOMP_SPINCOUNT") == expected.get("GOMP_SPINCOUNT")
    assert core_environ.get("OMP_WAIT_POLICY") == expected.get("OMP_WAIT_POLICY")
    assert core_environ.get("GLIBC_TUNABLES") == expected["GLIBC_TUNABLES"]


async def test_a_slow_reader_gets_merged_outputs_equal_to_the_offline_engine(engine, llama_long_dir):
    """The slowest reader: after its first output it reads nothing until the engine has finished the
    request, and then finds every later delta merged into one output."""
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    offline = LLM(llama_long_dir).generate(["the quick brown fox"], params)[0]
    stream = await engine.add_request("slow", params, text="the quick brown fox")
    outputs = [await anext(stream)]
    await _wait_for_free_blocks(engine)  # finished in the core: its outputs are all in the collector
    outputs += [output async for output in stream]
    assert len(outputs) <= 2, f"{len(outputs)} outputs: nothing was merged"
    assert max(len(o.token_ids) for o in outputs) >= 60
    assert [t for o in outputs for t in o.token_ids] == offline.token_ids
    assert "".join(o.text for o in outputs) == offline.text
    assert outputs[-1].finish_reason == "length" and outputs[-1].usage.completion_tokens == 120


async def test_stream_interval_hands_over_fixed_size_chunks(engine, llama_long_dir):
    """A request that runs until aborted: every output before the abort holds >= 5 tokens (exactly 5
    unless this reader lagged behind the engine and found deltas merged)."""
    params = SamplingParams(temperature=0.0, max_tokens=UNENDING_TOKENS, ignore_eos=True, logprobs=1)
    stream = await engine.add_request("chunky", params, text="Hello world", stream_interval=5)
    outputs = [await anext(stream) for _ in range(3)]
    await engine.abort("chunky")
    outputs += [output async for output in stream]
    sizes = [len(o.token_ids) for o in outputs]
    assert min(sizes[:3]) >= 5 and not any(o.finished for o in outputs[:3]), sizes
    assert outputs[-1].finish_reason == "abort"
    token_ids = [t for o in outputs for t in o.token_ids]
    greedy = SamplingParams(temperature=0.0, max_tokens=len(token_ids), ignore_eos=True)
    assert token_ids == LLM(llama_long_dir).generate(["Hello world"], greedy)[0].token_ids
    assert [lp.sampled.token_id for o in outputs for lp in o.logprobs] == token_ids


async def test_abort_ends_the_stream_and_frees_blocks(engine):
    stream = await engine.add_request("long", UNENDING, text="the quick brown fox")
    first = await anext(stream)
    assert first.token_ids
    await engine.abort("long")
    rest = [out async for out in stream]
    assert rest[-1].finish_reason == "abort"
    assert sum(len(o.token_ids) for o in rest) < UNENDING_TOKENS - 1
    await _wait_for_free_blocks(engine)
    assert not engine.has_request("long")


async def test_liveness_counts_unanswered_prompts_and_the_cores_silence_while_requests_live(engine):
    """What SMG's load records report (engine_silence_ms, prefill_pending_tokens): a prompt counts until
    its request's first output or its end; the silence is reported only while a request is live."""
    assert engine.liveness() == EngineLiveness(None, 0)
    first = await engine.add_request("a", UNENDING, token_ids=list(range(10, 40)))
    second = await engine.add_request("b", PARAMS, token_ids=list(range(50, 70)))
    third = await engine.add_request("c", UNENDING, token_ids=list(range(80, 85)))
    liveness = engine.liveness()  # nothing handled since they were added: none has had an output
    assert liveness.prefill_pending_tokens == 30 + 20 + 5 and liveness.silence_s >= 0
    assert engine.liveness().silence_s >= liveness.silence_s  # the same silence, longer
    await engine.abort("c")
    assert [out.finish_reason async for out in third][-1] == "abort"
    await anext(first)
    await _collect(second)
    assert engine.liveness().prefill_pending_tokens == 0
    assert engine.liveness().silence_s is not None  # "a" runs on
    await engine.abort("a")
    await _collect(first)
    assert engine.liveness() == EngineLiveness(None, 0)


async def test_cancelling_the_consumer_aborts_the_request(engine):
    stream = await engine.add_request("abandoned", UNENDING, text="the quick brown fox")

    async def consume():
        async for _ in stream:
            pass

    task = asyncio.create_task(consume())
    await _wait_until(lambda: engine.stats().num_running == 1, "the request running")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await _wait_for_free_blocks(engine)
    assert engine.num_live_requests == 0


async def test_bad_requests_raise_before_queueing(engine):
    cases = [
        (dict(text=""), InvalidRequestError, "prompt: is empty: give text, token_ids or messages"),
        (
            dict(token_ids=[1, 99999]),
            InvalidRequestError,
            "token_ids: token id 99999 is outside the vocabulary",
        ),
        (
            dict(text="a", token_ids=[1]),
            InvalidRequestError,
            "prompt: give exactly one of text, token_ids, messages",
        ),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message.replace("(", r"\(").replace("[", r"\[")):
            await engine.add_request("bad", PARAMS, **kwargs)
    too_long = SamplingParams(max_tokens=LONG_CONTEXT)
    message = rf"max_tokens: prompt \(\d+ tokens\) \+ max_tokens \({LONG_CONTEXT}\)"
    with pytest.raises(ContextLengthError, match=message):
        await engine.add_request("long", too_long, text="the quick brown fox jumps over the lazy dog")
    stream = await engine.add_request("dup", PARAMS, text="hi")
    with pytest.raises(InvalidRequestError, match="request_id: 'dup' is already in use"):
        await engine.add_request("dup", PARAMS, text="hi")
    await _collect(stream)
    assert engine.num_live_requests == 0


async def test_a_bad_priority_or_salt_or_a_failed_send_leaves_nothing_and_the_core_serves_on(
    engine, monkeypatch
):
    """A priority or cache salt of the wrong type once reached the core, whose message decoder refused it
    and exited: every stream failed. A request whose message cannot be sent (msgspec cannot encode a
    value) once stayed live: its id was taken for good."""
    with pytest.raises(InvalidRequestError, match=r"^priority: must be an integer, got None$"):
        await engine.add_request("a", PARAMS, token_ids=[5, 6, 7], priority=None)
    with pytest.raises(InvalidRequestError, match=r"^cache_salt: must be a string, got 5$"):
        await engine.add_request("a", PARAMS, token_ids=[5, 6, 7], cache_salt=5)

    def cannot_send(message: object) -> None:
        raise TypeError("Encoding objects of type X is unsupported")

    with monkeypatch.context() as patched:
        patched.setattr(engine._client, "send", cannot_send)
        with pytest.raises(TypeError, match="Encoding objects"):
            await engine.add_request("a", PARAMS, token_ids=[5, 6, 7])
    assert engine.num_live_requests == 0
    outputs = await _collect(await engine.add_request("a", PARAMS, token_ids=[5, 6, 7], priority=2))
    assert (outputs[-1].finish_reason, sum(len(o.token_ids) for o in outputs)) == ("length", 8)


async def test_a_long_prompt_is_tokenized_off_the_event_loop_and_served(engine, llama_long_dir, monkeypatch):
    from sluice.engine.frontend import async_engine

    threads = []

    def spy(*args, **kwargs):
        threads.append(threading.current_thread())
        return resolve_prompt(*args, **kwargs)

    monkeypatch.setattr(async_engine, "resolve_prompt", spy)
    monkeypatch.setattr(async_engine, "TOKENIZE_INLINE_MAX_CHARS", 40)
    short, long = "the quick brown fox", "the quick brown fox jumps over the lazy dog " * 2
    expected = LLM(llama_long_dir).generate([short, long], PARAMS)
    for i, text in enumerate((short, long)):
        outputs = await _collect(await engine.add_request(f"p{i}", PARAMS, text=text))
        assert [t for o in outputs for t in o.token_ids] == expected[i].token_ids
    assert threads[0] is threading.main_thread()
    assert threads[1] is not threading.main_thread()


async def test_queue_bound_rejects_with_queue_full(llama_dir):
    config = _config(llama_dir)
    config = replace(config, scheduler=replace(config.scheduler, max_num_seqs=1))
    engine = AsyncEngine(config, max_queue=2)
    await engine.start()
    try:
        # Added back to back, before the core reports: one takes its one seat, two wait, a fourth is refused.
        held = [await engine.add_request(r, PARAMS, text="one") for r in ("a", "b", "c")]
        with pytest.raises(QueueFullError, match=r"the waiting queue is full \(2 sequences waiting"):
            await engine.add_request("d", PARAMS, text="three")
        for stream in held:
            await _collect(stream)
    finally:
        await engine.shutdown()


async def test_an_idle_engine_takes_a_burst_its_seats_hold_whatever_the_queue_bound(llama_dir):
    """Added before the core's next report, a burst counted as waiting whole: an idle server with 128
    seats and --max-queue 2 refused 4 of 8 requests it would have run at once."""
    engine = AsyncEngine(_config(llama_dir), max_queue=2)
    await engine.start()
    try:
        held = [await engine.add_request(f"r{i}", PARAMS, text="one") for i in range(8)]
        for stream in held:
            assert (await _collect(stream))[-1].finish_reason == "length"
    finally:
        await engine.shutdown()


async def test_queue_bound_counts_a_requests_samples(llama_dir):
    """max_queue bounds waiting sequences: n samples count n (a request of 2 samples took a queue of
    bound 2 holding one to 3). An empty queue takes a request of more samples than its bound. One seat:
    what the core has not reported running, past the one it will run, waits."""
    config = _config(llama_dir)
    engine = AsyncEngine(replace(config, scheduler=replace(config.scheduler, max_num_seqs=1)), max_queue=2)
    await engine.start()
    try:
        held = [await engine.add_request("many", SamplingParams(n=4, max_tokens=4), text="one")]
        with pytest.raises(QueueFullError, match="3 sequences waiting, max_queue 2"):
            await engine.add_request("one-more", PARAMS, text="two")
        for stream in held:
            await _collect(stream)
        held = [await engine.add_request("first", PARAMS, text="one")]  # in the one seat
        held.append(await engine.add_request("waits", PARAMS, text="one"))
        with pytest.raises(
            QueueFullError, match="1 sequences waiting, this request's 2 samples, max_queue 2"
        ):
            await engine.add_request("pair", SamplingParams(n=2, max_tokens=4), text="two")
        held.append(await engine.add_request("second", PARAMS, text="three"))
        for stream in held:
            await _collect(stream)
    finally:
        await engine.shutdown()


async def test_requests_whose_grammars_compile_leave_the_free_seats_to_a_burst(engine, monkeypatch):
    """They count as waiting (the gauge, SMG's load) but hold no request back: once the core reported
    two of them, --max-queue 2 refused a plain request on an idle server of 64 seats."""
    monkeypatch.setattr(type(engine._output_processor), "num_live_samples", property(lambda self: 3))
    compiling = msgspec.structs.replace(engine._stats, num_waiting=2, num_waiting_for_grammar=2)
    monkeypatch.setattr(engine, "_stats", compiling)
    assert engine._num_queued() == 0  # 3 live sequences, all in free seats
    held_back = msgspec.structs.replace(compiling, num_waiting=3)  # one waits for a seat: all do
    monkeypatch.setattr(engine, "_stats", held_back)
    assert engine._num_queued() == 3


async def test_the_samples_held_back_until_sample_0_answers_count_as_waiting(llama_long_dir):
    """The frontend sends samples 1 .. n-1 once sample 0 answers; until then they wait too (vLLM sends
    all n to its core): an n=4 request behind the one seat counted 1 waiting."""
    config = _config(llama_long_dir)
    engine = AsyncEngine(replace(config, scheduler=replace(config.scheduler, max_num_seqs=1)))
    await engine.start()
    try:
        running = await engine.add_request("seated", UNENDING, text="one")
        many = await engine.add_request("many", SamplingParams(n=4, max_tokens=2), token_ids=[5, 6, 7])
        core_stats = lambda: engine._stats  # noqa: E731  (what the core reported, nothing added)
        await _wait_until(lambda: core_stats().num_waiting == 1, "sample 0 waiting in the core")
        stats = engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_waiting_tokens) == (1, 4, 4 * 3)
        await engine.abort("seated")
        await _collect(running)
        await _collect(many)
        await _wait_for_free_blocks(engine)
    finally:
        await engine.shutdown()


async def test_a_stream_dropped_before_iterating_aborts_its_request(engine):
    stream = await engine.add_request("never-read", UNENDING, text="the quick brown fox")
    assert engine.has_request("never-read")
    del stream
    gc.collect()
    assert not engine.has_request("never-read")
    await _wait_for_free_blocks(engine)
    assert engine.stats().num_waiting == 0


async def _started(model_dir: str, monkeypatch: pytest.MonkeyPatch, fault: str) -> AsyncEngine:
    monkeypatch.setenv(FAULT_VAR, fault)
    engine = AsyncEngine(_config(model_dir), engine_timeout=3600.0)
    await engine.start()
    return engine


async def test_a_shutdown_ends_every_stream_with_an_abort_and_refuses_new_requests(engine):
    """A request the core runs and an n = 2 request whose sample 1 never reached it: each sample ends
    with "abort" (the core stops without answering; the streams waited forever, and a later request
    reached a closed socket: ZMQError)."""
    running = await engine.add_request("running", UNENDING, text="the quick brown fox")
    two = SamplingParams(n=2, temperature=1.0, max_tokens=UNENDING_TOKENS, ignore_eos=True)
    pair = await engine.add_request("pair", two, text="jumps over")
    assert (await anext(running)).token_ids
    await engine.shutdown()
    outputs = await asyncio.wait_for(_collect(running), PATIENCE_S)
    assert outputs[-1].finish_reason == "abort"
    pair_outputs = await asyncio.wait_for(_collect(pair), PATIENCE_S)
    assert sorted(o.index for o in pair_outputs if o.finished) == [0, 1]
    assert {o.finish_reason for o in pair_outputs if o.finished} == {"abort"}
    with pytest.raises(EngineDeadError, match="the engine was shut down"):
        await engine.add_request("after", PARAMS, text="hello")
    # The profiler's commands too (they reached the closed socket: ZMQError "Socket operation on non-socket").
    with pytest.raises(EngineDeadError, match="the engine was shut down"):
        engine.start_profile("/tmp", 1, ["cpu"], record_shapes=False, with_stack=False)
    with pytest.raises(EngineDeadError, match="the engine was shut down"):
        engine.stop_profile()


async def test_a_killed_core_fails_every_stream_and_refuses_new_requests(engine):
    dead = asyncio.Event()
    engine.on_dead(lambda reason: dead.set())
    streams = [await engine.add_request(f"s{i}", UNENDING, text="the quick brown fox") for i in range(4)]
    await anext(streams[0])
    os.kill(engine.core_pid, signal.SIGKILL)
    for stream in streams:
        with pytest.raises(EngineDeadError, match=r"the engine core process exited \(killed by SIGKILL\)"):
            await asyncio.wait_for(_collect(stream), PATIENCE_S)  # the exit, not the silence, tells it
    assert dead.is_set()
    with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
        await engine.add_request("after", PARAMS, text="hello")


async def test_a_frontend_that_fails_handling_the_cores_message_fails_every_stream_saying_why(
    engine, monkeypatch
):
    """A bug in handling the core's outputs ended the frontend's reader silently: the streams waited for
    the silence watchdog (engine_timeout, an hour here) and its 'stopped answering'."""
    stream = await engine.add_request("s", UNENDING, text="the quick brown fox")
    await anext(stream)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(engine._output_processor, "process", broken)
    with pytest.raises(
        EngineDeadError, match="handling the engine core's message failed: RuntimeError: a bug"
    ):
        await asyncio.wait_for(_collect(stream), PATIENCE_S)


async def test_a_step_that_raises_kills_the_core_with_its_reason(llama_long_dir, monkeypatch):
    engine = await _started(llama_long_dir, monkeypatch, "step:poison")
    try:
        healthy = await engine.add_request("healthy", UNENDING, text="the quick brown fox")
        await anext(healthy)
        poisoned = await engine.add_request("poison-1", PARAMS, text="hello")
        for stream in (healthy, poisoned):
            with pytest.raises(EngineDeadError, match="^a step raised InjectedFault: injected step fault"):
                await asyncio.wait_for(_collect(stream), PATIENCE_S)
        await asyncio.wait_for(engine._client.process.wait(), PATIENCE_S)  # the failed core is gone
    finally:
        await engine.shutdown()


@pytest.mark.parametrize(
    ("place", "message"), [("sample", "sampling failed"), ("detokenize", "detokenization failed")]
)
async def test_a_request_that_fails_alone_ends_alone(llama_dir, monkeypatch, place, message):
    engine = await _started(llama_dir, monkeypatch, f"{place}:bad-")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        expected = LLM(llama_dir).generate(["the quick brown fox"], params)[0]
        good = [await engine.add_request(f"good-{i}", params, text="the quick brown fox") for i in range(3)]
        bad = await engine.add_request("bad-1", params, text="the quick brown fox")
        outputs = await asyncio.gather(*(_collect(s) for s in [*good, bad]))
        for result in outputs[:3]:
            assert [t for o in result for t in o.token_ids] == expected.token_ids
            assert result[-1].finish_reason == "length"
        assert outputs[3][-1].finish_reason == "error"
        assert message in outputs[3][-1].error
        await _wait_for_free_blocks(engine)
        assert engine.error is None
    finally:
        await engine.shutdown()


def test_a_prompt_counts_what_its_template_renders_punctuation_included():
    """150,000 empty arrays in a tool's schema render to 600 KB of JSON but counted 0 characters: the
    chat was rendered on the event loop (0.6 s)."""
    from sluice.engine.frontend.async_engine import TOKENIZE_INLINE_MAX_CHARS, prompt_chars

    user = [{"role": "user", "content": "hi"}]
    empty = [{"type": "function", "function": {"name": "f", "parameters": {"enum": [[]] * 150_000}}}]
    assert prompt_chars(messages=user) < 100
    assert prompt_chars(messages=user, tools=empty) > TOKENIZE_INLINE_MAX_CHARS
    assert prompt_chars(messages=user, tools=[{"x": [""] * 150_000}]) > TOKENIZE_INLINE_MAX_CHARS


async def test_calls_after_the_engine_died_each_get_their_own_error(llama_long_dir) -> None:
    """Re-raising the one kept EngineDeadError chained every refused call's frames (and the request they
    hold) onto its traceback, for as long as the engine object lived (found by a soak of the server)."""
    engine = AsyncEngine(_config(llama_long_dir))
    engine.error = EngineDeadError("the engine core process exited (exit code 1)")
    raised = []
    for request_id in ("a", "b"):
        with pytest.raises(EngineDeadError, match=r"^the engine core process exited \(exit code 1") as info:
            await engine.add_request(request_id, PARAMS, text="hello")
        raised.append(info.value)
    assert raised[0] is not raised[1] and engine.error.__traceback__ is None


def test_an_engine_dropped_unstarted_in_a_reference_cycle_does_not_hang_the_collector(
    llama_long_dir, tmp_path
) -> None:
    """The cycle's weak references (the zmq context's list of its sockets) are cleared before its
    finalizers run: the context's __del__ terminated it with the sockets still open, and zmq waited for
    them forever, in the middle of whatever allocation ran the collector (a test's model build)."""
    script = (
        "import gc, sys\n"
        "from sluice.engine.config import EngineConfig, ModelConfig\n"
        "from sluice.engine.frontend.async_engine import AsyncEngine\n"
        "engine = AsyncEngine(EngineConfig(model=ModelConfig(model=sys.argv[1])))\n"
        "engine.cycle = engine\n"
        "del engine\n"
        "gc.collect()\n"
        "print('collected')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, llama_long_dir],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
    )
    assert (done.returncode, done.stdout) == (0, "collected\n"), done.stderr
