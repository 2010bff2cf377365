"""One folder and report.md from the calls of `scripts/gpu_check.sh` on one lease.

The calls (docs/GPU.md: call 1, then call 2 sent at once while the machine is warm, with the steps call 1
skipped for time) are joined as if one call had run them all:

    python -m sluice.benchmarks.gpu.merge_calls OUT CALL_OUT [CALL_OUT ...]

Each step's records (its status, its result, its variants' records) come from the last call that ran it
(status not "skipped", or records without a status: the call ended inside the step, which the merged
status then says), else from the first call that recorded it; so do the files that step writes
(`STEP_FILES`, its `profiles/<step>/` and its servers' `profiles/<step>-<server>/`). The logs are joined,
each call's under a line naming it. The calls' machine records (`check_report.REPORT_STEP`, written by
each call's own report) stay, in order (an `unrecorded` one for a call cut before its report): the
report's head gives each call's time and budget and says whether they ran on one card. Then OUT/report.md
is built as the script builds it. Exits as `check_report` does: 0 when every step passed or was skipped,
1 otherwise; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sluice.benchmarks.gpu.check_report import REPORT_STEP, build_report
from sluice.benchmarks.gpu.step_context import PLANS, RESULTS, read_results
from sluice.benchmarks.gpu.step_profiles import PROFILES_DIR

# The files in OUT that a step writes, by step (the others write only records).
STEP_FILES = {
    "gpu_check": ("gpu_check.md",),
    "kernel_bench": ("kernel_bench.md",),
    "serve_bench": ("bench_serve.json",),
    "large": ("bench_large.json",),
}
LOGS = ("steps.log", "servers.log")


def _ran(records: list[dict[str, Any]]) -> set[str]:
    """The steps a call ran: those with a status other than "skipped", and those with records but no
    status (the call ended inside the step, e.g. at the device tool's limit)."""
    statuses = {r["step"]: r["status"] for r in records if "status" in r}
    steps = {r["step"] for r in records if r["step"] != REPORT_STEP}
    return {step for step in steps if statuses.get(step, "cut") != "skipped"}


def step_profile_dirs(call_dir: Path, step: str) -> list[Path]:
    """A call's profile folders of `step`: profiles/<step> (the large step's) and profiles/<step>-<server>
    (a variant server's, `variant_servers.variant_server`)."""
    root = call_dir / PROFILES_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.split("-", 1)[0] == step)


def step_sources(calls: Sequence[list[dict[str, Any]]]) -> dict[str, int]:
    """Which call each step's records come from (an index into `calls`): the last that ran it (`_ran`),
    else the first that recorded it."""
    sources: dict[str, int] = {}
    for index, records in enumerate(calls):
        ran = _ran(records)
        for step in dict.fromkeys(r["step"] for r in records if r["step"] != REPORT_STEP):
            if step not in sources or step in ran:
                sources[step] = index
    return sources


def merge_records(calls: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The calls' records of each step from its source call (`step_sources`), steps in the order the
    calls first recorded them (a step its call ended inside gets a "timed out" status saying so), then
    each call's machine record in call order (`unrecorded` where it has none)."""
    sources = step_sources(calls)
    merged = [r for index, records in enumerate(calls) for r in records if sources.get(r["step"]) == index]
    for step, index in sources.items():
        if not any("status" in r for r in calls[index] if r["step"] == step):
            note = f"call {index + 1} ended inside this step: it recorded no status (merge_calls)"
            merged.append({"step": step, "status": "timed out", "seconds": 0, "limit_s": 0, "note": note})
    first_seen: dict[str, int] = {}
    for records in calls:
        for record in records:
            first_seen.setdefault(record["step"], len(first_seen))
    merged.sort(key=lambda r: first_seen[r["step"]])  # stable: a step's records keep their order
    machines = [
        next((r for r in records if r["step"] == REPORT_STEP), {"step": REPORT_STEP, "unrecorded": True})
        for records in calls
    ]
    return merged + machines


def merge_calls(out: Path, call_dirs: Sequence[Path], mode: str | None = None) -> bool:
    """Writes OUT (a new or empty folder) from `call_dirs`, in the order they ran, and its report.md in
    `mode` (None: the first machine record's, else "gpu"); True when every step passed or was skipped.
    ValueError naming the argument for a call folder without results or an OUT that holds files."""
    calls = []
    for call in call_dirs:
        if not (call / RESULTS).is_file():
            raise ValueError(f"CALL_OUT: {call / RESULTS} does not exist")
        calls.append(read_results(call))
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"OUT: {out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    sources = step_sources(calls)
    for step, files in STEP_FILES.items():
        for name in files:
            if step in sources and (call_dirs[sources[step]] / name).is_file():
                shutil.copyfile(call_dirs[sources[step]] / name, out / name)
    for step, index in sources.items():
        for profiles in step_profile_dirs(call_dirs[index], step):
            shutil.copytree(profiles, out / PROFILES_DIR / profiles.name, copy_function=shutil.copyfile)
    for name in LOGS:
        with (out / name).open("w", encoding="utf-8") as log:
            for number, call in enumerate(call_dirs, 1):
                if (call / name).is_file():
                    log.write(f"# merge_calls: call {number} of {len(call_dirs)}, {call}\n")
                    log.write((call / name).read_text(encoding="utf-8", errors="replace"))
    records = merge_records(calls)
    (out / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    if mode is None:
        mode = next((r["mode"] for r in records if r["step"] == REPORT_STEP and "mode" in r), "gpu")
    text, ok = build_report(out, mode, 0.0, 0.0)
    (out / "report.md").write_text(text, encoding="utf-8")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the merged folder (new, or empty)")
    parser.add_argument("calls", type=Path, nargs="+", help="each call's OUT, in the order they ran")
    parser.add_argument("--mode", choices=tuple(PLANS), help="the calls' (default: their machine record's)")
    args = parser.parse_args(argv)
    try:
        ok = merge_calls(args.out, args.calls, args.mode)
    except ValueError as error:
        print(f"merge_calls: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out / 'report.md'}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
