"""SMG's StartProfile / StopProfile on a real Sluice server started with a profile directory: the engine
core's torch.profiler over a number of forward steps (`sluice.engine.core.step_profiler`), the files it
writes, and the errors of a call it cannot take."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from service_harness import ServerThread, tiny_engine_config
from smg_grpc_proto import vllm_engine_pb2 as smg
from smg_grpc_proto import vllm_engine_pb2_grpc as smg_grpc
from smg_grpc_proto.generated import common_pb2
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from sluice.benchmarks.gpu.step_profiles import profile_table, profile_tables
from sluice.engine.core.step_profiler import StepProfiler, _new_stem, _Run, exclusive_us, summarize
from sluice.service.server import ServerConfig
from sluice.service.smg_servicer import profile_request

pytestmark = pytest.mark.timeout(300)
# 40 tokens: one prefill forward of 40 rows, then one row per decode; each test its own (no prefix-cache hits)
PROMPTS = {"three": list(range(20, 60)), "until-stop": list(range(100, 140)), "after": list(range(200, 240))}


@pytest.fixture(scope="module")
def profile_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles").resolve()


@pytest.fixture(scope="module")
def profiled(llama_dir: str, profile_root: Path):
    config = ServerConfig(host="127.0.0.1", port=0, profile_dir=str(profile_root))
    thread = ServerThread(tiny_engine_config(llama_dir), config).start()
    with thread.channel() as channel:
        yield smg_grpc.VllmEngineStub(channel)
    thread.stop()


def _generate(stub, prompt: str, max_tokens: int) -> list[int]:
    request = smg.GenerateRequest(
        request_id=f"profiled-{prompt}",
        tokenized=smg.TokenizedInput(input_ids=PROMPTS[prompt]),
        sampling_params=smg.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        stream=False,
    )
    (response,) = stub.Generate(request, timeout=60)
    return list(response.complete.output_ids)


def _summaries(directory: Path) -> list[Path]:
    return sorted(directory.glob("profile-*.json"))


def test_a_profile_of_three_steps_is_written_while_the_request_runs_on(profiled, profile_root: Path) -> None:
    response = profiled.StartProfile(
        common_pb2.StartProfileRequest(output_dir="three", num_steps=3), timeout=10
    )
    assert (
        response.success
        and response.message == f"profiling the next 3 forward steps into {profile_root}/three"
    )
    # Six forwards (the prompt, then five decodes): the profile ends with the third, before the answer.
    assert len(_generate(profiled, "three", 6)) == 6
    (summary_path,) = _summaries(profile_root / "three")
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 3 and summary["rows_per_step"] == [40, 1, 1]
    assert summary["measured"] == "cpu" and summary["device_us_total"] == 0  # the CPU engine: no device
    assert "device_busy_us_total" not in summary and "device_overlap_us" not in summary
    assert not any("exclusive_device_us" in entry for entry in summary["top"])
    names = [entry["name"] for entry in summary["top"]]
    assert any(name.startswith("aten::") for name in names), names
    assert summary["top"][0]["self_cpu_us"] >= summary["top"][-1]["self_cpu_us"]  # largest first
    stem = summary_path.name.removesuffix(".json")
    assert "Self CPU" in (summary_path.parent / f"{stem}.txt").read_text()
    trace = json.loads(gzip.decompress((summary_path.parent / f"{stem}.trace.json.gz").read_bytes()))
    assert trace["traceEvents"]


def test_without_num_steps_it_runs_until_stop_profile(profiled, profile_root: Path) -> None:
    profiled.StartProfile(common_pb2.StartProfileRequest(output_dir="until-stop"), timeout=10)
    assert len(_generate(profiled, "until-stop", 4)) == 4  # four forwards
    stopped = profiled.StopProfile(common_pb2.StopProfileRequest(), timeout=10)
    # The core answers no stop: the message promises nothing about a profile that may have ended already.
    assert stopped.success and stopped.message == (
        f"profiling stopped: a profile still running is written to its output_dir under {profile_root}"
    )
    # The core takes commands in order: the stop is applied before this request is added.
    assert len(_generate(profiled, "after", 2)) == 2
    (summary_path,) = _summaries(profile_root / "until-stop")
    assert json.loads(summary_path.read_text())["rows_per_step"] == [40, 1, 1, 1]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_steps": 0}, "num_steps: must be >= 1, got 0"),
        ({"start_step": 5}, "start_step: not supported"),
        ({"activities": ["CPU", "MEM"]}, "activities: 'MEM' is not one of CPU, GPU (or CUDA)"),
        ({"output_dir": "../elsewhere"}, "output_dir: must be inside the server's --profile-dir"),
        ({"profile_by_stage": True}, "profile_by_stage: not supported"),
    ],
)
def test_what_it_cannot_do_is_invalid_argument(profiled, fields: dict, message: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        profiled.StartProfile(common_pb2.StartProfileRequest(**fields), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(message)


def test_a_server_without_a_profile_dir_refuses_both_calls(server: ServerThread) -> None:
    with server.channel() as channel:
        stub = smg_grpc.VllmEngineStub(channel)
        for call, request in (
            (stub.StartProfile, common_pb2.StartProfileRequest(num_steps=2)),
            (stub.StopProfile, common_pb2.StopProfileRequest()),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "start the server with --profile-dir" in info.value.details()


def test_the_request_becomes_the_engines_arguments(tmp_path: Path) -> None:
    root = tmp_path.resolve()
    request = common_pb2.StartProfileRequest(
        output_dir=str(root / "a" / "b"), num_steps=7, activities=["cuda", "CPU", "GPU"], record_shapes=True
    )
    assert profile_request(request, root) == {
        "output_dir": str(root / "a" / "b"),
        "num_steps": 7,
        "activities": ["CPU", "GPU"],
        "record_shapes": True,
        "with_stack": False,
    }
    assert profile_request(common_pb2.StartProfileRequest(), root)["output_dir"] == str(root)


def test_a_device_profile_is_tabulated_as_kernels_per_step() -> None:
    # The GPU check's report (benchmarks/gpu/step_profiles.py) of a summary as a CUDA server writes it:
    # CPU operators carry their kernels' time too, so only the device-side entries are listed.
    long_name = "void cutlass::Kernel<" + "x" * 80 + ">"
    summary = {
        "steps": 2,
        "rows_per_step": [64, 64],
        "wall_s": 0.02,
        "measured": "device",
        "device_us_total": 1000.0,
        "cpu_us_total": 50.0,
        "top": [
            {
                "name": "aten::mm",
                "count": 2,
                "self_device_us": 600.0,
                "self_cpu_us": 20.0,
                "on_device": False,
            },
            {"name": "gemm", "count": 64, "self_device_us": 600.0, "self_cpu_us": 0.0, "on_device": True},
            {"name": long_name, "count": 2, "self_device_us": 400.0, "self_cpu_us": 0.0, "on_device": True},
        ],
    }
    table, failed = profile_tables({"fp8": {"b64": summary, "b1": {"error": "RuntimeError: no profile"}}})
    head, rows = table.split("\n\n")
    assert head == (
        "**fp8, 64 sequences a step**: 2 steps of 64 rows; device time 500 us a step, "
        "wall 10.00 ms a step while profiled"
    )
    assert rows.splitlines()[2:] == [
        "| `gemm` | 300.0 | 60.0% | 32 |",
        f"| `{long_name[:69]}...` | 200.0 | 40.0% | 1 |",
    ]
    assert failed == "**fp8, 1 sequence a step**: not profiled (RuntimeError: no profile)"


@pytest.mark.parametrize(
    ("intervals", "exclusive"),
    [
        # One after another: each kernel its whole duration.
        ([("gemm", 0, 10), ("silu", 10, 15), ("gemm", 15, 30)], {"gemm": 25, "silu": 5}),
        # Programmatic dependent launch: silu launched at 40 waits for gemm's end at 100; only its tail.
        ([("silu", 40, 130), ("gemm", 0, 100)], {"gemm": 100, "silu": 30}),
        # A kernel inside another's interval adds nothing; the kernel after both, from the latest end.
        ([("gemm", 0, 50), ("norm", 10, 20), ("add", 30, 60)], {"gemm": 50, "norm": 0, "add": 10}),
        # The gaps between kernels are nobody's.
        ([("gemm", 0, 10), ("silu", 30, 40), ("gemm", 45, 50)], {"gemm": 15, "silu": 10}),
    ],
    ids=["sequential", "pdl-overlap", "inside-another", "gaps"],
)
def test_a_kernels_exclusive_time_is_what_no_earlier_kernel_covered(intervals, exclusive) -> None:
    assert exclusive_us(intervals) == exclusive


def _kernel(name: str, start: float, end: float, device_index: int = 0, annotation: bool = False):
    """A device event as torch.profiler's `events()` gives it."""
    return FunctionEvent(
        id=0,
        name=name,
        thread=0,
        start_us=start,
        end_us=end,
        device_type=DeviceType.CUDA,
        device_index=device_index,
        is_user_annotation=annotation,
    )


