"""Session affinity for gRPC callers: three real servers behind one DNS name (127.0.0.1-3, one port, as
a headless Kubernetes Service resolves) and the Python client with `session_affinity=True` (ring_hash
keyed on the `x-sluice-session` header, gRFC A76). Every turn of a conversation lands on one server,
whose prefix cache then holds its history (cached tokens grow turn after turn), while conversations
spread over the servers; a server going NOT_SERVING moves its sessions to the others."""

from __future__ import annotations

import collections

import pytest
from fake_dns import FakeDns
from service_harness import ServerThread, tiny_engine_config

from sluice import Client, generate_request
from sluice.service.server import ServerConfig
from sluice.service_config import SESSION_AFFINITY_SERVICE_CONFIG, SESSION_HEADER

pytestmark = pytest.mark.timeout(300)

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
NUM_SESSIONS = 12
NUM_TURNS = 4
# Each turn adds this many prompt tokens (ids of the tiny model's 512-token vocabulary); the KV block
# size is 16, so every turn's prompt fills at least one more block than the last.
TURN_TOKENS = 20


def _generate_calls(server: ServerThread) -> float:
    labels = {"method": "Generate", "code": "OK"}
    return server.server.metrics.registry.get_sample_value("sluice_rpc_requests_total", labels) or 0.0


@pytest.fixture
def fleet(llama_dir: str):
    """Three fresh servers for each test: the drain test leaves one NOT_SERVING and every server's prefix
    cache holds what the test sent, so no test may inherit another's fleet."""
    first = ServerThread(tiny_engine_config(llama_dir), ServerConfig(host=HOSTS[0], port=0)).start()
    servers = [first]
    try:
        for host in HOSTS[1:]:
            config = ServerConfig(host=host, port=first.server.port)
            servers.append(ServerThread(tiny_engine_config(llama_dir), config).start())
        dns = FakeDns("sluice.test", list(HOSTS))
        yield dns, servers
        dns.close()
    finally:
        for server in servers:
            server.stop()


def _serving(servers: list[ServerThread]) -> list[float]:
    return [_generate_calls(server) for server in servers]


def _converse(client: Client, servers: list[ServerThread], session: str, seed: int) -> tuple[int, list[int]]:
    """NUM_TURNS turns of one conversation, one call at a time; returns the server index that served
    every turn (asserting it is one) and each turn's cached prompt tokens."""
    prompt: list[int] = []
    served_by: set[int] = set()
    cached: list[int] = []
    for turn in range(NUM_TURNS):
        prompt += [(seed * 37 + turn * 11 + i) % 500 + 5 for i in range(TURN_TOKENS)]
        before = _serving(servers)
        request = generate_request(token_ids=prompt, temperature=0.0, max_tokens=3, ignore_eos=True)
        completion = client.complete(request, timeout=60, session=session)
        after = _serving(servers)
        served_by |= {i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b}
        cached.append(completion.usage.cached_tokens)
        prompt += list(completion.token_ids)
    assert len(served_by) == 1, f"session {session} was served by servers {sorted(served_by)}"
    return served_by.pop(), cached


def test_every_turn_of_a_session_reaches_one_server_while_sessions_spread(fleet) -> None:
    dns, servers = fleet
    port = servers[0].server.port
    with Client(dns.target(port), session_affinity=True) as client:
        owners = collections.Counter()
        for index in range(NUM_SESSIONS):
            owner, cached = _converse(client, servers, f"conversation-{index}", seed=index)
            owners[owner] += 1
            # The first turn finds nothing; each later one finds at least the previous turn's full blocks.
            assert cached[0] == 0
            assert all(later > earlier for earlier, later in zip(cached, cached[1:], strict=False)), cached
            assert cached[-1] >= (NUM_TURNS - 1) * TURN_TOKENS // 16 * 16
        assert len(owners) >= 2, f"every session hashed to one server: {owners}"


def test_a_draining_servers_sessions_move_and_the_others_stay(fleet) -> None:
    dns, servers = fleet
    port = servers[0].server.port
    with Client(dns.target(port), session_affinity=True) as client:
        request = generate_request(token_ids=list(range(5, 40)), temperature=0.0, max_tokens=2)

        def owner(session: str) -> int:
            before = _serving(servers)
            client.complete(request, timeout=60, session=session)
            after = _serving(servers)
            (index,) = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
            return index

        owners = {f"s{i}": owner(f"s{i}") for i in range(NUM_SESSIONS)}
        # s0's server goes NOT_SERVING and refuses new calls, as at the start of a drain (it stays so
        # until the fixture stops this test's fleet).
        leaving = owners["s0"]
        servers[leaving].call(servers[leaving].server.begin_drain())
        for session, index in owners.items():
            # A call that still reaches the leaving server before the client's health watch has seen
            # NOT_SERVING is refused with UNAVAILABLE and retried: it never counts as served there.
            moved = owner(session)
            if index == leaving:
                assert moved != leaving
            else:
                assert moved == index, f"{session} moved though its server stayed"


def test_an_abort_given_the_session_reaches_the_server_that_ran_the_request(fleet) -> None:
    """Abort is OK where the id ended lately and NOT_FOUND on a server that never saw it; without the
    header it would go to a random server. Given the request's session, it goes where the request went."""
    dns, servers = fleet
    with Client(dns.target(servers[0].server.port), session_affinity=True) as client:
        for index in range(NUM_SESSIONS):
            session, request_id = f"conversation-{index}", f"request-{index}"
            request = generate_request(token_ids=[5, 6, 7], request_id=request_id, max_tokens=1)
            client.complete(request, timeout=60, session=session)
            client.abort(request_id, timeout=60, session=session)  # raises SluiceError on NOT_FOUND


def test_the_documented_config_hashes_the_session_header() -> None:
    (policy,) = SESSION_AFFINITY_SERVICE_CONFIG["loadBalancingConfig"]
    assert policy == {"ring_hash_experimental": {"requestHashHeader": SESSION_HEADER}}
    assert SESSION_AFFINITY_SERVICE_CONFIG["healthCheckConfig"] == {
        "serviceName": "sluice.v1.InferenceService"
    }
    retry = SESSION_AFFINITY_SERVICE_CONFIG["methodConfig"][0]["retryPolicy"]
    assert retry["retryableStatusCodes"] == ["UNAVAILABLE"]
