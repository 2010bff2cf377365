"""`sluice bench` refuses bad options before it connects, each in one line naming the option (or its
field): NaN and out-of-range floats, --sweep, output paths it could not write; `sluice bench compare`
names a file that is not a sluice bench file."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import threading

import pytest

from sluice.bench.metrics import Slo, summarize
from sluice.bench.report import run_document, write_json
from sluice.bench.runner import LoadConfig
from sluice.bench.workloads import Workload
from sluice.service.cli import main


@pytest.fixture
def dead_target():
    """HOST:PORT of a bound port nobody listens on: a connection there fails, so a command that reaches
    the network ends in UNAVAILABLE, not in the message a test expects."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def _bench(target: str, *args: str) -> int:
    return main(["bench", "--target", target, "--no-progress", "--warmup", "0", *args])


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("--request-rate", "nan", "--duration", "0.3"), "request_rate: must be > 0"),
        (("--request-rate", "0"), "request_rate: must be > 0"),
        (("--duration", "nan", "--concurrency", "1"), "duration: must be > 0"),
        (("--sigma", "nan"), "sigma: must be >= 0"),
        (("--slo-ttft", "nan"), "slo_ttft: must be > 0"),
        (("--slo-tpot", "nan"), "slo_tpot: must be > 0"),
        (("--slo-tpot", "-5"), "slo_tpot: must be > 0"),
        (("--sweep", "4,0"), "concurrency: must be >= 1"),
        (("--sweep", "1,2", "--concurrency", "4"), "sweep: sets each run's concurrency; drop --concurrency"),
    ],
)
def test_bad_floats_and_loads_are_refused_before_connecting(dead_target, capsys, args, error) -> None:
    assert _bench(dead_target, *args) == 2
    assert capsys.readouterr().err == f"sluice bench: {error}\n"


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: LoadConfig(num_requests=1, request_rate=math.nan), "request_rate: must be > 0"),
        (lambda: LoadConfig(duration=math.nan, concurrency=1), "duration: must be > 0"),
        (lambda: Workload("chat", 100, sigma=math.nan), "sigma: must be >= 0"),
        (lambda: Slo(ttft=math.nan), "slo_ttft: must be > 0"),
        (lambda: Slo(tpot=math.nan), "slo_tpot: must be > 0"),
    ],
    ids=["request_rate", "duration", "sigma", "slo_ttft", "slo_tpot"],
)
def test_nan_fails_every_float_check(make, error) -> None:
    with pytest.raises(ValueError, match=f"^{error}$"):
        make()