def _average(name: str, count: int, device_us: float, cpu_us: float = 0.0, on_device: bool = True):
    """An entry of torch.profiler's `key_averages()`: the fields `summarize` reads."""
    device_type = DeviceType.CUDA if on_device else DeviceType.CPU
    return SimpleNamespace(
        key=name,
        count=count,
        self_device_time_total=device_us,
        self_cpu_time_total=cpu_us,
        device_type=device_type,
    )


def test_the_summary_has_each_kernels_exclusive_time_and_the_devices_busy_time() -> None:
    """Two steps of a GEMM and the SiLU launched under programmatic dependent launch 60 us before the GEMM
    ends; a GPU user annotation around them (not work of its own), and a kernel on a second device at the
    same time (its own device's busy time)."""
    events = [
        _kernel("gemm", 0, 100),
        _kernel("silu", 40, 130),
        _kernel("gemm", 300, 400),
        _kernel("silu", 340, 430),
        _kernel("ProfilerStep#1", 0, 500, annotation=True),
        _kernel("all_reduce", 0, 50, device_index=1),
        FunctionEvent(id=0, name="aten::mm", thread=0, start_us=0, end_us=30),
    ]
    averages = [
        _average("gemm", 2, 200.0),
        _average("silu", 2, 180.0),
        _average("all_reduce", 1, 50.0),
        _average("aten::mm", 2, 200.0, cpu_us=30.0, on_device=False),
    ]
    summary = summarize(averages, [1, 1], 0.001, True, events)
    assert summary["device_us_total"] == 430.0  # the durations' sum, as before
    assert (summary["device_busy_us_total"], summary["device_overlap_us"]) == (310.0, 120.0)
    exclusive = {entry["name"]: entry.get("exclusive_device_us") for entry in summary["top"]}
    assert exclusive == {"gemm": 200.0, "aten::mm": None, "silu": 60.0, "all_reduce": 50.0}
    assert summary["top"][2]["self_device_us"] == 180.0  # the whole durations stay, for the .txt's readers


