"""The engine core process's loop (`CoreLoop`) leaves nothing of a request behind once it waits idle: the
step after a request finishes frees its sampling, penalty and proposer state, so the loop steps once more
even when no request follows (vLLM's busy loop steps while `has_requests()`, finished ones included). The
loop runs in a thread over inproc sockets, so the walk reads the very core it drives; its first heartbeat
says it is idle."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from concurrent.futures import Future

import pytest
import zmq
from reachable_ids import ids_held
from service_harness import PATIENCE_S, UNENDING, long_engine_config

from sluice.engine.config import SpeculativeConfig
from sluice.engine.core.engine_core import EngineCore
from sluice.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreHeartbeat,
    CoreOutputs,
    Shutdown,
    decode_core_message,
    encode,
)
from sluice.engine.process.core_process import CoreLoop
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint

HEARTBEAT_S = 0.05
# Greedy with penalties, seeded samples and an n-gram proposer: each keeps state per request in the core.
ENDS = {"max_tokens": 6, "ignore_eos": True}  # each of REQUESTS ends by length
REQUESTS = {
    "penalized": ([5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(temperature=0.0, presence_penalty=0.5, **ENDS)),
    "seeded": ([9, 10, 11, 12], SamplingParams(temperature=0.8, seed=7, **ENDS)),
    "bias": ([13, 14], SamplingParams(temperature=0.0, logit_bias={20: 2.0}, **ENDS)),
}


class LoopThread:
    """A CoreLoop over inproc PUSH/PULL sockets in a thread; `send` and `receive` talk to it."""

    def __init__(self, core: EngineCore) -> None:
        self.context = zmq.Context()
        commands, self._commands = self.context.socket(zmq.PULL), self.context.socket(zmq.PUSH)
        results, self._results = self.context.socket(zmq.PUSH), self.context.socket(zmq.PULL)
        commands.bind("inproc://commands")
        self._commands.connect("inproc://commands")
        self._results.bind("inproc://results")
        results.connect("inproc://results")
        self._sockets = (commands, results)
        loop = CoreLoop(core, commands, results, HEARTBEAT_S, parent_pid=os.getppid())
        self.thread = threading.Thread(target=loop.run, daemon=True)
        self.thread.start()

    def send(self, message: object) -> None:
        self._commands.send(encode(message))

    def receive(self) -> CoreOutputs | CoreHeartbeat:
        assert self._results.poll(PATIENCE_S * 1000), "the core loop sent nothing"
        return decode_core_message(self._results.recv())

    def close(self) -> None:
        self.send(Shutdown())
        self.thread.join(PATIENCE_S)
        for socket in (*self._sockets, self._commands, self._results):
            socket.close(linger=0)
        self.context.term()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_idle_core_loop_holds_nothing_of_the_requests_it_served(llama_long_dir, async_scheduling):
    config = dataclasses.replace(
        long_engine_config(llama_long_dir),
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
        async_scheduling=async_scheduling,
    )
    core = EngineCore(config)
    loop = LoopThread(core)
    try:
        # Runs until aborted, however fast the machine (service_harness.UNENDING).
        loop.send(AddRequest("unending", [3, 4, 5], SamplingParams(**UNENDING), time.time()))
        for request_id, (prompt, params) in REQUESTS.items():
            loop.send(AddRequest(request_id, prompt, params, time.time()))
        finished: dict[str, str] = {}
        aborted = False
        while len(finished) < len(REQUESTS) + 1:
            message = loop.receive()
            if isinstance(message, CoreHeartbeat):
                continue
            for output in message.outputs:
                if output.finish_reason is not None:
                    finished[output.request_id] = output.finish_reason
            if not aborted and any(o.request_id == "unending" and o.new_token_ids for o in message.outputs):
                loop.send(AbortRequests(["unending"]))  # it runs: a step of it may be in flight
                aborted = True
        assert finished == {"unending": "abort", **dict.fromkeys(REQUESTS, "length")}
        while not isinstance(loop.receive(), CoreHeartbeat):  # idle from here: nothing is stepping
            pass
        assert not core.has_work()
        assert ids_held(core, {"unending", *REQUESTS}) == []
        stats = core.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)
    finally:
        loop.close()
    assert not loop.thread.is_alive()


def test_a_request_the_core_cannot_take_fails_alone(llama_long_dir):
    """A request the frontend let through that the core cannot build (here no prompt tokens: a chat
    template that rendered nothing, once) ends with an error, and the loop serves the next one; before,
    the exception ended the core process and with it every request in flight."""
    core = EngineCore(long_engine_config(llama_long_dir))
    loop = LoopThread(core)
    try:
        loop.send(AddRequest("empty", [], SamplingParams(**ENDS), time.time()))
        loop.send(AddRequest("after", [3, 4, 5], SamplingParams(temperature=0.0, **ENDS), time.time()))
        finished = {}
        while len(finished) < 2:
            message = loop.receive()
            for output in [] if isinstance(message, CoreHeartbeat) else message.outputs:
                if output.finish_reason is not None:
                    finished[output.request_id] = (output.finish_reason, output.error)
        assert finished["after"] == ("length", None)
        assert (
            finished["empty"][0] == "error"
            and "prompt: must contain at least one token" in finished["empty"][1]
        )
        assert loop.thread.is_alive()
    finally:
        loop.close()


def test_a_request_whose_grammar_compiles_counts_as_waiting(llama_long_dir, monkeypatch):
    """Like vLLM's WAITING_FOR_FSM: the queue-depth gauge (and the HPA, and SMG's load) read an idle
    server while requests waited for their grammars."""
    core = EngineCore(long_engine_config(llama_long_dir))
    monkeypatch.setattr(core._grammar_room._compiler, "submit", lambda constraint: Future())  # never done
    params = SamplingParams(constraint=Constraint(regex="a+"), **ENDS)
    core.add_request(AddRequest("constrained", [3, 4, 5], params, time.time()))
    stats = core.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_waiting_tokens) == (0, 1, 3)
    assert stats.num_waiting_for_grammar == 1  # holding no request back for a seat (admission control)
