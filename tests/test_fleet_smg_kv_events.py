"""VllmEngine.SubscribeKvEvents on a real Sluice server started with KV events (`sluice serve --kv-events`),
called through smg-grpc-proto's stubs as SMG's gateway calls it: the blocks a request's prompt filled
arrive as stored events with their token ids and chained hashes, batches are numbered without a gap, a
subscriber resumes from its cursor, a cursor the server cannot replay is OUT_OF_RANGE, every batch
carries the engine's load (with the core's silence while requests are live and the prefill in hand) and
load_only records come between them, and the stream ends UNAVAILABLE when the engine stops. (The events'
agreement with the pool's cache, evictions included, is checked every step by tests/test_kv_fuzz.py.)"""

from __future__ import annotations

import queue
import threading

import grpc
import pytest
from service_harness import PATIENCE_S, UNENDING, ServerThread, long_engine_config, tiny_engine_config
from smg_grpc_proto import vllm_engine_pb2 as smg
from smg_grpc_proto import vllm_engine_pb2_grpc as smg_grpc
from smg_grpc_proto.generated import common_pb2

pytestmark = pytest.mark.timeout(300)

BLOCK_SIZE = 16  # tiny_engine_config's


class Subscriber(threading.Thread):
    """Reads one SubscribeKvEvents stream into a queue; `code` is how it ended."""

    def __init__(self, stub: smg_grpc.VllmEngineStub, cursor: int = 0, early_loads: bool = False) -> None:
        super().__init__(daemon=True)
        request = common_pb2.SubscribeKvEventsRequest(
            start_sequence_number=cursor, load_records_before_first_batch=early_loads
        )
        self.call = stub.SubscribeKvEvents(request)
        self.batches: queue.Queue[common_pb2.KvEventBatch] = queue.Queue()
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.call.initial_metadata()  # the server sends it at once: the subscription is in place
        self.start()

    def run(self) -> None:
        try:
            for batch in self.call:
                self.batches.put(batch)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            self.code, self.details = error.code(), error.details()

    def next_batch(self, load_only: bool = False) -> common_pb2.KvEventBatch:
        """The next batch of events (or the next batch of any kind, load_only ones included)."""
        while True:
            batch = self.batches.get(timeout=PATIENCE_S)
            if load_only or not batch.load.load_only:
                return batch

    def stored_until(self, token_ids: list[int]) -> list[common_pb2.KvEventBatch]:
        """Batches up to the one whose stored blocks complete a chain, from a sequence's first block,
        holding `token_ids`'s full blocks."""
        batches: list[common_pb2.KvEventBatch] = []
        chains: dict[int, list[int]] = {}  # block hash -> the tokens of its chain, through it
        wanted = token_ids[: len(token_ids) // BLOCK_SIZE * BLOCK_SIZE]
        while not any(chain[: len(wanted)] == wanted for chain in chains.values()):
            batches.append(self.next_batch())
            for event in batches[-1].events:
                if event.WhichOneof("data") != "stored":
                    continue
                parent = (
                    event.stored.parent_block_hash if event.stored.HasField("parent_block_hash") else None
                )
                chain = [] if parent is None else chains.get(parent)
                for block in event.stored.blocks if chain is not None else ():
                    chain = chain + list(block.token_ids)
                    chains[block.block_hash] = chain
        return batches


@pytest.fixture(scope="module")
def server(llama_dir: str):
    thread = ServerThread(tiny_engine_config(llama_dir), kv_events=True).start()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def stub(server: ServerThread):
    with server.channel() as channel:
        yield smg_grpc.VllmEngineStub(channel)


def _generate(stub: smg_grpc.VllmEngineStub, request_id: str, prompt: list[int], max_tokens: int = 3) -> None:
    request = smg.GenerateRequest(
        request_id=request_id,
        tokenized=smg.TokenizedInput(input_ids=prompt),
        sampling_params=smg.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    responses = list(stub.Generate(request, timeout=PATIENCE_S))
    assert responses[-1].complete.finish_reason == "length"


def test_a_prompts_blocks_arrive_as_stored_events_with_chained_hashes(stub) -> None:
    subscriber = Subscriber(stub)
    prompt = [(7 * i + 3) % 400 + 10 for i in range(2 * BLOCK_SIZE + 5)]  # two full blocks, and some
    _generate(stub, "chained", prompt)
    batches = [batch for batch in subscriber.stored_until(prompt) if not batch.HasField("snapshot")]
    numbers = [b.sequence_number for b in batches]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))) and numbers[0] >= 1
    events = [e for b in batches for e in b.events]
    ids = [e.event_id for e in events]
    assert ids == list(range(ids[0], ids[0] + len(ids))) and ids[0] >= 1
    stored = [e.stored for e in events if e.WhichOneof("data") == "stored"]
    blocks = [block for event in stored for block in event.blocks]
    assert [list(b.token_ids) for b in blocks[:2]] == [
        prompt[:BLOCK_SIZE],
        prompt[BLOCK_SIZE : 2 * BLOCK_SIZE],
    ]
    assert {b.block_size for b in blocks} == {BLOCK_SIZE}
    assert not stored[0].HasField("parent_block_hash")  # the prompt's first block starts the chain
    # The second block names the first as its parent: in the same event, or as its parent_block_hash.
    parents = {}
    for event in stored:
        previous = event.parent_block_hash if event.HasField("parent_block_hash") else None
        for block in event.blocks:
            parents[block.block_hash] = previous
            previous = block.block_hash
    assert parents[blocks[1].block_hash] == blocks[0].block_hash
    assert stored[0].tier == common_pb2.KV_CACHE_TIER_DEVICE
    subscriber.call.cancel()


