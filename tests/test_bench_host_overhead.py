"""`python -m sluice.benchmarks.engine.host_overhead`: every timed step is a decode step of the whole
batch, and `--forward replay` runs the model once per batch size after the prefill (the rest of the
decode steps get its hidden states and logits), so the host phases run without a forward in between."""

from __future__ import annotations

import itertools
import json

import pytest

from sluice.benchmarks.engine import host_overhead as bench
from sluice.benchmarks.engine import phase_clock
from sluice.benchmarks.engine.phase_clock import ForwardReplay, PhaseClock
from sluice.engine.config import EngineConfig
from sluice.engine.core import engine_core
from sluice.engine.frontend.engine import Engine
from sluice.engine.frontend.output_processor import OutputProcessor
from sluice.engine.worker import model_runner

NUM_STEPS = 3
HOST_PHASES = ("schedule", "inputs", "sample", "update", "frontend", "detokenize")


@pytest.fixture
def restored_modules(monkeypatch):
    """The benchmark wraps module and class attributes for good (`instrument_modules`): undone after."""
    monkeypatch.setattr(model_runner, "build_model_inputs", model_runner.build_model_inputs)
    monkeypatch.setattr(engine_core, "launch_sampling", engine_core.launch_sampling)
    monkeypatch.setattr(OutputProcessor, "_detokenize", OutputProcessor._detokenize)


def forward_calls(replay: ForwardReplay | None) -> tuple[int, int, list[dict[str, dict[str, int]]]]:
    """(model runs, logits computed, the timed steps) over one batch of 2 on a 1-layer engine."""
    config = EngineConfig.from_kwargs(
        max_num_seqs=2, max_num_batched_tokens=bench.TOKEN_BUDGET, num_blocks=64
    )
    engine = Engine(config, bench.build_source(num_layers=1, seed=0))
    runner = engine.core.model_runner
    calls = {"hidden": 0, "logits": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    runner.graph_runner.run = counted("hidden", runner.graph_runner.run)
    runner.model.compute_logits = counted("logits", runner.model.compute_logits)
    clock = PhaseClock()
    bench.instrument_modules(clock)
    bench.instrument(engine, clock, replay)
    steps = bench.run_batch(engine, clock, 2, NUM_STEPS, prompt_len=40, seed=0, replay=replay)
    assert len(steps) == NUM_STEPS
    return calls["hidden"], calls["logits"], steps


def test_replay_runs_the_model_once_after_the_prefill(restored_modules):
    ran, logits_ran, _ = forward_calls(None)
    replay = ForwardReplay()
    replayed, logits_replayed, steps = forward_calls(replay)
    decode_steps = bench.NUM_WARMUP_STEPS + NUM_STEPS
    assert ran - replayed == logits_ran - logits_replayed == decode_steps - 1
    # The host's phases are still run and timed in every replayed step.
    assert all(step["wall"][phase] > 0 for step in steps for phase in HOST_PHASES)
    assert not replay.armed and not replay.results  # disarmed for the next batch size


def test_main_prints_and_writes_every_batch(tmp_path, capsys, restored_modules):
    out = tmp_path / "host.json"
    argv = ["--batch", "1", "2", "--steps", "2", "--num-layers", "1", "--forward", "replay"]
    bench.main([*argv, "--json", str(out)])
    results = json.loads(out.read_text())
    assert sorted(results["summary"]["sync"]) == ["1", "2"]
    assert all(len(steps) == 2 for steps in results["steps"]["sync"].values())
    assert "forward replayed (no forward)" in capsys.readouterr().out


def test_speculative_steps_count_their_tokens_and_time_the_lookup(tmp_path, capsys, restored_modules):
    """`--speculative ngram`: a step's tokens are its accepted drafts and a token a request, its drafts
    are verified (the random weights soon repeat themselves, so the lookup finds some), and the lookup
    has its own column."""
    out = tmp_path / "host.json"
    argv = ["--batch", "2", "--steps", "6", "--num-layers", "1", "--speculative", "ngram"]
    bench.main([*argv, "--json", str(out)])
    steps = json.loads(out.read_text())["steps"]["sync"]["2"]
    assert all(step["tokens"] == 2 + step["accepted"] for step in steps)
    assert sum(step["drafts"] for step in steps) > 0
    assert all(step["wall"]["propose"] > 0 for step in steps)
    assert "ngram drafts, k = 3" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--speculative", "ngram", "--forward", "replay"])
    assert "its forward must run" in capsys.readouterr().err


def test_a_draft_model_drafts_k_tokens_a_request_every_step(tmp_path, capsys, restored_modules):
    """`--speculative draft`: a random draft model of the embedded shape, written as a checkpoint for the
    run, proposes k = 3 drafts for each request every step."""
    out = tmp_path / "host.json"
    argv = ["--batch", "2", "--steps", "3", "--num-layers", "1", "--speculative", "draft"]
    bench.main([*argv, "--json", str(out)])
    steps = json.loads(out.read_text())["steps"]["sync"]["2"]
    assert [step["drafts"] for step in steps] == [6, 6, 6]
    assert all(step["tokens"] == 2 + step["accepted"] for step in steps)
    assert "draft drafts, k = 3 (1-layer draft model)" in capsys.readouterr().out


def test_a_phase_nested_in_another_is_taken_out_of_it(monkeypatch):
    """A draft model's forwards run inside its proposal: "forward" counts them, "propose" does not."""
    ticks = itertools.count(0, 10)
    monkeypatch.setattr(phase_clock.time, "perf_counter_ns", lambda: next(ticks))
    monkeypatch.setattr(phase_clock.time, "thread_time_ns", lambda: 0)
    clock = PhaseClock()
    forward = clock.timed("forward", lambda: None)
    propose = clock.timed("propose", forward)
    clock.nested("propose", "forward")
    propose()  # reads 0 (propose), 10 (forward), 20 (forward ends), 30 (propose ends)
    assert (clock.wall["propose"], clock.wall["forward"]) == (20, 10)
    forward()  # outside a proposal: nothing taken out of it
    assert (clock.wall["propose"], clock.wall["forward"]) == (20, 20)