def _kernel_entry(name: str, count: int, device_us: float, exclusive_us: float) -> dict:
    """A kernel's entry in a summary, as `summarize` writes it."""
    return {
        "name": name,
        "count": count,
        "self_device_us": device_us,
        "self_cpu_us": 0.0,
        "on_device": True,
        "exclusive_device_us": exclusive_us,
    }


def test_a_profile_with_exclusive_times_is_tabulated_by_them() -> None:
    """The SiLU's interval holds its wait for the GEMM before it: by its whole duration it came first."""
    summary = {
        "steps": 2,
        "rows_per_step": [1, 1],
        "wall_s": 0.006,
        "measured": "device",
        "device_us_total": 3850.0,
        "device_busy_us_total": 2106.0,
        "device_overlap_us": 1744.0,
        "cpu_us_total": 50.0,
        "top": [
            _kernel_entry("silu", 2, 2050.0, 406.0),
            _kernel_entry("gemm", 4, 1800.0, 1700.0),
            {
                "name": "aten::mm",
                "count": 4,
                "self_device_us": 1800.0,
                "self_cpu_us": 50.0,
                "on_device": False,
            },
        ],
    }
    head, rows = profile_table("**fp8, 1 sequence a step**", summary).split("\n\n")
    assert head == (
        "**fp8, 1 sequence a step**: 2 steps of 1 rows; device busy 1053 us a step (kernels overlapping "
        "under programmatic dependent launch: 872 us a step counted once, from the earlier kernel's end), "
        "wall 3.00 ms a step while profiled"
    )
    assert rows.splitlines()[2:] == ["| `gemm` | 850.0 | 80.7% | 2 |", "| `silu` | 203.0 | 19.3% | 1 |"]


def test_a_profile_never_overwrites_another_of_the_same_millisecond(tmp_path: Path, monkeypatch) -> None:
    """Four StartProfile / request pairs in one second wrote two summaries (the name had the second)."""
    monkeypatch.setattr(time, "time", lambda: 1_764_800_000.25)
    first = _new_stem(tmp_path)
    assert first.name == f"profile-20251203T221320250Z-{os.getpid()}"
    first.with_suffix(".json").write_text("{}")
    second = _new_stem(tmp_path)
    second.with_suffix(".json").write_text("{}")
    assert second.name == f"{first.name}-2" and _new_stem(tmp_path).name == f"{first.name}-3"


def test_a_profiler_failing_as_it_stops_never_fails_the_step(tmp_path: Path, caplog) -> None:
    """Only OSError (writing) was caught: the profiler's own error as it stopped went up the engine step."""

    class Broken:
        def stop(self) -> None:
            raise RuntimeError("the profiler's own error")

    profiler = StepProfiler(torch.device("cpu"))
    profiler._run = _Run(tmp_path, num_steps=1, profiler=Broken(), started=0.0)
    profiler.forward_launched(3)
    profiler.step_ended()  # the profile's last step: it stops
    assert profiler._run is None and "the profile could not be written" in caplog.text
