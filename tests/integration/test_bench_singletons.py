"""benchmarks/bench_singletons.py --quick --json: every central component is measured, each
way, and each figure is a positive number that follows from the others. No timing is
asserted: the benchmark prints figures, this checks that they are sound."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Every component, and how each is measured.
EXPECTED = {
    ("coordinator", "in-process"), ("coordinator", "Ray actor"),
    ("desktop pool", "in-process"), ("desktop pool", "Ray actor"),
    ("storage, step files by runners", "in-process"),
    ("storage, step files by runners", "Ray actor"),
    ("storage, step files through it", "in-process"),
    ("storage, step files through it", "Ray actor"),
    ("loader, 10,000 recorded", "in-process"), ("loader, 100,000 recorded", "in-process"),
    ("endpoints server (unchanged, 304)", "HTTP"), ("endpoints server (the list, 200)", "HTTP"),
}
UNITS = {"coordinator": "episode", "desktop pool": "episode",
         "storage, step files by runners": "episode", "storage, step files through it": "step",
         "loader": "episode", "endpoints server": "request"}


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


def test_the_quick_run_measures_every_component_with_positive_figures() -> None:
    done = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "bench_singletons.py"),
                           "--quick", "--json"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)

    assumptions = out["assumptions"]
    assert 9 <= assumptions["steps_per_episode"] <= 11  # the sim world's mean, ~10
    assert _positive(assumptions["runner_steps_per_s"])
    assert assumptions["step_times_s"] == [4.8, 2.0]
    assert assumptions["target"] == {"desktops": 10_000, "step_s": 2.0}

    rows = out["rows"]
    assert {(r["component"], r["how"]) for r in rows} == EXPECTED
    assert len(rows) == len(EXPECTED)
    for r in rows:
        name = r["component"]
        unit = next(u for prefix, u in UNITS.items() if name.startswith(prefix))
        assert r["unit"] == unit, name
        for key in ("units", "window_s", "cpu_s", "rate_per_s", "cpu_fraction",
                    "cpu_ms_per_unit", "max_per_s"):
            assert _positive(r[key]), (name, key, r[key])
        assert set(r["desktops"]) == {"at_4.8s", "at_2.0s"}
        assert all(_positive(v) for v in r["desktops"].values()), (name, r["desktops"])
        # The figures follow from one another: max /s = rate / CPU fraction = units / CPU.
        assert math.isclose(r["max_per_s"], r["units"] / r["cpu_s"], rel_tol=0.01), name
        assert math.isclose(r["cpu_ms_per_unit"], 1000 * r["cpu_s"] / r["units"],
                            rel_tol=0.01), name
        assert math.isclose(r["desktops"]["at_4.8s"] / r["desktops"]["at_2.0s"], 2.4,
                            rel_tol=0.01), name
        assert r["meets_target"] == (r["desktops"]["at_2.0s"] >= 10_000), name

    by = {(r["component"], r["how"]): r for r in rows}
    coordinator = by["coordinator", "Ray actor"]["detail"]
    assert coordinator["in_flight"] > 0 and coordinator["runners"] > 1
    for key in ("poll_wall_ms", "driver_poll_wall_ms_p50"):
        assert _positive(coordinator[key]), key
    pool = by["desktop pool", "Ray actor"]["detail"]
    assert pool["quarantined"] == 0 and pool["leased"] > 0
    for size in ("10,000", "100,000"):
        loader = by[f"loader, {size} recorded", "in-process"]["detail"]
        assert _positive(loader["poll_ms_p50"]) and _positive(loader["record_us_per_episode"])
