"""The engine core process's OpenMP settings: a short spin before waiting threads sleep, unless the
caller's environment says otherwise."""

from __future__ import annotations

from sluice.engine.process.host_memory import MALLOC_TUNABLES
from sluice.engine.process.threads import CORE_GOMP_SPINCOUNT, core_process_environment

TUNABLES = {"GLIBC_TUNABLES": MALLOC_TUNABLES}


def test_the_core_process_gets_a_short_spin_by_default() -> None:
    env = core_process_environment({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": CORE_GOMP_SPINCOUNT, **TUNABLES}
    assert int(CORE_GOMP_SPINCOUNT) < 300_000  # libgomp's own default spins ~10 ms


def test_the_callers_openmp_wait_settings_win() -> None:
    assert core_process_environment({"OMP_WAIT_POLICY": "ACTIVE"}) == {
        "OMP_WAIT_POLICY": "ACTIVE",
        **TUNABLES,
    }
    assert core_process_environment({"GOMP_SPINCOUNT": "5"}) == {"GOMP_SPINCOUNT": "5", **TUNABLES}


def test_the_malloc_tunables_join_the_callers_and_keep_its_tcache_setting() -> None:
    env = core_process_environment({"GLIBC_TUNABLES": "glibc.malloc.mxfast=0"})
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.mxfast=0:{MALLOC_TUNABLES}"
    kept = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=3"}
    assert core_process_environment(kept)["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=3"


def test_the_servers_api_key_stays_out_of_the_core() -> None:
    """SLUICE_API_KEY is the frontend's: the core and its tensor-parallel workers never read it."""
    env = core_process_environment({"PATH": "/bin", "SLUICE_API_KEY": "secret"})
    assert "SLUICE_API_KEY" not in env and env["PATH"] == "/bin"
