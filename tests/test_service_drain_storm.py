"""No lost call in a drain, ever: calls fired at a `sluice serve` process across its whole drain window,
by plain clients (no service config, no retries, aimed at the draining server alone) and by the
documented service config (round robin over two servers, health checking, UNAVAILABLE retried).

grpc's server cancels (CANCELLED, which no client retries) the calls it has accepted but not yet handed
to a handler when stop() starts, and the calls that reach a connection after it: the drain therefore
refuses calls with UNAVAILABLE while the server still takes them, and calls stop() only once calls
have stopped coming. Every plain call must end OK (it came before the drain) or UNAVAILABLE (the
drain refused it, or the server was gone), never CANCELLED; the service-config client sees no failure.

The trickle, the calls that keep arriving until well after NOT_SERVING, runs in a process of its own:
the server's promise holds for clients that do not fall silent for longer than its quiet window and then
send, and the test's own event loop, busy with the storm on a loaded 2-core machine, once stalled 0.45 s
and sent its next calls into the GOAWAY (CI, 2026-12-02).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import multiprocessing
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path

import grpc
import pytest
from fleet_harness import SluiceProcess, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice import Client, SluiceError, generate_request
from sluice.service.server import INFERENCE_SERVICE
from sluice.v1 import sluice_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(300)

# Only a hang's limit: the drain sends its GOAWAY once calls stop coming, which its grace period must never
# decide (at 10 s a storm on a busy machine still arrived when it ran out: GOAWAY anyway, CANCELLED calls).
GRACE_PERIOD = 120.0
LOAD = 200  # long calls in flight when the drain starts, keeping the server's event loop busy
WAVES = 21  # then waves of calls, one every WAVE_INTERVAL_S from the moment the server is NOT_SERVING
WAVE_SIZE = 50  # (over the first second of the drain, where the GOAWAY used to come at 0.5 s)
WAVE_INTERVAL_S = 0.05
TRICKLE_INTERVAL_S = 0.02  # and one call every 20 ms from before SIGTERM ...
TRICKLE_AFTER_DRAIN_S = 2.0  # ... until this long after the server went NOT_SERVING


class DocumentedClientLoop:
    """Threads calling through the documented service config over both servers; failures recorded."""

    def __init__(self, target: str, num_threads: int) -> None:
        self.client = Client(target)
        self._stop = threading.Event()
        self.failures: list[str] = []
        self.num_ok = 0
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int) -> None:
        request = generate_request(f"loop {index}", temperature=0.0, max_tokens=3, ignore_eos=True)
        while not self._stop.is_set():
            try:
                self.client.complete(request, timeout=60)
                self.num_ok += 1
            except SluiceError as exc:
                self.failures.append(f"{exc.code.name}: {exc.message}")

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)
        self.client.close()


async def _plain_call(
    stub: pb_grpc.InferenceServiceStub, index: int, answered: asyncio.Event, max_tokens: int = 2
) -> tuple[grpc.StatusCode, float]:
    """The call's status and when it was fired (time.monotonic, the same clock in every process); sets
    `answered` at its first response (a handler is serving it)."""
    fired = time.monotonic()
    request = generate_request(f"storm {index}", temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    call = stub.Generate(request, timeout=60)
    try:
        async for _ in call:
            answered.set()
    except grpc.aio.AioRpcError as error:
        return error.code(), fired
    return grpc.StatusCode.OK, fired


def _plain_channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=[("grpc.enable_retries", 0)])  # plain: no retry at all


def _trickle(target: str, answered: Event, stop: Event, results: Connection) -> None:
    """In its own process: a plain call every TRICKLE_INTERVAL_S until `stop` is set (`answered` set at
    the first response); sends back each call's status and firing time."""

    async def calls() -> list[tuple[grpc.StatusCode, float]]:
        async with _plain_channel(target) as channel:
            stub, first_answer = pb_grpc.InferenceServiceStub(channel), asyncio.Event()
            first_answer_seen = asyncio.create_task(first_answer.wait())
            first_answer_seen.add_done_callback(lambda _: answered.set())
            fired = []
            while not stop.is_set():
                fired.append(asyncio.create_task(_plain_call(stub, 1_000_000 + len(fired), first_answer)))
                await asyncio.sleep(TRICKLE_INTERVAL_S)
            first_answer_seen.cancel()
            return await asyncio.gather(*fired)

    results.send(asyncio.run(calls()))


