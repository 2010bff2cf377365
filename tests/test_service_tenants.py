"""Tenants (`--api-keys`): the key names the tenant; tenants share no prefix-cache blocks unless given
the same scope, cannot get ahead of their max_priority (clamped), cannot abort each other's requests,
get RESOURCE_EXHAUSTED with a `grpc-retry-pushback-ms` trailer over their limits, and read the KV event
stream (the blocks of their own prefix-cache scope) only with `kv_events = true`."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from service_harness import PATIENCE_S, UNENDING, ServerThread, long_engine_config, wait_for
from smg_grpc_proto import vllm_engine_pb2_grpc as smg_grpc
from smg_grpc_proto.generated import common_pb2

from sluice import Client, SluiceError, generate_request
from sluice.service.serve_command import configure, server_config
from sluice.service.server import ServerConfig
from sluice.service.tenant_limits import TenantLimiter, TenantOverLimitError
from sluice.service.tenants import KEY_FORM, Tenant, TenantDirectory
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(120)

KEYS_TOML = """
[[tenant]]
name = "alpha"
keys = ["key-alpha"]

[[tenant]]
name = "beta"
keys = ["key-beta", "key-beta-2"]

[[tenant]]
name = "gamma"
keys = ["key-gamma"]
prefix_cache_scope = "shared"

[[tenant]]
name = "delta"
keys = ["key-delta"]
prefix_cache_scope = "shared"

[[tenant]]
name = "batch"
keys = ["key-batch"]
max_priority = 10

[[tenant]]
name = "small"
keys = ["key-small"]
max_concurrent_requests = 1

[[tenant]]
name = "slow"
keys = ["key-slow"]
requests_per_second = 0.01
burst = 1