def test_sweep_names_itself_when_it_is_not_integers(dead_target, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _bench(dead_target, "--sweep", "a,b")
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error == "sluice bench: error: argument --sweep: must be comma-separated integers, got 'a,b'"


def test_output_paths_it_cannot_write_are_refused_before_the_run(dead_target, tmp_path, capsys) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    refused = [
        ("--json", str(tmp_path / "missing" / "out.json"), f"no directory {tmp_path / 'missing'}"),
        ("--json", str(a_file / "out.json"), f"{a_file} is not a directory"),
        ("--json", str(tmp_path), f"{tmp_path} is a directory"),
        ("--plot", str(a_file), f"{a_file} is not a directory"),
        ("--plot", str(a_file / "charts" / "more"), f"{a_file} is not a directory"),
    ]
    for option, path, problem in refused:
        assert _bench(dead_target, option, path) == 2, (option, path)
        assert capsys.readouterr().err == f"sluice bench: {option}: {problem}\n"
    assert os.listdir(tmp_path) == ["a_file"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (ENOSPC on every write)")
def test_an_output_that_fails_at_write_time_is_one_line_and_the_others_are_written(
    server, tmp_path, capsys
) -> None:
    charts = tmp_path / "charts"
    args = ("--input-len", "8", "--output-len", "2", "--num-requests", "2", "--concurrency", "1")
    args += ("--seed", "5")  # given: no line saying which was drawn
    assert _bench(server.target, *args, "--json", "/dev/full", "--plot", str(charts)) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines()[1].split()[:2] == ["fixed", "2/2"]  # the run itself completed
    assert captured.err == (
        f"sluice bench: --json: [Errno 28] No space left on device\nwrote {charts / 'latency_cdfs.png'}\n"
    )
    assert os.listdir(charts) == ["latency_cdfs.png"]


def _document(path, num_runs: int = 1) -> str:
    """A sluice bench JSON file of `num_runs` runs (of no requests) at `path`; returns the path."""
    write_json(str(path), [run_document("run", {}, summarize([], 1.0), [])] * num_runs)
    return str(path)


def test_compare_names_a_file_that_is_not_a_bench_file(tmp_path, capsys) -> None:
    good = _document(tmp_path / "good.json")
    _document(tmp_path / "pair.json", num_runs=2)
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "no_label.json").write_text(json.dumps({"runs": [{}]}))
    run = json.loads((tmp_path / "good.json").read_text())["runs"][0]
    run["metrics"]["ttft"]["p50"] = "fast"
    (tmp_path / "word.json").write_text(json.dumps({"runs": [run]}))
    not_a_run = "run 0 has no 'label' or no numeric 'metrics'"
    cases = [
        ("missing.json", f"[Errno 2] No such file or directory: '{tmp_path / 'missing.json'}'"),
        ("text.json", f"{tmp_path / 'text.json'}: not JSON (Expecting value: line 1 column 1 (char 0))"),
        ("list.json", f"{tmp_path / 'list.json'}: not a sluice bench JSON file (no 'runs' list)"),
        ("no_label.json", f"{tmp_path / 'no_label.json'}: {not_a_run}"),
        ("word.json", f"{tmp_path / 'word.json'}: {not_a_run}"),
        ("pair.json", "A has 1 runs and B has 2; they must pair up"),
    ]
    for name, error in cases:
        assert main(["bench", "compare", good, str(tmp_path / name)]) == 2, name
        captured = capsys.readouterr()
        assert (captured.out, captured.err) == ("", f"sluice bench compare: {error}\n")
    assert main(["bench", "compare", good, good]) == 0


def test_a_duration_run_sleeps_to_no_arrival_past_its_deadline(monkeypatch) -> None:
    """At 0.2 requests/s arrivals are seconds apart (minutes at 0.02): the run slept to the first one past
    its --duration, with nothing in flight, before it stopped.

    The run's clock advances by the run's own sleeps only: `asyncio.sleep` is one function for the whole
    process, and an event loop in another thread must not move it. The module's `server` (a real server,
    alive from the first test that uses it to the module's end) runs one: its engine core client's 0.25 s
    silence watch moved the run's clock by as many 0.25 s as that thread managed meanwhile (CI,
    2026-12-05: 641 s of a 30 s run). A stand-in for it runs here whatever the order of the tests."""
    from sluice.bench import runner
    from sluice.bench.transports import Chunk

    class Instant:
        async def generate(self, request_id, request):
            yield Chunk(num_tokens=1)

        async def close(self) -> None:
            pass

    class Clock:  # the run's time: advanced by its sleeps alone
        now = 0.0

        @classmethod
        def perf_counter(cls) -> float:
            return cls.now

    duration, sleeps = 30.0, []
    real_sleep = asyncio.sleep
    run_thread = threading.get_ident()

    async def sleep(delay: float) -> None:
        if threading.get_ident() != run_thread:  # another thread's loop: a real sleep, not the run's time
            await real_sleep(delay)
            return
        sleeps.append(delay)
        Clock.now += delay
        await real_sleep(0)

    monkeypatch.setattr(runner, "time", Clock)
    monkeypatch.setattr(runner.asyncio, "sleep", sleep)
    watching = threading.Event()
    stop = threading.Event()

    async def watch_silence() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.25)
            watching.set()

    neighbour = threading.Thread(target=asyncio.run, args=(watch_silence(),), daemon=True)
    neighbour.start()
    try:
        assert watching.wait(30)  # its loop sleeps through the patched function before the run starts
        load = LoadConfig(duration=duration, request_rate=0.2, warmup_requests=0)
        arrivals = runner.poisson_arrival_times(0.2, seed=0)
        expected = sum(1 for _ in iter(lambda: next(arrivals) < duration, False))
        workload = Workload("fixed", vocab_size=512, input_len=4)
        result = asyncio.run(runner.run_load(Instant(), workload, load))
    finally:
        stop.set()
        neighbour.join(30)
    assert result.metrics.num_requests == expected > 1
    assert Clock.now < duration, sleeps
    assert 0.25 not in sleeps  # none of the neighbour's