def test_a_new_subscriber_first_gets_a_snapshot_of_what_is_cached(stub) -> None:
    prompt = [(5 * i + 2) % 400 + 10 for i in range(3 * BLOCK_SIZE + 1)]
    watcher = Subscriber(stub)
    _generate(stub, "snapshot", prompt)
    last = watcher.stored_until(prompt)[-1].sequence_number
    watcher.call.cancel()
    late = Subscriber(stub)  # cursor 0: the cache as it is, then live
    snapshot = late.stored_until(prompt)
    assert all(batch.HasField("snapshot") for batch in snapshot)
    chunk = snapshot[0].snapshot
    assert (chunk.index, chunk.count, chunk.unknown_before) == (0, len(snapshot), 0)
    assert snapshot[0].events[0].WhichOneof("data") == "cleared"
    assert [b.sequence_number for b in snapshot] == list(range(last - len(snapshot) + 1, last + 1))
    stored = [e.stored for b in snapshot for e in b.events if e.WhichOneof("data") == "stored"]
    assert len(stored) == chunk.blocks and all(len(event.blocks) == 1 for event in stored)
    assert {e.event_id for b in snapshot for e in b.events} == {0}  # made up, not recorded
    _generate(stub, "after-snapshot", [(3 * i + 7) % 400 + 10 for i in range(BLOCK_SIZE + 1)])
    live = late.next_batch()
    assert live.sequence_number == last + 1  # live, without a gap
    assert live.events[0].event_id == 1  # the stream's first recorded event
    late.call.cancel()


def test_a_subscriber_resumes_after_its_cursor_and_an_unreplayable_cursor_is_out_of_range(stub) -> None:
    first = Subscriber(stub)
    prompt_a = [(11 * i + 5) % 400 + 10 for i in range(BLOCK_SIZE + 1)]
    _generate(stub, "resume-a", prompt_a)
    cursor = first.stored_until(prompt_a)[-1].sequence_number
    first.call.cancel()
    prompt_b = [(13 * i + 1) % 400 + 10 for i in range(BLOCK_SIZE + 1)]
    _generate(stub, "resume-b", prompt_b)  # while nobody listens
    resumed = Subscriber(stub, cursor)
    batches = resumed.stored_until(prompt_b)  # replayed from the history
    assert batches[0].sequence_number == cursor + 1
    resumed.call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        next(iter(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=10**9))))
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert info.value.details().startswith("start_sequence_number: cursor 1000000000 is past the last batch")


def test_the_stream_ends_unavailable_when_the_engine_stops(llama_dir: str) -> None:
    thread = ServerThread(tiny_engine_config(llama_dir), kv_events=True).start()
    try:
        with thread.channel() as channel:
            subscriber = Subscriber(smg_grpc.VllmEngineStub(channel))
            thread.call(thread.engine.shutdown())
            subscriber.join(PATIENCE_S)
            assert subscriber.code == grpc.StatusCode.UNAVAILABLE, subscriber.details
            assert subscriber.details == "the engine stopped: the engine shut down"
    finally:
        thread.stop()