[[tenant]]
name = "gateway"
keys = ["key-gateway"]
kv_events = true
"""
PUSHBACK = "grpc-retry-pushback-ms"


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys.toml"
    path.write_text(KEYS_TOML)
    return path


@pytest.fixture(scope="module")
def tenant_server(llama_long_dir: str, keys_file: Path):
    """One sequence runs at a time, so requests queue behind one that runs until the test ends it."""
    config = ServerConfig(host="127.0.0.1", port=0, tenants=TenantDirectory.load(keys_file))
    engine_config = long_engine_config(llama_long_dir, max_num_seqs=1)
    thread = ServerThread(engine_config, config, kv_events=True).start()
    yield thread
    thread.stop()


def _client(server: ServerThread, key: str) -> Client:
    return Client(server.target, api_key=key)


def _stub_call(server: ServerThread, key: str, request: pb.GenerateRequest) -> grpc.RpcError:
    """The error of a Generate call made with a raw stub (to read its trailers)."""
    with server.channel() as channel:
        call = server.stub(channel).Generate(request, metadata=(("authorization", f"Bearer {key}"),))
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    return info.value


def test_tenants_share_no_cache_blocks_unless_given_the_same_scope(tenant_server: ServerThread) -> None:
    prompt = list(range(10, 50))  # 40 tokens: 2 full blocks of 16 can be cached

    def cached(key: str) -> int:
        with _client(tenant_server, key) as client:
            request = generate_request(token_ids=prompt, temperature=0.0, max_tokens=2)
            return client.complete(request).usage.cached_tokens

    assert cached("key-alpha") == 0
    assert cached("key-alpha") == 32  # the cache works within a tenant
    assert cached("key-beta") == 0  # same prompt, other tenant: nothing shared
    assert cached("key-beta-2") == 32  # another key of the same tenant shares
    assert cached("key-gamma") == 0
    assert cached("key-delta") == 32  # gamma and delta have one prefix_cache_scope
    tenant_server.wait_idle()


def _start(server: ServerThread, key: str, request: pb.GenerateRequest):
    """A Generate call that starts at once (a stub's; the client's generate() starts when first read)."""
    channel = server.channel()
    call = server.stub(channel).Generate(request, metadata=(("authorization", f"Bearer {key}"),))
    return channel, call


def test_priority_is_clamped_to_the_tenants_max_priority(tenant_server: ServerThread) -> None:
    """One sequence runs at a time. Behind a running request, batch asks for priority 0 but waits at 10,
    so alpha's priority 5 request, queued after it, runs first: when alpha's first chunk comes, batch is
    still waiting (had batch run first, its 32 tokens would have finished before alpha started)."""
    server = tenant_server
    with _client(server, "key-alpha") as client:
        occupier = client.generate(generate_request("Hello", request_id="occupier", **UNENDING))
        next(occupier)
        batch_request = generate_request("queued", priority=0, temperature=0.0, max_tokens=32)
        batch_channel, batch = _start(server, "key-batch", batch_request)
        wait_for(lambda: server.stats().num_waiting == 1, "batch's request waiting")
        alpha_request = generate_request("queued", request_id="alpha", priority=5, **UNENDING)
        alpha_channel, alpha = _start(server, "key-alpha", alpha_request)
        wait_for(lambda: server.stats().num_waiting == 2, "both requests waiting")
        client.abort("occupier")
        assert list(occupier)[-1].finish_reason == pb.FINISH_REASON_ABORT
        assert next(alpha).token_ids  # alpha runs: the one sequence is its
        stats = server.stats()
        assert (stats.num_running, stats.num_waiting) == (1, 1)  # batch still waits
        client.abort("alpha")
        assert list(alpha)[-1].finish_reason == pb.FINISH_REASON_ABORT
        batch_chunks = list(batch)
        assert batch_chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(c.token_ids) for c in batch_chunks) == 32
        batch_channel.close()
        alpha_channel.close()
    server.wait_idle()


def test_a_tenant_cannot_abort_another_tenants_request(tenant_server: ServerThread) -> None:
    """alpha's job-1 waits behind a request that runs until the test aborts it, so it is surely live
    when beta tries to abort it; afterwards it runs to its length."""
    with _client(tenant_server, "key-alpha") as alpha, _client(tenant_server, "key-beta") as beta:
        occupier = alpha.generate(generate_request("Hello", request_id="occupier", **UNENDING))
        next(occupier)
        job = generate_request("Hello", request_id="job-1", temperature=0.0, max_tokens=24, ignore_eos=True)
        job_channel, job_chunks = _start(tenant_server, "key-alpha", job)
        wait_for(lambda: tenant_server.stats().num_waiting == 1, "job-1 waiting")
        with pytest.raises(SluiceError) as info:
            beta.abort("job-1")
        assert (info.value.code, info.value.message) == (
            grpc.StatusCode.NOT_FOUND,
            "request_id: no request with id 'job-1'",
        )
        alpha.abort("occupier")
        rest = list(job_chunks)  # beta's Abort did not touch it: it runs to its length
        assert (rest[-1].finish_reason, rest[-1].usage.completion_tokens) == (pb.FINISH_REASON_LENGTH, 24)
        job_channel.close()
        assert list(occupier)[-1].finish_reason == pb.FINISH_REASON_ABORT
        # Ids are per tenant: gamma may use the same id. (Beta's own "job-1" is cancelled at once:
        # its Abort above is remembered, see test_service_abort.)
        with _client(tenant_server, "key-gamma") as gamma:
            request = generate_request("Hi", request_id="job-1", temperature=0.0, max_tokens=1)
            assert gamma.complete(request).finish_reason == pb.FINISH_REASON_LENGTH
        early = beta.complete(generate_request("Hi", request_id="job-1", max_tokens=1))
        assert (early.finish_reason, early.usage) == (pb.FINISH_REASON_ABORT, None)  # it never ran
    tenant_server.wait_idle()


def test_only_a_tenant_given_kv_events_may_subscribe_to_them_and_sees_its_own_scope(
    tenant_server: ServerThread,
) -> None:
    """The gateway tenant's subscription gets its own prompt's stored blocks and not alpha's, which no
    request of the gateway's can hit (SMG, hashing token ids alone, routed the gateway's copy of alpha's
    prompt to a worker that computed it again); alpha itself, like every tenant without
    `kv_events = true`, is PERMISSION_DENIED before anything is sent."""
    alpha_prompt = list(range(200, 240))  # 2 full blocks of 16
    own_prompt = list(range(300, 340))
    with tenant_server.channel() as channel:
        stub = smg_grpc.VllmEngineStub(channel)
        request = common_pb2.SubscribeKvEventsRequest(start_sequence_number=0)
        with pytest.raises(grpc.RpcError) as info:
            next(stub.SubscribeKvEvents(request, metadata=(("authorization", "Bearer key-alpha"),)))
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "SubscribeKvEvents: tenant 'alpha' may not read KV events (kv_events = true in its [[tenant]] "
            "table)",
        )
        call = stub.SubscribeKvEvents(
            request, metadata=(("authorization", "Bearer key-gateway"),), timeout=PATIENCE_S
        )
        call.initial_metadata()  # sent once the subscription is in place
        # alpha's blocks are stored (a step) before the gateway's request is sent.
        for key, prompt in (("key-alpha", alpha_prompt), ("key-gateway", own_prompt)):
            with _client(tenant_server, key) as client:
                client.complete(generate_request(token_ids=prompt, temperature=0.0, max_tokens=1))
        stored: list[int] = []
        for batch in call:
            for event in batch.events:
                if event.WhichOneof("data") == "stored":
                    stored += [t for block in event.stored.blocks for t in block.token_ids]
            if own_prompt[:32] == stored[-32:]:
                break
        call.cancel()
        assert stored == own_prompt[:32]
    tenant_server.wait_idle()


def test_over_the_concurrency_limit_is_resource_exhausted_with_pushback(tenant_server: ServerThread) -> None:
    rejected = tenant_server.server.metrics.registry.get_sample_value
    before = rejected("sluice_tenant_rejected_requests_total", {"tenant": "small"}) or 0.0
    with _client(tenant_server, "key-small") as client:
        running = client.generate(generate_request("Hello", **UNENDING))
        next(running)
        error = _stub_call(tenant_server, "key-small", generate_request("more", max_tokens=2))
        assert (error.code(), error.details()) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "tenant 'small' has 1 requests running, its max_concurrent_requests; retry in 500 ms",
        )
        assert dict(error.trailing_metadata())[PUSHBACK] == "500"
        with pytest.raises(SluiceError) as info:  # the client's error keeps the trailer
            client.complete(generate_request("more", max_tokens=2))
        assert (info.value.code, info.value.retry_pushback_ms) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 500)
        assert info.value.trailing_metadata[PUSHBACK] == "500"
        # Another tenant is not limited by small's requests: beta's is admitted and waits for the one
        # sequence, which small's request holds until the test closes it.
        beta_channel, beta = _start(tenant_server, "key-beta", generate_request("x", max_tokens=1))
        wait_for(lambda: tenant_server.stats().num_waiting == 1, "beta's request waiting")
        running.close()
        assert list(beta)[-1].usage.completion_tokens == 1
        beta_channel.close()
    tenant_server.wait_idle()
    assert rejected("sluice_tenant_rejected_requests_total", {"tenant": "small"}) == before + 2
    with _client(tenant_server, "key-small") as client:  # the slot is free again
        assert client.complete(generate_request("again", max_tokens=1)).usage.completion_tokens == 1


def test_over_the_rate_limit_is_resource_exhausted_with_pushback(tenant_server: ServerThread) -> None:
    with _client(tenant_server, "key-slow") as client:
        client.complete(generate_request("one", max_tokens=1))
    error = _stub_call(tenant_server, "key-slow", generate_request("two", max_tokens=1))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # One request per 100 s: the second is over the rate however long the first took.
    assert error.details().startswith("tenant 'slow' is over its rate of 0.01 requests/s; retry in ")
    pushback = int(dict(error.trailing_metadata())[PUSHBACK])
    assert 0 < pushback <= 100_000
    assert error.details() == f"tenant 'slow' is over its rate of 0.01 requests/s; retry in {pushback} ms"


def test_stream_requests_count_against_the_tenant_too(tenant_server: ServerThread) -> None:
    with _client(tenant_server, "key-small") as client:
        requests = [
            pb.StreamGenerateRequest(generate=generate_request("a", request_id="a", **UNENDING)),
            pb.StreamGenerateRequest(generate=generate_request("b", request_id="b", max_tokens=1)),
            pb.StreamGenerateRequest(cancel=pb.StreamCancel(request_id="a")),
        ]
        responses = list(client.stream_generate(iter(requests)))
    errors = [(r.request_id, r.error.code) for r in responses if r.WhichOneof("event") == "error"]
    assert errors == [("b", grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])]
    tenant_server.wait_idle()


def test_a_stream_request_sent_on_its_predecessors_last_chunk_is_admitted(
    tenant_server: ServerThread,
) -> None:
    """'small' runs one request at a time. The next, of the same id, sent as the last chunk of the one
    before arrives, found the id in use or the slot still taken (the pump freed both only after the
    call had written that chunk): 8 of 100 such requests were refused, 79 of 200 for the id alone."""
    sent: queue.Queue[pb.GenerateRequest | None] = queue.Queue()

    def requests() -> Iterator[pb.StreamGenerateRequest]:
        while (request := sent.get()) is not None:
            yield pb.StreamGenerateRequest(generate=request)

    rounds, finished, errors = 20, 0, []
    sent.put(generate_request("hi", request_id="same", max_tokens=2))
    with _client(tenant_server, "key-small") as client:
        for response in client.stream_generate(requests()):
            if response.WhichOneof("event") == "error":
                errors.append(response.error.message)
                sent.put(None)  # no chunk comes for it: end the stream
            elif response.chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                finished += 1
                sent.put(
                    generate_request("hi", request_id="same", max_tokens=2) if finished < rounds else None
                )
    assert (errors, finished) == ([], rounds)
    tenant_server.wait_idle()


def test_an_abort_before_its_request_takes_no_slot_of_the_tenant(tenant_server: ServerThread) -> None:
    """Aborted before it came, a request ends at once with FINISH_REASON_ABORT; it took the tenant's one
    slot (RESOURCE_EXHAUSTED instead, while another ran) and a rate token."""
    with _client(tenant_server, "key-small") as client:
        running = client.generate(generate_request("Hello", **UNENDING))
        next(running)
        with pytest.raises(SluiceError):
            client.abort("early")  # NOT_FOUND: remembered, to end that request when it comes
        chunks = list(client.generate(generate_request("x", request_id="early", max_tokens=2)))
        assert chunks[-1].finish_reason == pb.FINISH_REASON_ABORT
        running.close()
    tenant_server.wait_idle()


def test_a_request_refused_for_a_full_queue_gives_its_rate_token_back(
    llama_long_dir: str, keys_file: Path
) -> None:
    """'slow' may send one request per 100 s. Refused because the server's queue was full (its load, not
    the tenant's), its retry after the pushback was refused again for the rate: the refusal had spent the
    token."""
    config = ServerConfig(host="127.0.0.1", port=0, tenants=TenantDirectory.load(keys_file))
    thread = ServerThread(long_engine_config(llama_long_dir, max_num_seqs=1), config, max_queue=1).start()
    try:
        with _client(thread, "key-alpha") as client:
            running = client.generate(generate_request("Hello", **UNENDING))
            next(running)
            waiting = client.generate(generate_request("wait", **UNENDING))
            wait_for(lambda: thread.stats().num_waiting == 1, "the second request waiting")
            error = _stub_call(thread, "key-slow", generate_request("full", max_tokens=1))
            assert error.details().startswith("the waiting queue is full")
            running.close()
            waiting.close()
        thread.wait_idle()
        with _client(thread, "key-slow") as client:
            assert client.complete(generate_request("retry", max_tokens=1)).usage.completion_tokens == 1
    finally:
        thread.stop()


# The keys file and the limiter without a server.


def test_keys_file_maps_keys_to_tenants(keys_file: Path) -> None:
    directory = TenantDirectory.load(keys_file)
    assert directory.tenant_for_key("key-beta-2").name == "beta"
    assert directory.tenant_for_key("key-beta") is directory.tenant_for_key("key-beta-2")
    assert directory.tenant_for_key("key-nobody") is None
    assert directory.tenant_for_key("") is None
    gamma = directory.tenant_for_key("key-gamma")
    assert gamma.cache_salt("") == directory.tenant_for_key("key-delta").cache_salt("")
    assert gamma.cache_salt("") != directory.tenant_for_key("key-alpha").cache_salt("")
    assert "key-" not in repr(directory)
    assert [t.name for t in directory.tenants if t.kv_events] == ["gateway"]  # tables default to false
    assert TenantDirectory.single_key("k").tenants[0].kv_events  # --api-key's one tenant may
    # A rate without a burst: the bucket holds a second's requests, at least one.
    assert Tenant(name="t", requests_per_second=3.0).burst == 3.0
    assert Tenant(name="t", requests_per_second=0.25).burst == 1.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[[tenant]]\nname = "a"\nkeys = ["secret-1"]\n[[tenant]]\nname = "b"\nkeys = ["secret-1"]\n',
            "keys: a key of tenant 'b' is also given elsewhere",
        ),
        (
            '[[tenant]]\nname = "a"\nkeys = ["k"]\n[[tenant]]\nname = "a"\nkeys = ["k2"]\n',
            "name: tenant 'a' is listed twice",
        ),
        ('[[tenant]]\nname = "a b"\nkeys = ["k"]\n', "name: 'a b' must match [A-Za-z0-9._-]{1,64}"),
        ('[[tenant]]\nname = "a"\nkeys = []\n', "keys: tenant 'a' needs one or more non-empty keys"),
        # Keys callers could never send as they are: the server strips the header's value, and gRPC
        # metadata is ASCII.
        *(
            (f'[[tenant]]\nname = "a"\nkeys = ["{key}"]\n', f"keys: a key of tenant 'a' is not {KEY_FORM}")
            for key in (" secret-1", "secret-1\\n", "secret-1\u00e9")
        ),
        (  # b's scope is a's by a's name: a would share its blocks without saying so
            '[[tenant]]\nname = "a"\nkeys = ["k"]\n[[tenant]]\nname = "b"\nkeys = ["k2"]\n'
            'prefix_cache_scope = "a"\n',
            "prefix_cache_scope: 'a' (tenant 'b') is the scope of tenant 'a' by its name",
        ),
        ('[[tenant]]\nname = "a"\nkeys = ["k"]\nmax_prio = 1\n', "max_prio: unknown tenant field"),
        ('[[tenant]]\nname = "a"\nkeys = ["k"]\nburst = 3\n', "burst: must be >= 1 and needs"),
        ('[[tenant]]\nname = "a"\nkeys = ["k"]\nrequests_per_second = 0\n', "requests_per_second: must be"),
        ('[[tenant]]\nname = "a"\nkeys = ["k"]\nmax_priority = "high"\n', "max_priority: must be an integer"),
        ('key = "k"\n', "api-keys: expected only [[tenant]] tables"),
        ("tenant = []\n", "tenant: the file lists no tenants"),
        ("tenant = [1]\n", "tenant: each [[tenant]] must be a table"),
        ('[[tenant]]\nkeys = ["k"]\n', "name: every tenant needs a name"),
        ('[[tenant]]\nname = "a"\n', "keys: tenant 'a' needs a list of keys"),
        ('[[tenant]]\nname = "a"\nkeys = "secret-1"\n', "keys: tenant 'a' needs a list of keys"),
        (
            '[[tenant]]\nname = "a"\nkeys = ["k"]\nmax_concurrent_requests = 0\n',
            "max_concurrent_requests: must be >= 1",
        ),
        (
            '[[tenant]]\nname = "a"\nkeys = ["k"]\nrequests_per_second = "9"\n',
            "requests_per_second: must be a number",
        ),
        ('[[tenant]]\nname = "a"\nkeys = ["k"]\nkv_events = "yes"\n', "kv_events: must be true or false"),
        (
            '[[tenant]]\nname = "a"\nkeys = ["k"]\nprefix_cache_scope = 5\n',
            "prefix_cache_scope: 5 must match [A-Za-z0-9._-]{1,64} (tenant 'a')",
        ),
        (
            '[[tenant]]\nname = "a"\nkeys = ["k"]\nprefix_cache_scope = "x\\u001fy"\n',
            "prefix_cache_scope: 'x\\x1fy' must match [A-Za-z0-9._-]{1,64} (tenant 'a')",
        ),
    ],
)
def test_bad_keys_files_are_refused_naming_the_field_never_the_key(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        TenantDirectory.load(path)
    assert str(info.value).startswith(message)
    assert "secret-1" not in str(info.value)


def test_serve_flags_build_the_tenant_directory(keys_file: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    configure(parser)
    config = server_config(parser.parse_args(["--api-keys", str(keys_file)]))
    assert config.tenant_directory().tenant_for_key("key-alpha").name == "alpha"
    args = parser.parse_args(["--api-keys", str(keys_file), "--api-key", "k"])
    with pytest.raises(ValueError, match="api-keys: give --api-key"):
        server_config(args)
    single = server_config(parser.parse_args(["--api-key", "k"])).tenant_directory()
    assert single.tenant_for_key("k") == Tenant() and single.tenant_for_key("x") is None
    assert config.grpc_options()[-2:] == [
        ("grpc.max_connection_age_ms", 300_000),
        ("grpc.max_connection_age_grace_ms", 3_600_000),
    ]
    no_age = server_config(parser.parse_args(["--max-connection-age", "0"])).grpc_options()
    assert not any(name.startswith("grpc.max_connection_age") for name, _ in no_age)


def test_token_bucket_refills_at_the_rate() -> None:
    now = [100.0]
    limiter = TenantLimiter(clock=lambda: now[0])
    tenant = Tenant(name="t", requests_per_second=2.0, burst=2)
    limiter.admit(tenant)()
    limiter.admit(tenant)()
    with pytest.raises(TenantOverLimitError) as info:
        limiter.admit(tenant)
    assert info.value.retry_pushback_ms == 500
    now[0] += 0.25
    with pytest.raises(TenantOverLimitError) as info:
        limiter.admit(tenant)
    assert info.value.retry_pushback_ms == 250
    now[0] += 0.25
    release = limiter.admit(tenant)
    assert limiter.live(tenant) == 1
    release()
    release()  # idempotent
    assert limiter.live(tenant) == 0
    limiter.refund(tenant)  # the token taken for the last admit
    limiter.admit(tenant)()
    for _ in range(3):
        limiter.refund(tenant)
    limiter.admit(tenant)()
    limiter.admit(tenant)()  # refunds fill the bucket to its burst, no further
    with pytest.raises(TenantOverLimitError):
        limiter.admit(tenant)


def test_a_keys_file_that_is_not_utf_8_is_refused_naming_the_flag(tmp_path: Path) -> None:
    """It ended with the decoder's message alone ("'utf-8' codec can't decode byte 0xe9 ..")."""
    path = tmp_path / "keys.toml"
    path.write_bytes(b'[[tenant]]\nname = "caf\xe9"\nkeys = ["k"]\n')
    with pytest.raises(ValueError) as info:
        TenantDirectory.load(path)
    assert str(info.value).startswith(f"api-keys: cannot read {str(path)!r}: 'utf-8' codec can't decode")
