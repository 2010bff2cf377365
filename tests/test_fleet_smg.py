"""A fleet behind the real SMG gateway (PyPI `smg`, `smg launch`): two `sluice serve` workers serving the
tiny Llama (a trained BPE tokenizer and a ChatML template) and SMG with cache-aware routing on
loopback, called through the `openai` SDK. SMG fetches the tokenizer and chat template from the
workers (GetTokenizer), renders and tokenizes the chat itself and sends token ids over
vllm.grpc.engine.VllmEngine; the answers must be those of Sluice's own gRPC API."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import jsonschema
import openai
import pytest
from checkpoints import copy_with_tool_use_template
from fleet_harness import SluiceProcess, SmgGateway, wait_for

from sluice import Client, generate_request

pytestmark = pytest.mark.timeout(600)

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def fleet(llama_dir: str, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("fleet")
    workers: list[SluiceProcess] = []
    gateway = None
    try:
        workers = [SluiceProcess(llama_dir, logs / f"worker{i}.log") for i in range(2)]
        gateway = SmgGateway([w.url for w in workers], logs / "smg.log", policy="cache_aware")
        yield gateway, workers
    finally:
        if gateway is not None:
            gateway.close()
        for worker in workers:
            worker.close()


@pytest.fixture(scope="module")
def openai_client(fleet) -> openai.OpenAI:
    gateway, _ = fleet
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", timeout=120, max_retries=0)


def _generate_calls(workers: list[SluiceProcess]) -> list[float]:
    return [w.rpc_count("VllmEngine.Generate") for w in workers]


def test_the_gateway_lists_the_workers_model(fleet) -> None:
    gateway, workers = fleet
    assert gateway.models() == [workers[0].model]
    assert set(gateway.workers()) == {w.url for w in workers}


def test_a_streamed_chat_answer_equals_sluices_own_grpc_answer(fleet, openai_client) -> None:
    _, workers = fleet
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    with Client(workers[0].target) as client:
        expected = client.complete(
            generate_request(messages=messages, max_tokens=12, temperature=0.0, ignore_eos=True), timeout=60
        )
    stream = openai_client.chat.completions.create(
        model=workers[0].model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    parts, finish_reasons, usage = [], [], None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish_reasons.append(choice.finish_reason)
        usage = chunk.usage or usage
    assert "".join(parts) == expected.text
    assert [r for r in finish_reasons if r] == ["length"]
    assert usage.completion_tokens == 12 == len(expected.token_ids)
    assert usage.prompt_tokens == expected.usage.prompt_tokens


def test_n_logprobs_and_stop_through_the_gateway(fleet, openai_client) -> None:
    _, workers = fleet
    messages = [{"role": "user", "content": "Count with me."}]
    with Client(workers[0].target) as client:
        greedy = client.complete(
            generate_request(messages=messages, max_tokens=8, temperature=0.0, ignore_eos=True), timeout=60
        )
    response = openai_client.chat.completions.create(
        model=workers[0].model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        n=2,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        assert choice.message.content == greedy.text  # greedy: both samples are the same
        assert len(choice.logprobs.content) == 8
        for position in choice.logprobs.content:
            assert len(position.top_logprobs) == 3
            assert position.logprob == pytest.approx(max(t.logprob for t in position.top_logprobs), abs=1e-4)
    assert response.usage.completion_tokens == 16
    # A stop string (a word of the greedy answer past its start) cuts the answer where it first appears.
    words = [m for m in re.finditer(r"[A-Za-z]{2,}", greedy.text) if m.start() > 0]
    assert words, f"no word to stop at in {greedy.text!r}"
    stop = words[-1].group()
    stopped = openai_client.chat.completions.create(
        model=workers[0].model, messages=messages, max_tokens=8, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == greedy.text[: greedy.text.index(stop)]


def test_a_json_schema_response_format_through_the_gateway(fleet, openai_client) -> None:
    _, workers = fleet
    response = openai_client.chat.completions.create(
        model=workers[0].model,
        messages=[{"role": "user", "content": "Name a city and its population as JSON."}],
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
    )
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), SCHEMA)


def test_a_tool_call_through_the_gateway(fleet, openai_client) -> None:
    _, workers = fleet
    response = openai_client.chat.completions.create(
        model=workers[0].model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=60,
        temperature=0,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = response.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


def test_a_request_with_tools_renders_by_the_models_tool_use_template(llama_dir: str, tmp_path: Path) -> None:
    """A model with a "tool_use" template beside its default one: the gateway renders a chat with tools by
    it and one without by the default, as Sluice's own API does (the prompts are as long)."""
    model = copy_with_tool_use_template(llama_dir, tmp_path / "model")
    worker = SluiceProcess(str(model), tmp_path / "worker.log")
    gateway = None
    try:
        gateway = SmgGateway([worker.url], tmp_path / "smg.log")
        client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", timeout=120, max_retries=0)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        with Client(worker.target) as sluice:
            for tools in ([WEATHER_TOOL], None):
                own = sluice.tokenize(
                    messages=messages, tools=None if tools is None else [WEATHER_TOOL["function"]]
                )
                extra = {} if tools is None else {"tools": tools}
                response = client.chat.completions.create(
                    model=worker.model, messages=messages, max_tokens=1, temperature=0, **extra
                )
                assert response.usage.prompt_tokens == len(own), tools
            assert len(own) < len(sluice.tokenize(messages=messages, tools=[WEATHER_TOOL["function"]]))
    finally:
        if gateway is not None:
            gateway.close()
        worker.close()