def test_every_batch_carries_the_engines_load_and_load_only_records_come_between(llama_long_dir: str) -> None:
    thread = ServerThread(long_engine_config(llama_long_dir), kv_events=True).start()
    try:
        with thread.channel() as channel:
            stub = smg_grpc.VllmEngineStub(channel)
            early = Subscriber(stub, early_loads=True)
            plain = Subscriber(stub)
            info = thread.engine.model_info
            # Before the engine's first batch: records numbered 0, for the subscriber that asked only.
            first = early.next_batch(load_only=True)
            assert (first.sequence_number, first.load.load_only, len(first.events)) == (0, True, 0)
            assert (first.load.running_requests, first.load.waiting_requests, first.load.sample) == (0, 0, 1)
            assert first.load.max_running_requests == info.max_num_seqs > 0
            assert first.load.max_total_num_tokens == info.kv_capacity_tokens  # telemetry: first record
            # The core reports every step; with no request live there is no silence to report.
            assert first.load.engine_reports_steps and not first.load.HasField("engine_silence_ms")
            assert first.load.HasField("prefill_pending_tokens") and first.load.prefill_pending_tokens == 0
            heartbeat = early.next_batch(load_only=True)  # nothing happens: the record repeats
            assert (heartbeat.sequence_number, heartbeat.load.load_only, heartbeat.load.sample) == (
                0,
                True,
                2,
            )

            prompt = [(17 * i + 3) % 400 + 10 for i in range(BLOCK_SIZE + 1)]
            request = smg.GenerateRequest(
                request_id="loaded",
                tokenized=smg.TokenizedInput(input_ids=prompt),
                # Running until cancelled: a request of a few hundred tokens could end before the batch
                # that reports it, on a fast machine or behind a stalled frontend.
                sampling_params=smg.SamplingParams(**UNENDING),
                stream=True,
            )
            call = stub.Generate(request, timeout=PATIENCE_S)
            next(call)  # running
            batch = plain.next_batch(load_only=True)
            assert batch.sequence_number >= 1 and not batch.load.load_only and len(batch.events) > 0
            assert (batch.load.sample, batch.load.running_requests) == (1, 1)
            assert batch.load.max_total_num_tokens == info.kv_capacity_tokens and batch.load.token_usage > 0
            assert batch.load.HasField("engine_silence_ms")  # a request is live
            call.cancel()
            # The request's end changes the load without a KV event: a load_only record says so,
            # repeating the last sequence number sent.
            last_sequence, last_sample = batch.sequence_number, batch.load.sample
            while True:
                batch = plain.next_batch(load_only=True)
                assert batch.HasField("load") and batch.load.sample == last_sample + 1
                last_sample = batch.load.sample
                if batch.load.load_only:
                    assert batch.sequence_number == last_sequence and not batch.events
                else:
                    assert batch.sequence_number == last_sequence + 1
                    last_sequence = batch.sequence_number
                if batch.load.running_requests == 0:
                    break
            assert batch.load.max_total_num_tokens == info.kv_capacity_tokens or not batch.load.load_only
            early.call.cancel()
            plain.call.cancel()
    finally:
        thread.stop()


def test_a_waiting_requests_tokens_and_the_generation_rate_are_in_the_load(llama_long_dir: str) -> None:
    # One request runs at a time: the second waits, with its prompt yet to compute.
    thread = ServerThread(long_engine_config(llama_long_dir, max_num_seqs=1), kv_events=True).start()
    try:
        with thread.channel() as channel:
            stub = smg_grpc.VllmEngineStub(channel)
            subscriber = Subscriber(stub, early_loads=True)

            def stream(request_id: str, prompt: list[int]):
                sampling = smg.SamplingParams(**UNENDING)
                request = smg.GenerateRequest(
                    request_id=request_id,
                    tokenized=smg.TokenizedInput(input_ids=prompt),
                    sampling_params=sampling,
                    stream=True,
                )
                return stub.Generate(request, timeout=PATIENCE_S)

            running = stream("running", [11, 12, 13])
            next(running)
            waiting = stream("waiting", list(range(20, 57)))  # 37 tokens
            while (load := subscriber.next_batch(load_only=True).load).waiting_requests != 1:
                pass
            assert (load.running_requests, load.waiting_uncached_tokens) == (1, 37)
            # The waiting request has had no output: its prompt is the prefill in hand (the running one's
            # was answered); requests are live, so the engine's silence is reported.
            assert load.prefill_pending_tokens == 37 and load.HasField("engine_silence_ms")
            while subscriber.next_batch(load_only=True).load.gen_throughput <= 0:
                pass  # measured over a quarter of a second at least: a few records on
            polled = stub.GetLoads(smg.GetLoadsRequest(), timeout=PATIENCE_S).loads[0]
            assert (polled.num_waiting_reqs, polled.num_waiting_uncached_tokens) == (1, 37)
            assert polled.gen_throughput > 0 and polled.max_running_requests == 1
            waiting.cancel()
            running.cancel()
            subscriber.call.cancel()
    finally:
        thread.stop()
