"""benchmarks/bench_desktop_service.py --quick: the service started as users start it, over
simulated desktops; every figure is measured and follows from the others. No timing is
asserted: the benchmark prints figures, this checks that they are sound."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FIGURES = ("lease_p50_ms", "lease_p99_ms", "leases_per_s", "cpu_ms_per_lease", "act_p50_ms",
           "act_p99_ms", "relay_shot_p50_ms", "cpu_ms_per_step", "relayed_kb_per_step")


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


def test_the_quick_run_measures_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "service.json"
    done = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" /
                                               "bench_desktop_service.py"),
                           "--quick", "--clients", "1,4", "--json", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["clients"] for r in rows] == [1, 4]
    assert result["desktops"] == 2 * 4 + 4
    for row in rows:
        c = row["clients"]
        assert row["leases"] == c * result["leases_per_client"], row
        assert row["steps"] == c * result["steps_per_client"], row
        for key in FIGURES:
            assert _positive(row[key]), (c, key, row[key])
        assert row["lease_p50_ms"] <= row["lease_p99_ms"] and row["act_p50_ms"] <= row[
            "act_p99_ms"], row
    # Each step relays two full screenshots (the act reply's and a relayed one): the same
    # bytes per step however many clients share the service (a lost count would differ).
    sizes = {round(r["relayed_kb_per_step"]) for r in rows}
    assert len(sizes) == 1 and sizes.pop() > 100, rows
    assert "CPU ms/lease" in done.stdout and "lease p99 ms" in done.stdout