def test_ten_turns_of_a_conversation_land_on_one_worker(fleet, openai_client) -> None:
    """Cache-aware routing keeps a conversation where its prefix is: every turn on one worker, whose
    prefix cache serves the whole history of the turns before (cached prompt tokens grow)."""
    _, workers = fleet
    for conversation in range(2):
        messages = [{"role": "system", "content": f"Be brief, {conversation}."}]
        cached, served_by = [], set()
        for turn in range(10):
            messages.append({"role": "user", "content": f"q{turn}"})
            before = _generate_calls(workers)
            response = openai_client.chat.completions.create(
                model=workers[0].model, messages=messages, max_tokens=3, temperature=0
            )
            after = _generate_calls(workers)
            served_by |= {i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b}
            messages.append({"role": "assistant", "content": response.choices[0].message.content})
            cached.append(response.usage.prompt_tokens_details.cached_tokens)
        assert len(served_by) == 1, f"conversation {conversation} was served by workers {served_by}"
        assert cached[0] == 0
        assert all(later > earlier for earlier, later in zip(cached, cached[1:], strict=False)), cached


def test_a_client_that_leaves_aborts_its_request_on_the_worker(fleet, openai_client) -> None:
    _, workers = fleet
    before = sum(w.finished("abort") for w in workers)
    stream = openai_client.chat.completions.create(
        model=workers[0].model,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    stream.close()  # SMG drops the worker stream and sends Abort
    wait_for(
        lambda: sum(w.finished("abort") for w in workers) > before, 60, "the worker to abort the request"
    )


def test_a_killed_worker_loses_no_call_once_the_gateway_noticed(llama_dir: str, tmp_path: Path) -> None:
    workers = [SluiceProcess(llama_dir, tmp_path / f"worker{i}.log") for i in range(2)]
    gateway = SmgGateway([w.url for w in workers], tmp_path / "smg.log")
    try:
        client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", timeout=120, max_retries=0)

        def ask(i: int) -> None:
            response = client.chat.completions.create(
                model=workers[0].model,
                messages=[{"role": "user", "content": f"hi {i}"}],
                max_tokens=2,
                extra_body={"ignore_eos": True},  # sampled: the random model may draw an EOS within 2
            )
            assert response.choices[0].finish_reason == "length"

        for i in range(4):
            ask(i)
        dead, alive = workers
        dead.kill()
        wait_for(lambda: not gateway.workers().get(dead.url, False), 60, "SMG to mark the killed worker")
        before = alive.rpc_count("VllmEngine.Generate")
        for i in range(8):  # every call succeeds, on the survivor
            ask(100 + i)
        assert alive.rpc_count("VllmEngine.Generate") == before + 8
    finally:
        gateway.close()
        for worker in workers:
            worker.close()


class ChatLoop:
    """Threads calling the gateway in a loop until stopped; every failure is recorded. Thread 0 streams
    long answers, so some are in flight on a worker when it drains."""

    def __init__(self, client: openai.OpenAI, model: str, num_threads: int) -> None:
        self._client = client
        self._model = model
        self._stop = threading.Event()
        self.failures: list[str] = []
        self.completed: list[float] = []  # finish times (time.monotonic())
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int) -> None:
        turn = 0
        while not self._stop.is_set():
            turn += 1
            messages = [{"role": "user", "content": f"thread {index} turn {turn}"}]
            try:
                if index == 0:
                    stream = self._client.chat.completions.create(
                        model=self._model,
                        messages=messages,
                        max_tokens=60,
                        stream=True,
                        extra_body={"ignore_eos": True},
                    )
                    finish = [c.choices[0].finish_reason for c in stream if c.choices]
                    finish = [f for f in finish if f]
                else:
                    response = self._client.chat.completions.create(
                        model=self._model, messages=messages, max_tokens=4, extra_body={"ignore_eos": True}
                    )
                    finish = [response.choices[0].finish_reason]
            except openai.OpenAIError as exc:
                self.failures.append(f"thread {index}: {type(exc).__name__}: {exc}")
                continue
            if finish != ["length"]:
                self.failures.append(f"thread {index}: finish reasons {finish}")
            self.completed.append(time.monotonic())

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)


def test_a_draining_worker_loses_no_call(llama_dir: str, tmp_path: Path) -> None:
    """SIGTERM drains a worker while calls flow through the gateway: its HealthCheck turns unhealthy at
    once (SMG stops routing to it), calls it refuses end UNAVAILABLE before any token (SMG retries
    them on the other worker), its streams in flight finish, and it exits 0: no call fails."""
    workers = [SluiceProcess(llama_dir, tmp_path / f"worker{i}.log") for i in range(2)]
    gateway = SmgGateway([w.url for w in workers], tmp_path / "smg.log")
    try:
        client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", timeout=120, max_retries=0)
        calls = ChatLoop(client, workers[0].model, num_threads=4)
        try:
            staying, leaving = workers
            wait_for(lambda: min(_generate_calls(workers)) >= 2, 120, "calls on both workers")
            leaving.terminate()
            signalled = time.monotonic()
            assert leaving.process.wait(timeout=60) == 0
            exited = time.monotonic()
            wait_for(lambda: sum(t > exited for t in calls.completed) >= 6, 120, "calls after the drain")
        finally:
            calls.stop()
        assert calls.failures == []
        assert sum(t > signalled for t in calls.completed) >= 6
        assert staying.process.poll() is None
    finally:
        gateway.close()
        for worker in workers:
            worker.close()
