"""The engine core process's OpenMP settings: a short spin before waiting threads sleep, unless the
caller's environment says otherwise."""

from __future__ import annotations

from sluice.engine.process.threads import CORE_GOMP_SPINCOUNT, core_process_environment


def test_the_core_process_gets_a_short_spin_by_default() -> None:
    env = core_process_environment({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": CORE_GOMP_SPINCOUNT}
    assert int(CORE_GOMP_SPINCOUNT) < 300_000  # libgomp's own default spins ~10 ms


def test_the_callers_openmp_wait_settings_win() -> None:
    assert core_process_environment({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert core_process_environment({"GOMP_SPINCOUNT": "5"}) == {"GOMP_SPINCOUNT": "5"}
