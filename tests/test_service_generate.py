"""Generation over gRPC against the real engine: streamed output equals the offline engine's, alone
and under 50-way concurrency on Generate and on one StreamGenerate stream (interleaved with a request
that runs the whole time). No test counts chunks: how many deltas a reader finds merged depends on
the machine's speed."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections import defaultdict

import grpc
import pytest
from checkpoints import EOS_ID, IM_END_ID, LONG_CONTEXT
from service_harness import LONG_NUM_BLOCKS, PATIENCE_S, UNENDING, ServerThread

from sluice import AsyncClient, Client, SluiceError, generate_request
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.v1 import sluice_pb2 as pb

PROMPTS = [
    f"{word} number {i}" for i, word in enumerate(["Hello", "The quick", "Café", "def add", "Emoji"] * 2)
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llm(llama_long_dir: str) -> LLM:
    """The offline engine on the server's checkpoint."""
    return LLM(llama_long_dir, num_blocks=128, attention_backend="torch")


@pytest.fixture(scope="module")
def alone(llm: LLM) -> dict[str, tuple[str, list[int]]]:
    """Each prompt's greedy output when it runs alone in the offline engine."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {p: ((c := llm.generate(p, params)[0]).text, c.token_ids) for p in PROMPTS}


def _greedy(text: str, **kwargs: object) -> pb.GenerateRequest:
    return generate_request(text, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def test_generate_streams_what_the_offline_engine_produces(stub, llm: LLM) -> None:
    prompt = "The quick brown fox jumps"
    expected = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12))[0]
    chunks = list(stub.Generate(generate_request(prompt, temperature=0.0, max_tokens=12, request_id="r-1")))
    assert "".join(c.text for c in chunks) == expected.text
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    # However many chunks a fast engine merged the tokens into (one, on a fast machine): each names the
    # request, and only the last finishes and carries usage.
    assert all(c.request_id == "r-1" for c in chunks)
    *deltas, last = chunks
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not c.HasField("usage") for c in deltas)
    assert pb.FinishReason.Name(last.finish_reason) == f"FINISH_REASON_{expected.finish_reason.upper()}"
    prompt_ids = llm.tokenizer.encode(prompt)
    assert last.usage == pb.Usage(
        prompt_tokens=len(prompt_ids),
        completion_tokens=len(expected.token_ids),
        prompt_tokens_computed=len(prompt_ids),
    )
    timings = last.timings
    assert 0.0 <= timings.queue_seconds <= timings.ttft_seconds <= timings.total_seconds


def test_chat_messages_use_the_chat_template(server: ServerThread, llm: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    expected = llm.chat([messages], SamplingParams(temperature=0.0, max_tokens=10))[0]
    with Client(server.target) as client:
        completion = client.complete(generate_request(messages=messages, temperature=0.0, max_tokens=10))
    assert (completion.text, completion.token_ids) == (expected.text, expected.token_ids)
    assert completion.usage.prompt_tokens == len(llm.tokenizer.encode_chat(messages))


def test_token_ids_prompt_with_logprobs(stub, llm: LLM) -> None:
    prompt_ids = [5, 17, 42, 99, 200, 311]
    request = generate_request(
        token_ids=prompt_ids, temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True
    )
    chunks = list(stub.Generate(request))
    expected = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    token_ids = [t for c in chunks for t in c.token_ids]
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert token_ids == expected.token_ids
    assert [lp.sampled.token_id for lp in logprobs] == token_ids
    for lp in logprobs:  # greedy: the sampled token is the most likely one
        assert len(lp.top) == 3 and lp.top[0].token_id == lp.sampled.token_id
        assert lp.top[0].logprob == pytest.approx(lp.sampled.logprob)
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob


def test_stop_token_reports_stop_reason(stub, alone) -> None:
    prompt = PROMPTS[0]
    text, token_ids = alone[prompt]
    stop_id = token_ids[2]
    chunks = list(stub.Generate(_greedy(prompt, stop_token_ids=[stop_id])))
    assert [t for c in chunks for t in c.token_ids] == token_ids[: token_ids.index(stop_id) + 1]
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP and chunks[-1].stop_token_id == stop_id


def test_tokenize_and_model_info(server: ServerThread, llm: LLM) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with Client(server.target) as client:
        assert client.tokenize("Hello world") == llm.tokenizer.encode("Hello world")
        no_special = llm.tokenizer.encode("Hello world", add_special_tokens=False)
        assert client.tokenize("Hello world", add_special_tokens=False) == no_special
        assert client.tokenize(messages=messages) == llm.tokenizer.encode_chat(messages)
        chat = llm.tokenizer.encode_chat(messages)
        assert client.tokenize(messages=messages, add_special_tokens=False) == chat
        with pytest.raises(SluiceError) as refused:  # it was ignored: vLLM would add a second BOS
            client.tokenize(messages=messages, add_special_tokens=True)
        assert (refused.value.code, refused.value.message) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "add_special_tokens: applies to text prompts: a chat's template writes its special tokens",
        )
        info = client.model_info()
    assert (info.architecture, info.max_model_len, info.vocab_size) == ("LlamaForCausalLM", LONG_CONTEXT, 512)
    assert sorted(info.eos_token_ids) == sorted({EOS_ID, IM_END_ID})
    assert (info.block_size, info.num_kv_blocks) == (16, LONG_NUM_BLOCKS)
    assert info.kv_capacity_tokens == 16 * LONG_NUM_BLOCKS
    assert (info.max_num_batched_tokens, info.max_num_seqs) == (512, 64)  # the scheduler's, as configured


def test_fifty_concurrent_generate_streams(server: ServerThread, alone) -> None:
    prompts = PROMPTS * 5

    async def run_all() -> list:
        async with AsyncClient(server.target) as client:
            return await asyncio.gather(*(client.complete(_greedy(p)) for p in prompts))

    completions = asyncio.run(run_all())
    for prompt, completion in zip(prompts, completions, strict=True):
        assert (completion.text, completion.token_ids) == alone[prompt], prompt
        assert completion.finish_reason == pb.FINISH_REASON_LENGTH
    server.wait_idle()


def test_leaving_an_async_stream_early_cancels_its_call(server: ServerThread) -> None:
    """As with the blocking client: closing AsyncClient.generate's iterator after its first chunk cancels
    the call, and the server aborts the request (an UNENDING one: only that ends it) and frees its blocks
    while the client's channel stays open."""

    async def first_chunk_then_idle() -> pb.GenerateResponse:
        async with AsyncClient(server.target) as client:
            chunks = client.generate(generate_request("Hello world", **UNENDING))
            first = await anext(chunks)
            await chunks.aclose()
            await asyncio.to_thread(server.wait_idle)
            return first

    assert asyncio.run(first_chunk_then_idle()).token_ids