async def _storm(draining: SluiceProcess) -> tuple[collections.Counter[grpc.StatusCode], str]:
    """Plain calls at the draining server: a trickle from another process from before SIGTERM to well
    after NOT_SERVING, LOAD long ones just before SIGTERM, and WAVES waves of calls over the drain's first
    second. SIGTERM comes once the server has answered one of the long ones: a call in a handler before
    the drain, which must end OK (on a busy machine 0.5 s was not always enough for any call to get that
    far). The trickle stops only once every wave call has ended. Returns the calls' statuses and, for a
    failure's message, when the CANCELLED ones were fired and the trickle's longest pause (a client
    stalled longer than the server's quiet window gives it a quiet it cannot tell from calls having
    stopped)."""
    spawn = multiprocessing.get_context("spawn")
    trickle_answered, trickle_stop = spawn.Event(), spawn.Event()
    trickle_results, trickle_sender = spawn.Pipe(duplex=False)
    trickle = spawn.Process(
        target=_trickle, args=(draining.target, trickle_answered, trickle_stop, trickle_sender), daemon=True
    )
    trickle.start()
    try:
        assert await asyncio.to_thread(trickle_answered.wait, 120), "no answer to the trickle's calls"
        async with (
            _plain_channel(draining.target) as channel,
            grpc.aio.insecure_channel(draining.target) as health_channel,
        ):
            stub, health = pb_grpc.InferenceServiceStub(channel), health_pb2_grpc.HealthStub(health_channel)
            answered = asyncio.Event()

            def fire(index: int, max_tokens: int = 2) -> asyncio.Task[tuple[grpc.StatusCode, float]]:
                return asyncio.create_task(_plain_call(stub, index, answered, max_tokens))

            async def serving() -> bool:
                check = health_pb2.HealthCheckRequest(service=INFERENCE_SERVICE)
                response = await health.Check(check, timeout=10)
                return response.status == health_pb2.HealthCheckResponse.SERVING

            long_calls = [fire(-i, max_tokens=40) for i in range(LOAD)]
            await asyncio.sleep(0.5)
            await answered.wait()
            draining.terminate()
            while await serving():
                await asyncio.sleep(0.005)
            drain_seen_at = time.monotonic()
            waves = []
            for wave in range(WAVES):
                waves += [fire(wave * WAVE_SIZE + i) for i in range(WAVE_SIZE)]
                await asyncio.sleep(WAVE_INTERVAL_S)
            results = await asyncio.gather(*waves)
            await asyncio.sleep(max(0.0, drain_seen_at + TRICKLE_AFTER_DRAIN_S - time.monotonic()))
            trickle_stop.set()
            trickle_calls = await asyncio.to_thread(trickle_results.recv)
            results += trickle_calls + await asyncio.gather(*long_calls)
    finally:
        trickle_stop.set()
        trickle.join(60)
        trickle.kill()
    trickle_times = sorted(at for _, at in trickle_calls)
    pause, after = max((b - a, a) for a, b in itertools.pairwise(trickle_times))
    cancelled = [f"{at - drain_seen_at:+.3f}" for code, at in results if code == grpc.StatusCode.CANCELLED]
    seen = (
        f"CANCELLED calls fired at {cancelled} s from NOT_SERVING seen; the trickle's longest pause "
        f"{pause:.3f} s, from {after - drain_seen_at:+.3f} s"
    )
    return collections.Counter(code for code, _ in results), seen


def test_calls_fired_across_a_drain_end_ok_or_unavailable_never_cancelled(
    llama_dir: str, tmp_path: Path
) -> None:
    draining = SluiceProcess(llama_dir, tmp_path / "draining.log", grace_period=GRACE_PERIOD)
    staying = SluiceProcess(llama_dir, tmp_path / "staying.log", grace_period=GRACE_PERIOD)
    try:
        documented = DocumentedClientLoop(f"ipv4:{draining.target},{staying.target}", num_threads=3)
        try:
            wait_for(lambda: draining.finished() >= 2 and staying.finished() >= 2, 120, "calls on both")
            codes, seen = asyncio.run(_storm(draining))
            assert draining.process.wait(timeout=GRACE_PERIOD + 30) == 0
            ok_before_stop = documented.num_ok
            wait_for(lambda: documented.num_ok >= ok_before_stop + 5, 120, "calls on the staying server")
        finally:
            documented.stop()
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, (codes, seen)
        assert codes[grpc.StatusCode.UNAVAILABLE] >= WAVES * WAVE_SIZE, codes  # the waves met the drain
        assert codes[grpc.StatusCode.OK] >= 1, codes  # the answered call, at least, came before it
        assert documented.failures == []
        assert "at the end of the grace period" not in draining.log_path.read_text()
    finally:
        draining.close()
        staying.close()
