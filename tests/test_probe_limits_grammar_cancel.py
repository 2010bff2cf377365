"""A request that leaves while its grammar waits for a compile worker takes its compile with it: the compile
is cancelled before it starts (as SGLang's abort cancels the request's grammar future), unless another
waiting request shares it. Before, every abandoned request's compile still ran, one after another: on a
live server, six requests with 30,000-value enums given up after 1 s each held a later `choice` request
for ~30 s of compiles nobody waited for (a client retrying on its deadline kept the queue full for ever)."""

from __future__ import annotations

import threading
import time

import pytest
from checkpoints import VOCAB_SIZE

from sluice.engine.core.grammar_waiting_room import GrammarWaitingRoom
from sluice.engine.request import Request, RequestStatus
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint
from sluice.engine.structured.grammar_compiler import GrammarCompiler
from sluice.engine.text.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(120)
PATIENCE_S = 60.0


def _request(request_id: str, regex: str) -> Request:
    params = SamplingParams(constraint=Constraint(regex=regex), max_tokens=4)
    return Request(request_id, [3, 4, 5], params, frozenset({1}), time.time())


@pytest.fixture
def gated(llama_dir: str, monkeypatch):
    """A fresh one-worker compiler (an empty cache), whose compile of "a+" holds its worker until the
    test sets the gate."""
    tokenizer = Tokenizer.from_pretrained(llama_dir)
    compiler = GrammarCompiler(tokenizer, VOCAB_SIZE, tokenizer.eos_token_ids, num_workers=1)
    started, gate = threading.Event(), threading.Event()
    compile_ = compiler._compile

    def compile_gated(key):
        if key == ("regex", "a+"):
            started.set()
            assert gate.wait(PATIENCE_S)
        return compile_(key)

    monkeypatch.setattr(compiler, "_compile", compile_gated)
    yield compiler, started, gate
    gate.set()
    compiler.shutdown()


def test_an_aborted_request_s_pending_compile_is_cancelled(gated) -> None:
    compiler, started, gate = gated
    room = GrammarWaitingRoom(compiler)
    room.add(_request("busy", "a+"))
    assert started.wait(PATIENCE_S)  # the one worker is taken: the next compiles wait
    for request_id, regex in (("left", "b+"), ("shares", "c+"), ("shares-too", "c+")):
        room.add(_request(request_id, regex))
    left, shared = compiler.submit(Constraint(regex="b+")), compiler.submit(Constraint(regex="c+"))

    assert room.abort("left", RequestStatus.FINISHED_ABORTED).status == RequestStatus.FINISHED_ABORTED
    assert room.abort("shares", RequestStatus.FINISHED_ABORTED) is not None
    assert left.cancelled()  # nobody waits for it
    assert not shared.cancelled()  # "shares-too" still does
    # The cache forgot the cancelled compile: the same source asked again compiles afresh.
    again = compiler.submit(Constraint(regex="b+"))
    assert again is not left and not again.cancelled()

    gate.set()
    admitted: list[str] = []
    deadline = time.monotonic() + PATIENCE_S
    while len(admitted) < 2:
        assert time.monotonic() < deadline, f"grammars not ready: {admitted}"
        room.wait(0.1)
        assert room.admit_ready(lambda request: admitted.append(request.request_id)) == []
    assert sorted(admitted) == ["busy", "shares-too"]
    assert again.result(PATIENCE_S) is not None
    assert len(room) == 0


def test_a_compile_under_way_runs_on_and_stays_cached(gated) -> None:
    """xgrammar cannot stop a compile: the one under way finishes, and the next request of its source
    finds it in the cache."""
    compiler, started, gate = gated
    room = GrammarWaitingRoom(compiler)
    room.add(_request("busy", "a+"))
    assert started.wait(PATIENCE_S)
    running = compiler.submit(Constraint(regex="a+"))
    assert room.abort("busy", RequestStatus.FINISHED_ABORTED) is not None
    assert not running.cancelled()
    gate.set()
    assert running.result(PATIENCE_S) is not None
    assert compiler.submit(Constraint(regex="a+")) is running
