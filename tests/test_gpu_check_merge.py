"""One report from a lease's calls of scripts/gpu_check.sh (`sluice.benchmarks.gpu.merge_calls`), and the
report's head from the machine that ran the steps (`check_report`'s machine record), not the one that
rebuilds it. The calls here are written by hand, as the script writes them on a GPU machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.benchmarks.gpu import check_report, merge_calls
from sluice.benchmarks.gpu.step_context import read_results

H200 = "NVIDIA H200"
VERSIONS = "torch 2.11.0+cu130, CUDA 13.0, triton 3.6.0, Python 3.12.3, programmatic dependent launch on"


def machine(wall_s: float, budget_s: float, card: str = "GPU-c43d6822") -> dict:
    return {"step": "report", "mode": "gpu", "device": H200, "card": card, "versions": VERSIONS,
            "date": "2026-12-04 16:57 UTC", "wall_s": wall_s, "budget_s": budget_s}  # fmt: skip


def status(step: str, state: str, seconds: int = 0) -> dict:
    return {"step": step, "status": state, "seconds": seconds, "limit_s": 180, "note": f"{step} {state}"}


def bench(tpot: float, ttft: float) -> dict:
    metrics = {"num_requests": 2, "num_completed": 2, "errors": {}, "output_throughput": 100.0,
               "tpot": {"p50": tpot, "p99": tpot}, "ttft": {"p50": ttft}}  # fmt: skip
    return {"runs": [{"config": {"concurrency": 1, "workload": {"input_len": 4096}}, "metrics": metrics}]}


def write_call(directory: Path, records: list[dict], files: dict[str, str] | None = None) -> Path:
    directory.mkdir(parents=True)
    (directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for name, text in (files or {}).items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return directory


def two_calls(tmp_path: Path, second_card: str = "GPU-c43d6822") -> tuple[Path, Path]:
    """Call 1 ran serve_bench and skipped large for time; call 2, sent at once, ran large only."""
    first = write_call(
        tmp_path / "call1",
        [status("serve_bench", "passed", 40), status("async", "passed", 60), status("large", "skipped"),
         machine(462, 520)],
        {"bench_serve.json": json.dumps(bench(1.5e-3, 0.01)), "steps.log": "call one's steps\n",
         "servers.log": "call one's servers\n", "bench_large.json": "call one's: never read",
         "profiles/async-async_ngram/b1/profile.txt": "a server's profile, named by step and server"},
    )  # fmt: skip
    second = write_call(
        tmp_path / "call2",
        [
            status("serve_bench", "skipped"),
            {"step": "large", "model_info": {"max_num_batched_tokens": 8192}},
            status("large", "passed", 110),
            machine(246, 300, second_card),
        ],
        {"bench_large.json": json.dumps(bench(4.7e-3, 0.105)), "steps.log": "call two's steps\n",
         "profiles/large/prefill1/profile.txt": "the large step's profile"},
    )  # fmt: skip
    return first, second


def test_each_step_comes_from_the_call_that_ran_it_under_one_head(tmp_path: Path):
    first, second = two_calls(tmp_path)
    out = tmp_path / "merged"
    assert merge_calls.main([str(out), str(first), str(second)]) == 0

    records = read_results(out)
    statuses = {r["step"]: r["status"] for r in records if "status" in r}
    assert statuses == {"serve_bench": "passed", "async": "passed", "large": "passed"}
    assert {"step": "large", "model_info": {"max_num_batched_tokens": 8192}} in records
    assert [r["wall_s"] for r in records if r["step"] == "report"] == [462, 246]
    assert (out / "bench_serve.json").read_text() == (first / "bench_serve.json").read_text()
    assert (out / "bench_large.json").read_text() == (second / "bench_large.json").read_text()
    assert (out / "profiles/large/prefill1/profile.txt").read_text() == "the large step's profile"
    server_profile = (out / "profiles/async-async_ngram/b1/profile.txt").read_text()
    assert server_profile == "a server's profile, named by step and server"
    steps_log = (out / "steps.log").read_text()
    assert steps_log == (
        f"# merge_calls: call 1 of 2, {first}\ncall one's steps\n"
        f"# merge_calls: call 2 of 2, {second}\ncall two's steps\n"
    )
    assert (out / "servers.log").read_text() == f"# merge_calls: call 1 of 2, {first}\ncall one's servers\n"

    report = (out / "report.md").read_text().splitlines()
    assert report[0] == f"# Sluice GPU check: {H200}: PASS"
    assert report[2] == (
        f"2026-12-04 16:57 UTC; mode gpu; {VERSIONS}; 2 calls: 462 s of 520, 246 s of 300; card GPU-c43d6822."
    )
    text = "\n".join(report)
    assert "| large | llama-3-8b shape: batch-1 TPOT, 4096-token TTFT | PASSED | 110 | 180 |" in text
    assert (
        "| serve_bench | sluice serve + greedy reference + sluice bench --sweep 1,16,64 | PASSED | 40 |"
        in text
    )


def test_calls_on_two_cards_or_without_a_report_say_so_in_the_head(tmp_path: Path):
    first, second = two_calls(tmp_path, second_card="GPU-other")
    assert merge_calls.main([str(tmp_path / "cards"), str(first), str(second)]) == 0
    head = (tmp_path / "cards" / "report.md").read_text().splitlines()[2]
    assert head.endswith("2 calls: 462 s of 520, 246 s of 300; NOT one card: GPU-c43d6822, GPU-other.")

    # A call cut before its report recorded no machine: the head says which.
    cut = write_call(tmp_path / "cut", [status("large", "timed out", 180)])
    assert merge_calls.main([str(tmp_path / "with_cut"), str(first), str(cut)]) == 1
    lines = (tmp_path / "with_cut" / "report.md").read_text().splitlines()
    assert lines[0] == f"# Sluice GPU check: {H200}: FAIL"
    assert lines[2].endswith("2 calls: 462 s of 520, unrecorded; card GPU-c43d6822.")
    assert merge_calls.main([str(tmp_path / "none"), str(cut)]) == 1
    lines = (tmp_path / "none" / "report.md").read_text().splitlines()
    assert lines[0] == "# Sluice GPU check: unrecorded machine: FAIL"
    assert lines[2] == "No call recorded its machine (none built its report there)."


def test_a_step_its_call_ended_inside_keeps_what_it_recorded_and_says_it_was_cut(tmp_path: Path):
    # Call 2 was killed inside large (the device tool's limit): the step's first record is there, its
    # status is not, and the call wrote no report.
    first = write_call(tmp_path / "call1", [status("large", "skipped"), machine(462, 520)])
    result = {"step": "large", "model_info": {"max_num_batched_tokens": 8192}}
    second = write_call(tmp_path / "call2", [status("fp8", "passed", 90), result])
    assert merge_calls.main([str(tmp_path / "out"), str(first), str(second)]) == 1
    records = read_results(tmp_path / "out")
    assert [r for r in records if r["step"] == "large"] == [
        result,
        {"step": "large", "status": "timed out", "seconds": 0, "limit_s": 0,
         "note": "call 2 ended inside this step: it recorded no status (merge_calls)"},
    ]  # fmt: skip
    assert [r.get("unrecorded", False) for r in records if r["step"] == "report"] == [False, True]
    report = (tmp_path / "out" / "report.md").read_text()
    assert (
        "| TIMED OUT | 0 | 0 | call 2 ended inside this step: it recorded no status (merge_calls) |" in report
    )
    assert report.splitlines()[2].endswith("2 calls: 462 s of 520, unrecorded; card GPU-c43d6822.")


def test_bad_arguments_are_refused_naming_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    first, second = two_calls(tmp_path)
    assert merge_calls.main([str(tmp_path / "out"), str(first), str(tmp_path / "nope")]) == 2
    assert (
        f"merge_calls: CALL_OUT: {tmp_path / 'nope' / 'results.jsonl'} does not exist"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "out").exists()
    assert merge_calls.main([str(first), str(second)]) == 2  # OUT holds a call's files
    assert f"merge_calls: OUT: {first} is not empty" in capsys.readouterr().err


def test_a_rebuilt_report_keeps_the_head_of_the_machine_that_ran_the_steps(tmp_path: Path):
    # A GPU call's results, rebuilt on this CPU machine: the head is the GPU's, and nothing is appended.
    call = write_call(tmp_path / "gpu", [status("serve_bench", "passed", 40), machine(462, 520)])
    before = (call / "results.jsonl").read_text()
    check_report.main([str(call), "--mode", "gpu", "--wall-s", "1", "--budget-s", "2"])
    lines = (call / "report.md").read_text().splitlines()
    assert lines[0].startswith(f"# Sluice GPU check: {H200}: ")
    assert (
        lines[2] == f"2026-12-04 16:57 UTC; mode gpu; {VERSIONS}; 462 s of a 520 s budget; card GPU-c43d6822."
    )
    assert (call / "results.jsonl").read_text() == before

    # A GPU call's folder from before the record, rebuilt here: this CPU machine is not recorded as its.
    older = write_call(tmp_path / "older", [status("serve_bench", "passed", 40)])
    before = (older / "results.jsonl").read_text()
    check_report.main([str(older), "--mode", "gpu", "--wall-s", "1", "--budget-s", "2"])
    assert (older / "results.jsonl").read_text() == before

    # The first build records the machine it runs on, once; the next build reads it back.
    fresh = write_call(tmp_path / "fresh", [status("serve_bench", "passed", 40)])
    check_report.main([str(fresh), "--mode", "cpu", "--wall-s", "53", "--budget-s", "470"])
    check_report.main([str(fresh), "--mode", "cpu", "--wall-s", "99", "--budget-s", "99"])
    (record,) = [r for r in read_results(fresh) if r["step"] == "report"]
    assert (
        record["device"] == "CPU"
        and record["card"] == ""
        and (record["wall_s"], record["budget_s"]) == (53, 470)
    )
    lines = (fresh / "report.md").read_text().splitlines()
    assert lines[0].startswith("# Sluice GPU check: CPU: ")
    assert lines[2].startswith(record["date"]) and lines[2].endswith("53 s of a 470 s budget.")