def test_fifty_requests_interleaved_on_one_bidi_stream(stub, server: ServerThread, alone) -> None:
    """A request that runs the whole time ("hold") shares the stream with 50 short ones and a bad one: its
    first chunk comes before theirs and its last (aborted in-band once all 50 finished) after them."""
    prompts = PROMPTS * 5
    messages = [
        pb.StreamGenerateRequest(generate=_greedy(p, request_id=f"req-{i}")) for i, p in enumerate(prompts)
    ]
    bad = generate_request("x", request_id="bad", top_p=0.0)
    messages.insert(25, pb.StreamGenerateRequest(generate=bad))
    outbox: queue.Queue[pb.StreamGenerateRequest | None] = queue.Queue()
    outbox.put(pb.StreamGenerateRequest(generate=generate_request("hold", request_id="hold", **UNENDING)))
    hold_started, all_finished = threading.Event(), threading.Event()

    def requests():
        while (message := outbox.get()) is not None:
            yield message

    chunks: dict[str, list[pb.GenerateResponse]] = defaultdict(list)
    errors: dict[str, pb.RequestError] = {}
    order: list[str] = []

    def send_the_fifty_then_end_hold() -> None:
        assert hold_started.wait(PATIENCE_S), "the held request streamed nothing"
        for message in messages:
            outbox.put(message)
        assert all_finished.wait(PATIENCE_S), "the fifty requests did not finish"
        outbox.put(pb.StreamGenerateRequest(cancel=pb.StreamCancel(request_id="hold")))
        outbox.put(None)  # half-close

    sender = threading.Thread(target=send_the_fifty_then_end_hold, daemon=True)
    sender.start()
    for response in stub.StreamGenerate(requests(), timeout=PATIENCE_S):
        if response.WhichOneof("event") == "error":
            errors[response.request_id] = response.error
            continue
        chunks[response.request_id].append(response.chunk)
        order.append(response.request_id)
        hold_started.set()
        finished = sum(c[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED for c in chunks.values())
        if finished == 50 and chunks["hold"][-1].finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            all_finished.set()
    sender.join(PATIENCE_S)
    assert errors == {
        "bad": pb.RequestError(
            code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="top_p: must be in (0, 1]"
        )
    }
    hold = chunks.pop("hold")
    assert len(chunks) == 50
    for i, prompt in enumerate(prompts):
        got = chunks[f"req-{i}"]
        assert ("".join(c.text for c in got), [t for c in got for t in c.token_ids]) == alone[prompt]
        assert got[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert all(c.request_id == f"req-{i}" for c in got)
    # The held request streamed before any of the fifty and ended after all of them: they interleaved.
    assert order[0] == "hold" and order[-1] == "hold"
    assert hold[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in hold[:-1])
    assert 0 < hold[-1].usage.completion_tokens < UNENDING["max_tokens"]
    server.wait_idle()


def test_tokenize_answers_as_the_tokenizer_and_takes_long_prompts_off_the_event_loop(
    stub, server: ServerThread, llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Text or messages over TOKENIZE_INLINE_MAX_CHARS (4096) are tokenized in a worker thread, where the
    tokenizer releases the GIL; shorter ones on the server's event loop."""
    tokenizer, threads = server.engine.tokenizer, []
    encode = tokenizer.encode

    def spy(*args: object, **kwargs: object) -> list[int]:
        threads.append(threading.current_thread())
        return encode(*args, **kwargs)

    short, long = "Hello world", "Hello world " * 400
    conversation = [{"role": "user", "content": long}]
    expected = [
        llm.tokenizer.encode(short),
        llm.tokenizer.encode(long),
        llm.tokenizer.encode_chat(conversation),
    ]
    monkeypatch.setattr(tokenizer, "encode", spy)
    answers = [
        stub.Tokenize(pb.TokenizeRequest(text=short)),
        stub.Tokenize(pb.TokenizeRequest(text=long)),
        stub.Tokenize(
            pb.TokenizeRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(**conversation[0])]))
        ),
    ]
    assert [list(a.token_ids) for a in answers] == expected
    loop_thread = server.call(_current_thread())
    assert [t is loop_thread for t in threads] == [True, False, False]


