"""Speculative decoding through the real gRPC server: the final chunk's usage reports draft tokens, a
request can opt out (GenerateRequest.disable_speculation), a constrained request verifies drafts too,
GetModelInfo says what runs, and /metrics exports drafts verified, accepted and the acceptance rate per
position."""

from __future__ import annotations

import dataclasses
import random

import pytest
from service_harness import ServerThread, tiny_engine_config

from sluice import Client, generate_request
from sluice.engine.config import SpeculativeConfig
from sluice.service.server import ServerConfig
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(120)
K = 3


@pytest.fixture(scope="module")
def speculating(llama_dir: str):
    config = dataclasses.replace(
        tiny_engine_config(llama_dir), speculative=SpeculativeConfig("ngram", num_speculative_tokens=K)
    )
    thread = ServerThread(config, ServerConfig(host="127.0.0.1", port=0, metrics_port=0)).start()
    yield thread
    thread.stop()


def _greedy_request() -> pb.GenerateRequest:
    """A phrase said four times, then 40 greedy tokens: long enough that the tiny model's n-gram drafts
    are accepted at least once (each test sends its own, so none relies on another having run first)."""
    rng = random.Random(2)
    phrase = [rng.randrange(4, 512) for _ in range(10)]
    return generate_request(token_ids=phrase * 4, temperature=0.0, max_tokens=40, ignore_eos=True)


def _with_and_without_speculation(server: ServerThread, request: pb.GenerateRequest) -> tuple:
    """The request's completion as sent, then opted out of speculation (`disable_speculation`)."""
    opted_out = pb.GenerateRequest()
    opted_out.CopyFrom(request)
    opted_out.disable_speculation = True
    with Client(server.target) as client:
        return client.complete(request), client.complete(opted_out)


def test_usage_reports_drafts_and_a_request_can_opt_out(speculating: ServerThread) -> None:
    spec, plain = _with_and_without_speculation(speculating, _greedy_request())
    assert list(spec.token_ids) == list(plain.token_ids)
    assert spec.usage.completion_tokens == plain.usage.completion_tokens == 40
    assert 0 < spec.usage.accepted_draft_tokens < spec.usage.draft_tokens
    assert plain.usage.draft_tokens == 0 and plain.usage.accepted_draft_tokens == 0
    speculating.wait_idle()


def test_a_constrained_request_verifies_drafts_and_returns_the_tokens_it_would_without(
    speculating: ServerThread,
) -> None:
    request = generate_request(text="the cat", regex="(the cat ){6}", temperature=0.0, max_tokens=64)
    spec, plain = _with_and_without_speculation(speculating, request)
    assert spec.text == plain.text == "the cat " * 6
    assert list(spec.token_ids) == list(plain.token_ids)
    assert spec.finish_reason == plain.finish_reason == pb.FINISH_REASON_STOP
    assert spec.usage.draft_tokens > 0 and plain.usage.draft_tokens == 0
    speculating.wait_idle()


def test_model_info_and_metrics_show_speculation(speculating: ServerThread) -> None:
    with Client(speculating.target) as client:
        client.complete(_greedy_request())
    stats = speculating.wait_idle()
    with speculating.channel() as channel:
        info = speculating.stub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.speculative_method, info.num_speculative_tokens) == ("ngram", K)
    samples = speculating.metric_samples()
    assert samples[("sluice_spec_decode_draft_tokens_total", ())] == stats.num_draft_tokens > 0
    assert samples[("sluice_spec_decode_accepted_tokens_total", ())] == stats.num_accepted_draft_tokens > 0
    for position in range(K):
        label = (("position", str(position)),)
        verified = samples[("sluice_spec_decode_draft_tokens_by_position_total", label)]
        accepted = samples[("sluice_spec_decode_accepted_tokens_by_position_total", label)]
        assert verified == stats.draft_tokens_per_position[position]
        assert accepted == stats.accepted_draft_tokens_per_position[position]
        assert samples[("sluice_spec_decode_acceptance_rate", label)] == pytest.approx(accepted / verified)