def test_a_chat_long_in_its_tools_or_tool_calls_renders_off_the_event_loop(
    stub, server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the messages' contents were counted: a chat of short messages with 200 tools' schemas (an
    agent's), or a call's long arguments, rendered and tokenized on the event loop every stream shares."""
    tokenizer, threads = server.engine.tokenizer, []
    encode = tokenizer.encode

    def spy(*args: object, **kwargs: object) -> list[int]:
        threads.append(threading.current_thread())
        return encode(*args, **kwargs)

    long = "x " * 2100
    user = pb.ChatMessage(role="user", content="hi")
    call = pb.ToolCall(name="note", arguments=json.dumps({"text": long}), id="abcdefghi")
    chats = [
        pb.ChatMessages(messages=[user]),
        pb.ChatMessages(messages=[user], tools=[pb.Tool(name="note", description=long)]),
        pb.ChatMessages(
            messages=[
                user,
                pb.ChatMessage(role="assistant", tool_calls=[call]),
                pb.ChatMessage(role="tool", content="ok", tool_call_id="abcdefghi"),
            ]
        ),
    ]
    monkeypatch.setattr(tokenizer, "encode", spy)
    for chat in chats:
        stub.Tokenize(pb.TokenizeRequest(messages=chat))
    loop_thread = server.call(_current_thread())
    assert [t is loop_thread for t in threads] == [True, False, False]


async def _current_thread() -> threading.Thread:
    return threading.current_thread()
