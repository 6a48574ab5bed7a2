"""The result scripts (scripts/show_result.py, experiment_result_stats.py,
compare_exp_result.py, view_trajectory.py, plot_run.py) and the library they share,
cua_rollout.results, on synthetic run directories whose figures are worked out by hand in
tests/results_fixtures.py."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from cua_rollout.cli import (
    compare_exp_result,
    experiment_result_stats,
    plot_run,
    show_result,
    view_trajectory,
)
from cua_rollout.results import load_run, select_versions, version_order
from tests.results_fixtures import (
    RUN_A,
    RUN_B,
    RUN_V,
    V1,
    V2,
    V3,
    Ep,
    make_osworld_run,
    make_run,
)
from tests.support import REPO_ROOT, unavailable

REPO = REPO_ROOT
SCRIPTS = REPO / "scripts"

ALL_SCRIPTS = (
    "show_result.py",
    "experiment_result_stats.py",
    "compare_exp_result.py",
    "view_trajectory.py",
    "plot_run.py",
)


@pytest.fixture
def run_a(tmp_path: Path) -> Path:
    return make_run(tmp_path, "run_a", RUN_A, screenshots=True)


@pytest.fixture
def run_b(tmp_path: Path) -> Path:
    return make_run(tmp_path, "run_b", RUN_B)


def _json_of(capsys: pytest.CaptureFixture[str], main, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


# --------------------------------------------------------------------------- show_result


def test_show_result_figures_of_a_hand_built_run(run_a, capsys):
    summary = _json_of(capsys, show_result.main, [str(run_a), "--json"])
    assert summary["schema"] == "show_result/1"
    assert summary["layout"] == "cua-rollout"
    assert summary["problems"] == []
    overall = summary["overall"]
    # 9 scored episodes with rewards summing to 4.5; infra_error and cancelled left out.
    assert overall["episodes"] == 13
    assert overall["scored_episodes"] == 9
    assert overall["success_rate"] == pytest.approx(0.5)
    # Task means t1 1/2, t2 1/4, t3 2/3, t4 1/2 (t5 has only infra errors: no score).
    assert overall["avg_at_k"] == pytest.approx((0.5 + 0.25 + 2 / 3 + 0.5) / 4)
    assert overall["pass_at_k"] == pytest.approx(3 / 4)
    assert (overall["tasks"], overall["scored_tasks"], overall["solved_tasks"]) == (5, 4, 3)
    assert (overall["k_min"], overall["k_max"]) == (2, 3)
    assert overall["status_counts"] == {
        "success": 4, "failure": 3, "max_steps": 1, "timeout": 1,
        "infra_error": 3, "cancelled": 1,
    }  # fmt: skip
    # Means over scored episodes only.
    assert overall["mean_steps"] == pytest.approx((3 + 5 + 4 + 15 + 2 + 2 + 6 + 1 + 1) / 9)
    assert overall["mean_duration_s"] == pytest.approx(
        (30 + 50 + 40 + 150 + 20 + 20 + 600 + 10 + 10) / 9
    )

    domains = summary["domains"]
    assert list(domains) == ["chrome", "gimp", "os"]
    assert domains["chrome"]["success_rate"] == pytest.approx(1.5 / 4)
    assert domains["chrome"]["pass_at_k"] == pytest.approx(0.5)
    assert domains["gimp"]["success_rate"] == pytest.approx(2 / 3)
    assert domains["os"]["success_rate"] == pytest.approx(0.5)
    assert domains["os"]["status_counts"]["infra_error"] == 2
    # Groups appear only for the domains present: chrome -> Daily, gimp -> Professional.
    assert set(summary["groups"]) == {"Daily", "Professional"}
    assert summary["groups"]["Daily"]["success_rate"] == pytest.approx(1.5 / 4)
    # The infeasible task (os/t4) apart from the feasible ones.
    assert summary["infeasible"]["scored_tasks"] == 1
    assert summary["infeasible"]["success_rate"] == pytest.approx(0.5)
    assert summary["feasible"]["success_rate"] == pytest.approx(3.5 / 7)
    assert summary["feasible"]["avg_at_k"] == pytest.approx((0.5 + 0.25 + 2 / 3) / 3)
    assert summary["feasible"]["pass_at_k"] == pytest.approx(2 / 3)


def test_show_result_table_for_humans(run_a, capsys):
    assert show_result.main([str(run_a)]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if "│" in line}
    assert {"chrome", "gimp", "os", "Daily", "Professional", "feasible", "infeasible", "all"} <= (
        set(rows)
    )
    assert "Office" not in rows
    assert "50.0%" in rows["all"] and "75.0%" in rows["all"] and "47.9%" in rows["all"]
    assert "avg@2-3" in out and "pass@2-3" in out


def test_office_group_accepts_short_and_osworld_domain_names(tmp_path, capsys):
    run = make_run(tmp_path, "office", [
        Ep("calc", "c1", 0, "success", 1.0),
        Ep("libreoffice_writer", "w1", 0, "failure", 0.0),
        Ep("impress", "i1", 0, "failure", 0.5),
        Ep("vs_code", "v1", 0, "success", 1.0),
    ], metrics=False)  # fmt: skip
    summary = _json_of(capsys, show_result.main, [str(run), "--json"])
    assert set(summary["groups"]) == {"Office", "Professional"}
    assert summary["groups"]["Office"]["scored_episodes"] == 3
    assert summary["groups"]["Office"]["success_rate"] == pytest.approx(1.5 / 3)
    assert summary["groups"]["Professional"]["success_rate"] == pytest.approx(1.0)


def test_show_result_reads_osworlds_own_layout(tmp_path, capsys):
    run = make_osworld_run(tmp_path)
    summary = _json_of(capsys, show_result.main, [str(run), "--json"])
    assert summary["layout"] == "osworld"
    overall = summary["overall"]
    # chrome/a 1.0, chrome/b 0.0, libreoffice_calc/c 0.5; vlc/unfinished has no result.txt.
    assert overall["scored_episodes"] == 3
    assert overall["success_rate"] == pytest.approx(0.5)
    assert overall["pass_at_k"] == pytest.approx(1 / 3)
    assert overall["status_counts"]["success"] == 1
    assert overall["status_counts"]["failure"] == 2
    assert overall["mean_steps"] == pytest.approx((3 + 2 + 1) / 3)  # traj.jsonl line counts
    assert overall["mean_duration_s"] is None
    assert set(summary["domains"]) == {"chrome", "libreoffice_calc"}
    assert set(summary["groups"]) == {"Office", "Daily"}


def test_empty_run_dir_has_no_finished_episodes_and_exits_0(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert show_result.main([str(empty)]) == 0
    assert "no finished episodes" in capsys.readouterr().out
    summary = _json_of(capsys, show_result.main, [str(empty), "--json"])
    assert summary["overall"]["episodes"] == 0
    assert summary["overall"]["success_rate"] is None
    assert summary["domains"] == {} and summary["groups"] == {}


def test_broken_lines_are_reported_with_file_and_line_and_skipped(tmp_path, capsys):
    run = make_run(tmp_path, "broken", [Ep("os", "a", 0, "success", 1.0),
                                        Ep("os", "b", 0, "failure", 0.0)])  # fmt: skip
    path = run / "results.jsonl"
    good = path.read_text().splitlines()
    bad_status = json.loads(good[1]) | {"status": "exploded"}
    no_reward = json.loads(good[1]) | {"status": "timeout", "reward": None, "task_id": "c"}
    path.write_text("\n".join([
        good[0],
        good[1][: len(good[1]) // 2],  # a crash cut this line short
        json.dumps(bad_status),
        "[1, 2]",
        json.dumps(no_reward),
        good[1],
    ]) + "\n")  # fmt: skip
    assert show_result.main([str(run), "--json"]) == 0
    captured = capsys.readouterr()
    summary, err = json.loads(captured.out), captured.err
    assert summary["overall"]["episodes"] == 2
    assert summary["overall"]["success_rate"] == pytest.approx(0.5)
    for line, field in ((2, "not valid JSON"), (3, "status"), (4, "not a JSON object"),
                        (5, "reward")):  # fmt: skip
        assert re.search(rf"{re.escape(str(path))}:{line}: .*{field}", err), (line, err)
    assert len(summary["problems"]) == 4


def test_a_missing_run_dir_is_a_usage_error(tmp_path, capsys):
    missing = tmp_path / "nope"
    for main in (show_result.main, experiment_result_stats.main, view_trajectory.main,
                 plot_run.main):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            main([str(missing)])
        assert exc.value.code == 2
        assert f"{missing}: no such directory" in capsys.readouterr().err
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(SystemExit) as exc:
        compare_exp_result.main([str(a_file), str(a_file)])
    assert exc.value.code == 2
    assert f"{a_file}: not a directory" in capsys.readouterr().err


def test_help_of_every_script(capsys):
    for main in (show_result.main, experiment_result_stats.main, compare_exp_result.main,
                 view_trajectory.main, plot_run.main):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            main(["--help"])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert "RUN_DIR" in out or "RUN_A" in out
        assert "OSWorld" in out


def test_a_later_line_for_the_same_episode_wins(tmp_path):
    run = make_run(tmp_path, "dup", [Ep("os", "a", 0, "infra_error", None),
                                     Ep("os", "a", 0, "success", 1.0)])  # fmt: skip
    loaded = load_run(run)
    assert [e.status for e in loaded.episodes] == ["success"]
    assert loaded.problems == []  # a rerun superseding a line is how resume works


# --------------------------------------------------------------------------- model versions
# RUN_V (tests/results_fixtures.py), by start time (pass 0 unless said):
#   100 os/a/0 V1 success 1.0       130 os/b/1 V2 failure 0.0      160 chrome/d/0 V3 1.0, pass 1
#   110 os/a/1 V1 failure 0.0       140 chrome/c/0 V2 success 1.0  170 chrome/d/1 V3 infra, pass 1
#   120 os/b/0 V1->V2 success 1.0   150 chrome/c/1 V2->V3 0.5      180 chrome/e/0 none infra, pass 1
# V1, V2, V3 = zz-ckpt, aa-ckpt, mm-ckpt: neither name order nor file order (d/0 is first).


@pytest.fixture
def run_v(tmp_path: Path) -> Path:
    return make_run(tmp_path, "run_v", RUN_V, metrics=False)


def _ids(run) -> set[str]:
    return {e.episode_id for e in run.episodes}


def test_versions_are_ordered_by_first_use_in_start_time(run_v):
    run = load_run(run_v)
    assert version_order(run) == [V1, V2, V3]
    assert sorted(version_order(run)) != version_order(run)  # not by name
    mixed = {e.episode_id: e.model_versions for e in run.episodes if e.mixed_versions}
    assert mixed == {"os/b/0": (V1, V2), "chrome/c/1": (V2, V3)}
    # A narrowed run keeps the whole run's order (and numbering).
    assert version_order(select_versions(run, min_version=V3)) == [V1, V2, V3]


def test_min_version_keeps_episodes_that_started_on_it_or_later(run_v, capsys):
    run = load_run(run_v)
    # os/b/0 ended on V2 but started on V1: out. chrome/e/0 has no version: out.
    assert _ids(select_versions(run, min_version=V2)) == {
        "os/b/1", "chrome/c/0", "chrome/c/1", "chrome/d/0", "chrome/d/1"}  # fmt: skip
    assert _ids(select_versions(run, min_version=V3)) == {"chrome/d/0", "chrome/d/1"}
    assert _ids(select_versions(run, min_version=V1)) == _ids(run) - {"chrome/e/0"}

    summary = _json_of(capsys, show_result.main, [str(run_v), "--json", "--min-version", V2])
    overall = summary["overall"]
    # Scored: b/1 0.0, c/0 1.0, c/1 0.5, d/0 1.0; d/1 is an infra error.
    assert (overall["episodes"], overall["scored_episodes"]) == (5, 4)
    assert overall["success_rate"] == pytest.approx(2.5 / 4)
    assert overall["mixed_episodes"] == summary["mixed_episodes"] == 1  # chrome/c/1
    assert summary["versions"] == [V1, V2, V3]  # the whole run's
    assert summary["selection"] == {"min_version": V2, "exclude_mixed": False,
                                    "excluded_episodes": 4}  # fmt: skip

    assert show_result.main([str(run_v), "--min-version", V2]) == 0
    out = capsys.readouterr().out
    assert f"model versions in order of first use (3): {V1}, {V2}, {V3}; mixed episodes: 1" in out
    assert f"selected: first version {V2} or later (4 episodes left out)" in out


def test_exclude_mixed_alone_and_with_min_version(run_v, capsys):
    summary = _json_of(capsys, show_result.main, [str(run_v), "--json", "--exclude-mixed"])
    assert summary["overall"]["episodes"] == 7 and summary["mixed_episodes"] == 0
    assert summary["overall"]["success_rate"] == pytest.approx(3 / 5)  # a/0 a/1 b/1 c/0 d/0
    assert summary["selection"]["excluded_episodes"] == 2
    summary = _json_of(capsys, show_result.main,
                       [str(run_v), "--json", "--exclude-mixed", "--min-version", V2])  # fmt: skip
    assert summary["overall"]["episodes"] == 4  # b/1 c/0 d/0 d/1
    assert summary["overall"]["success_rate"] == pytest.approx(2 / 3)
    assert summary["selection"] == {"min_version": V2, "exclude_mixed": True,
                                    "excluded_episodes": 5}  # fmt: skip


def test_an_unknown_min_version_is_a_usage_error(run_v, run_a, tmp_path, capsys):
    expected = (f"show_result.py: error: --min-version nope: not a model version of {run_v}; "
                f"its versions in order: {V1}, {V2}, {V3}")  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        show_result.main([str(run_v), "--min-version", "nope"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == expected
    # As a command: one line on stderr, nothing on stdout.
    done = _cli("show_result.py", str(run_v), "--min-version", "nope", cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr.strip()) == (2, "", expected)
    # Every run must know V: run_a (versions m-1 only) does not know V2.
    with pytest.raises(SystemExit) as exc:
        experiment_result_stats.main([str(run_v), str(run_a), "--min-version", V2])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"experiment_result_stats.py: error: --min-version {V2}: not a model version of "
        f"{run_a}; its versions in order: m-1")  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        compare_exp_result.main([str(run_a), str(run_v), "--min-version", "m-1",
                                 "-o", str(tmp_path / "c.jsonl")])  # fmt: skip
    assert exc.value.code == 2
    assert f"not a model version of {run_v}; its versions in order: {V1}, {V2}, {V3}" in (
        capsys.readouterr().err)
    # A run without versions (OSWorld's layout) has none to name.
    osworld = make_osworld_run(tmp_path)
    with pytest.raises(SystemExit) as exc:
        show_result.main([str(osworld), "--min-version", V1])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().endswith("its versions in order: none")


def test_by_version_rows_by_hand(run_v, capsys):
    summary = _json_of(capsys, show_result.main, [str(run_v), "--json", "--by-version"])
    rows = {row["version"]: row for row in summary["by_version"]["rows"]}
    assert [row["version"] for row in summary["by_version"]["rows"]] == [V1, V2, V3, None]
    # V1: a/0 1.0, a/1 0.0, b/0 1.0 (mixed, under its first version).
    assert (rows[V1]["episodes"], rows[V1]["mixed_episodes"]) == (3, 1)
    assert rows[V1]["success_rate"] == pytest.approx(2 / 3)
    # V2: b/1 0.0, c/0 1.0, c/1 0.5 (mixed).
    assert (rows[V2]["episodes"], rows[V2]["mixed_episodes"]) == (3, 1)
    assert rows[V2]["success_rate"] == pytest.approx(0.5)
    # V3: d/0 1.0 and the infra error d/1 (counted, not scored).
    assert (rows[V3]["episodes"], rows[V3]["scored_episodes"]) == (2, 1)
    assert rows[V3]["success_rate"] == pytest.approx(1.0)
    assert rows[V3]["status_counts"]["infra_error"] == 1
    # No version: e/0, an infra error before any step.
    assert (rows[None]["episodes"], rows[None]["scored_episodes"]) == (1, 0)
    mixed = summary["by_version"]["mixed"]  # b/0 1.0, c/1 0.5
    assert (mixed["episodes"], mixed["success_rate"]) == (2, pytest.approx(0.75))
    assert summary["overall"]["success_rate"] == pytest.approx(4.5 / 7)
    assert summary["mixed_episodes"] == 2 and "by_pass" not in summary
    assert "by_version" not in _json_of(capsys, show_result.main, [str(run_v), "--json"])

    # The table: the same columns as per domain, plus mixed, a row per version.
    assert show_result.main([str(run_v), "--by-version"]) == 0
    out = capsys.readouterr().out
    table = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
             for line in out.splitlines() if line.startswith("│")}  # fmt: skip
    assert list(table) == [V1, V2, V3, "(no version)", "mixed", "all"]
    header = next(line for line in out.splitlines() if line.startswith("┃"))
    columns = [c.strip() for c in header.split("┃")[2:-1]]
    assert columns[:3] == ["tasks", "episodes", "success"] and "mixed" in columns

    def cell(row: str, column: str) -> str:
        return table[row][columns.index(column)]

    assert (cell(V1, "episodes"), cell(V1, "success"), cell(V1, "mixed")) == ("3", "66.7%", "1")
    assert (cell(V2, "success"), cell(V3, "success"), cell(V3, "infra")) == ("50.0%", "100.0%",
                                                                             "1")  # fmt: skip
    assert (cell("(no version)", "episodes"), cell("(no version)", "infra")) == ("0", "1")
    assert (cell("mixed", "episodes"), cell("mixed", "success")) == ("2", "75.0%")
    assert cell("all", "success") == "64.3%"
    # From --min-version on, the earlier versions have no row.
    summary = _json_of(capsys, show_result.main,
                       [str(run_v), "--json", "--by-version", "--min-version", V2])  # fmt: skip
    assert [row["version"] for row in summary["by_version"]["rows"]] == [V2, V3]
    # V2: b/1, c/0, c/1 as before (b/0, V1's, is left out of every row).
    assert summary["by_version"]["rows"][0]["episodes"] == 3
    assert summary["by_version"]["rows"][0]["mixed_episodes"] == 1
    assert summary["by_version"]["mixed"]["episodes"] == 1


def test_by_pass_rows(run_v, capsys):
    summary = _json_of(capsys, show_result.main, [str(run_v), "--json", "--by-pass"])
    rows = summary["by_pass"]
    assert [row["pass_index"] for row in rows] == [0, 1]
    # Pass 0: a/0 a/1 b/0 b/1 c/0 c/1 = 3.5 / 6; pass 1: d/0 1.0, d/1 and e/0 infra errors.
    assert rows[0]["success_rate"] == pytest.approx(3.5 / 6)
    assert (rows[1]["episodes"], rows[1]["scored_episodes"]) == (3, 1)
    assert rows[1]["success_rate"] == pytest.approx(1.0)
    assert show_result.main([str(run_v), "--by-pass"]) == 0
    out = capsys.readouterr().out
    firsts = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert firsts == ["0", "1", "all"] and "58.3%" in out


def test_old_records_without_the_version_fields(run_a, tmp_path, capsys):
    # RUN_A's lines predate the fields: model_version "m-1" only.
    assert "model_versions" not in (run_a / "results.jsonl").read_text()
    run = load_run(run_a)
    episode = run.episodes[0]
    assert (episode.first_model_version, episode.model_versions) == ("m-1", ("m-1",))
    assert (episode.mixed_versions, episode.pass_index, episode.group_size) == (False, 0, None)
    assert episode.group_id == "chrome/t1/pass-0"
    plain = _json_of(capsys, show_result.main, [str(run_a), "--json"])
    assert (plain["versions"], plain["mixed_episodes"]) == (["m-1"], 0)
    summary = _json_of(capsys, show_result.main,
                       [str(run_a), "--json", "--by-version", "--by-pass", "--min-version",
                        "m-1", "--exclude-mixed"])  # fmt: skip
    assert summary["overall"] == plain["overall"]  # nothing left out
    assert [(r["version"], r["episodes"]) for r in summary["by_version"]["rows"]] == [("m-1", 13)]
    assert [(r["pass_index"], r["episodes"]) for r in summary["by_pass"]] == [(0, 13)]

    # Old lines with no version at all, or only some of the new fields.
    lines = [json.loads(line) for line in (run_a / "results.jsonl").read_text().splitlines()]
    lines[0]["model_version"] = None  # chrome/t1/0: no version
    lines[1] |= {"model_version": "m-2", "model_versions": ["m-1", "m-2"]}  # no first, no mixed
    (run_a / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = load_run(run_a)
    assert run.problems == []
    by_id = {e.episode_id: e for e in run.episodes}
    assert (by_id["chrome/t1/0"].first_model_version, by_id["chrome/t1/0"].model_versions) == (
        None, ())  # fmt: skip
    t1_1 = by_id["chrome/t1/1"]
    assert (t1_1.first_model_version, t1_1.model_version, t1_1.mixed_versions) == (
        "m-1", "m-2", True)  # fmt: skip
    assert version_order(run) == ["m-1", "m-2"]
    summary = _json_of(capsys, show_result.main, [str(run_a), "--json", "--by-version"])
    assert [(r["version"], r["episodes"]) for r in summary["by_version"]["rows"]] == [
        ("m-1", 12), ("m-2", 0), (None, 1)]  # fmt: skip
    assert summary["mixed_episodes"] == 1


def test_a_version_field_of_the_wrong_type_is_a_problem(tmp_path, capsys):
    run = make_run(tmp_path, "bad", [Ep("os", "a", 0, "success", 1.0, versions=("v",)),
                                     Ep("os", "b", 0, "failure", 0.0, versions=("v",))],
                   metrics=False)  # fmt: skip
    path = run / "results.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    lines[1]["model_versions"] = "v"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    loaded = load_run(run)
    assert [e.episode_id for e in loaded.episodes] == ["os/a/0"]
    assert [(p.line, "model_versions" in p.message) for p in loaded.problems] == [(2, True)]


def test_stats_and_compare_narrow_every_run_by_version(run_v, tmp_path, capsys):
    # The same run with other rewards for os/a/0 (V1) and chrome/c/0 (V2).
    changed = {("os", "a", 0): ("failure", 0.0), ("chrome", "c", 0): ("failure", 0.0)}
    other = make_run(tmp_path, "run_w", [
        Ep(e.domain, e.task_id, e.rollout, *changed.get((e.domain, e.task_id, e.rollout),
                                                        (e.status, e.reward)),
           steps=e.steps, versions=e.versions, pass_index=e.pass_index, started_at=e.started_at)
        for e in RUN_V
    ], metrics=False)  # fmt: skip
    stats = _json_of(capsys, experiment_result_stats.main,
                     [str(run_v), str(other), "--json", "--min-version", V2])  # fmt: skip
    v, w = stats["runs"]
    assert v["versions"] == w["versions"] == [V1, V2, V3]
    assert (v["episodes"], v["mixed_episodes"], v["selection"]["excluded_episodes"]) == (5, 1, 4)
    assert v["success_rate"] == pytest.approx(2.5 / 4)
    assert w["success_rate"] == pytest.approx(1.5 / 4)
    assert stats["mean"]["mixed_episodes"] == pytest.approx(1.0)
    out_csv = tmp_path / "s.csv"
    assert experiment_result_stats.main([str(run_v), str(other), "--exclude-mixed",
                                         "-o", str(out_csv)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "run_v: no mixed episodes (2 episodes left out)" in out
    rows = {row["run"]: row for row in csv.DictReader(out_csv.read_text().splitlines())}
    assert rows["run_v"]["episodes"] == "7" and rows["run_v"]["mixed_episodes"] == "0"

    out = tmp_path / "changes.jsonl"
    assert compare_exp_result.main([str(run_v), str(other), "-o", str(out)]) == 0
    keys = [json.loads(line)["key"] for line in out.read_text().splitlines()]
    assert keys == ["chrome/c/0", "os/a/0"]
    assert compare_exp_result.main([str(run_v), str(other), "-o", str(out),
                                    "--min-version", V2]) == 0  # fmt: skip
    keys = [json.loads(line)["key"] for line in out.read_text().splitlines()]
    assert keys == ["chrome/c/0"]  # os/a/0 started on V1 in both runs
    summary = capsys.readouterr().out
    assert f"selected: first version {V2} or later (4 episodes left out)" in summary
    assert f"model versions (3): {V1}, {V2}, {V3}; mixed episodes: 1" in summary


# --------------------------------------------------------------------------- stats, compare


def test_experiment_stats_across_runs(run_a, run_b, tmp_path, capsys):
    stats = _json_of(capsys, experiment_result_stats.main, [str(run_a), str(run_b), "--json"])
    a, b = stats["runs"]
    assert (a["run"], b["run"]) == ("run_a", "run_b")
    # Run B: 10 scored episodes summing to 4.5; task means 1/3, 3/4, 2/3, 0, 0; 3 solved.
    assert b["success_rate"] == pytest.approx(0.45)
    assert b["avg_at_k"] == pytest.approx((1 / 3 + 0.75 + 2 / 3) / 5)
    assert b["pass_at_k"] == pytest.approx(3 / 5)
    assert b["infra_error"] == 1 and b["cancelled"] == 1
    assert stats["mean"]["success_rate"] == pytest.approx(0.475)
    assert stats["std"]["success_rate"] == pytest.approx(0.05 / math.sqrt(2))  # n - 1
    assert stats["std"]["pass_at_k"] == pytest.approx(0.15 / math.sqrt(2))
    # Tasks scored anywhere: t1..t6 (t5 only in B); solved somewhere: t1, t2, t3, t4.
    assert stats["any_correct"] == {"rate": pytest.approx(4 / 6), "solved_tasks": 4, "tasks": 6}

    out_csv = tmp_path / "stats.csv"
    assert experiment_result_stats.main([str(run_a), str(run_b), "-o", str(out_csv)]) == 0
    assert "any-correct rate: 66.7%" in capsys.readouterr().out
    rows = {row["run"]: row for row in csv.DictReader(out_csv.read_text().splitlines())}
    assert list(rows) == ["run_a", "run_b", "mean", "std", "pooled"]
    assert float(rows["run_a"]["success_rate"]) == pytest.approx(0.5)
    assert float(rows["std"]["success_rate"]) == pytest.approx(0.05 / math.sqrt(2))
    assert float(rows["pooled"]["pass_at_k"]) == pytest.approx(4 / 6)
    assert rows["run_a"]["infra_error"] == "3"


def test_std_is_empty_for_a_single_run(run_a, capsys):
    stats = _json_of(capsys, experiment_result_stats.main, [str(run_a), "--json"])
    assert stats["mean"]["success_rate"] == pytest.approx(0.5)
    assert stats["std"]["success_rate"] is None


def test_compare_lists_the_differences_both_ways(run_a, run_b, tmp_path, capsys):
    out = tmp_path / "changes.jsonl"
    assert compare_exp_result.main([str(run_a), str(run_b), "-o", str(out)]) == 0
    summary = capsys.readouterr().out
    changes = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(c["change"], c["key"]) for c in changes] == [
        ("a_better", "chrome/t1/0"),
        ("b_better", "chrome/t2/0"),
        ("status_changed", "chrome/t1/2"),
        ("status_changed", "os/t5/1"),
        ("only_in_a", "os/t4/0"),
        ("only_in_a", "os/t4/1"),
        ("only_in_b", "os/t6/0"),
    ]
    first = changes[0]
    assert (first["reward_a"], first["reward_b"], first["delta"]) == (1.0, 0.0, -1.0)
    assert first["domain"] == "chrome" and first["instruction"].startswith("Do the thing of t1")
    assert (changes[2]["status_a"], changes[2]["status_b"]) == ("infra_error", "success")
    assert changes[2]["delta"] is None
    assert re.search(r"a_better\s*│\s*1", summary) and re.search(r"only_in_a\s*│\s*2", summary)


def test_compare_per_task_to_csv_and_default_name(run_a, run_b, tmp_path, monkeypatch):
    out = tmp_path / "tasks.csv"
    assert compare_exp_result.main([str(run_a), str(run_b), "--by", "task", "-o", str(out)]) == 0
    rows = list(csv.DictReader(out.read_text().splitlines()))
    got = {(r["change"], r["key"]): r for r in rows}
    # t1: mean 1/2 -> 1/3; t2: 1/4 -> 3/4; t5: unscored -> unsolved; t4 and t6 one-sided.
    assert set(got) == {("a_better", "chrome/t1"), ("b_better", "chrome/t2"),
                        ("status_changed", "os/t5"), ("only_in_a", "os/t4"),
                        ("only_in_b", "os/t6")}  # fmt: skip
    assert float(got[("b_better", "chrome/t2")]["delta"]) == pytest.approx(0.5)
    assert got[("status_changed", "os/t5")]["status_a"] == "unscored"
    monkeypatch.chdir(tmp_path)
    assert compare_exp_result.main([str(run_a), str(run_b)]) == 0
    assert len((tmp_path / "compare_run_a_vs_run_b.jsonl").read_text().splitlines()) == 7


# --------------------------------------------------------------------------- viewer


def _step_count(page: str) -> int:
    return len(re.findall(r'<section class="step"', page))


def test_viewer_pages_links_images_and_escaping(run_a, tmp_path):
    out = tmp_path / "view"
    assert view_trajectory.main([str(run_a), "--out", str(out)]) == 0
    index = (out / "index.html").read_text()
    assert len(re.findall(r'href="episodes/[^"]+\.html"', index)) == len(RUN_A)
    assert index.count("<tr data-task=") == 5
    page = (out / "episodes" / "chrome__t2__1.html").read_text()
    assert _step_count(page) == 15
    # Escaped text: no markup from the trajectory reaches the page.
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)" in page
    assert "<b>not bold</b>" not in page
    # No URL anywhere: images are relative paths to files placed in the output dir.
    for html_file in out.rglob("*.html"):
        assert not re.search(r"(src|href)=\"(https?:|//|/)", html_file.read_text())
    for src in re.findall(r'<img src="([^"]+)"', page):
        placed = out / "episodes" / src
        assert placed.is_file()
        assert placed.stat().st_ino == (run_a / "chrome/t2/1" / placed.name).stat().st_ino
    assert 'loading="lazy"' in page and "base64" not in page
    # Step 1 saw step_0.png and clicked (300, 200); step 2 dragged (200, 500) -> (900, 300).
    step1, step2 = page.split('<section class="step"')[1:3]
    assert 'src="chrome__t2__1/step_0.png"' in step1
    assert 'viewBox="0 0 1280 720"' in step1
    assert re.search(r'<circle cx="300.0" cy="200.0"[^>]*class="click-point"', step1)
    assert re.search(r'<line x1="200.0" y1="500.0" x2="900.0" y2="300.0"', step2)


def test_viewer_one_task_and_default_out_dir(run_a, capsys):
    assert view_trajectory.main([str(run_a), "--task", "gimp/t3"]) == 0
    pages = sorted(p.name for p in (run_a / "viewer" / "episodes").glob("*.html"))
    assert pages == ["gimp__t3__0.html", "gimp__t3__1.html", "gimp__t3__2.html"]
    with pytest.raises(SystemExit) as exc:
        view_trajectory.main([str(run_a), "--task", "nope"])
    assert exc.value.code == 2
    assert "--task nope" in capsys.readouterr().err


def test_viewer_on_an_osworld_run_falls_back_to_the_previous_screenshot(tmp_path):
    run = make_osworld_run(tmp_path)
    out = tmp_path / "view"
    assert view_trajectory.main([str(run), "--out", str(out)]) == 0
    page = (out / "episodes" / "chrome__a__0.html").read_text()
    assert _step_count(page) == 3
    assert "screenshot not found: step_0.png" in page  # OSWorld saves no first screen
    assert 'src="chrome__a__0/step_1_20250101@000001000000.png"' in page


class _Chromium:
    """Headless Chromium on file:// pages; each call is one browser process of ours."""

    def __init__(self, profile: Path):
        exe = shutil.which("chromium")
        if exe is None:
            unavailable("chromium is not installed")
        self.exe = exe
        self.profile = profile

    def run(self, *args: str, timeout_s: float = 90) -> tuple[str, str]:
        cmd = [
            self.exe, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
            "--enable-logging=stderr", "--v=0", f"--user-data-dir={self.profile}", *args,
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout_s)
        finally:
            # The browser's helpers (zygote, renderers) share its new session: end ours only.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        assert proc.returncode == 0, err[-2000:]
        return out, err

    @staticmethod
    def console(err: str) -> list[str]:
        """The page's console lines (any level) and uncaught errors in the browser log."""
        return [line for line in err.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


@pytest.mark.integration
def test_viewer_in_headless_chromium(run_a, tmp_path):
    browser = _Chromium(tmp_path / "profile")
    out = tmp_path / "view"
    assert view_trajectory.main([str(run_a), "--out", str(out)]) == 0

    # The harness sees a script error when there is one.
    broken = tmp_path / "broken.html"
    broken.write_text("<!DOCTYPE html><p>x</p><script>undefinedFunction();</script>")
    _, err = browser.run("--dump-dom", broken.as_uri())
    assert any("Uncaught ReferenceError" in line for line in browser.console(err))

    page = out / "episodes" / "chrome__t2__1.html"
    dom, err = browser.run("--dump-dom", page.as_uri())
    assert browser.console(err) == []
    assert _step_count(dom) == 15
    assert dom.count('class="click-point"') == 3  # steps 1, 6, 11 of the 5-action cycle

    def rows(dom: str) -> list[str]:
        return re.findall(r'<tr data-task="([^"]+)"', dom)

    index = (out / "index.html").as_uri()
    dom, err = browser.run("--dump-dom", index)
    assert browser.console(err) == []
    assert rows(dom) == ["chrome/t1", "chrome/t2", "gimp/t3", "os/t4", "os/t5"]
    # #sort=... clicks the header once or twice; task means t3 2/3, t1 1/2, t4 1/2, t2 1/4,
    # t5 none (last either way); ties keep their order.
    dom, err = browser.run("--dump-dom", index + "#sort=reward:desc")
    assert browser.console(err) == []
    assert rows(dom) == ["gimp/t3", "chrome/t1", "os/t4", "chrome/t2", "os/t5"]
    assert re.search(r'data-col="reward"[^>]*data-dir="desc"', dom)
    dom, _ = browser.run("--dump-dom", index + "#sort=reward")
    assert rows(dom) == ["chrome/t2", "chrome/t1", "os/t4", "gimp/t3", "os/t5"]
    dom, _ = browser.run("--dump-dom", index + "#sort=task:desc")
    assert rows(dom) == ["os/t5", "os/t4", "gimp/t3", "chrome/t2", "chrome/t1"]

    shot = tmp_path / "episode.png"
    browser.run("--screenshot=" + str(shot), "--window-size=1280,2000", page.as_uri())
    with Image.open(shot) as image:
        assert image.size == (1280, 2000)


# --------------------------------------------------------------------------- text episodes
# Runs of text episodes (docs/text_modes.md), written as run.py writes them: the result line
# with its ``text`` object, and per episode task_config.json (the item, with its reference
# answer), episode.json, traj.jsonl (a line per turn), result.txt and messages.json.
#
# TEXT_A: math/m1 1.0 and 0.0, math/m2 an infra error (0 in the score), py/p1/0 1.0 after
# three turns of tool calls (one ok, three refused, the answer tool), py/p1/1 cancelled (left
# out), rag/r1 1.0. Scores: math 1/3, py 1, rag 1, all 3/5; numeric_match 2/4.
# TEXT_B: math/m1 1.0 and 1.0, math/m2 1.0, py/p1 0.0 and 1.0, rag/r1 1.0. Scores: math 1,
# py 1/2, rag 1, all 5/6.

# (domain = mode = benchmark, task_id, rollout, status, reward, final answer)
TEXT_A = [
    ("math", "m1", 0, "success", 1.0, "42"),
    ("math", "m1", 1, "failure", 0.0, "41 <b>bold</b>"),
    ("math", "m2", 0, "infra_error", None, None),
    ("py", "p1", 0, "success", 1.0, "832040"),
    ("py", "p1", 1, "cancelled", None, None),
    ("rag", "r1", 0, "success", 1.0, "the Orlen family"),
]
TEXT_B = [
    ("math", "m1", 0, "success", 1.0, "42"),
    ("math", "m1", 1, "success", 1.0, "42"),
    ("math", "m2", 0, "success", 1.0, "7"),
    ("py", "p1", 0, "failure", 0.0, "0"),
    ("py", "p1", 1, "success", 1.0, "832040"),
    ("rag", "r1", 0, "success", 1.0, "the Orlen family"),
]
_TEXT_METRICS = {"math": "numeric_match", "py": "numeric_match", "rag": "contains_answer"}
_TEXT_REFERENCES: dict[str, object] = {"m1": "42", "m2": ["7", "seven"], "p1": "832040",
                                       "r1": "the Orlen family"}  # fmt: skip
SCRIPT_OUTPUT = "<script>alert('pwned')</script>\n2"


def _wire(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def _call(call_id: str, name: str, arguments: str, output: str | None, returncode: int,
          error: str | None = None) -> dict:  # fmt: skip
    return {"id": call_id, "name": name, "arguments": arguments, "output": output,
            "returncode": returncode, "error": error, "duration_s": 0.0312}  # fmt: skip


def _turn_line(n: int, *, response: str = "", calls: list[dict] | None = None,
               wire: list[dict] | None = None, answer: str | None = None,
               reward: float = 0.0) -> dict:  # fmt: skip
    """A traj.jsonl line of a text turn, with the fields the runner writes."""
    line = {
        "step_num": n, "action_timestamp": f"20261124@0735510{n}0000",
        "action": ",".join(c["name"] for c in calls or []) or "answer",
        "response": response, "reward": reward if answer is not None else 0,
        "done": answer is not None, "info": {}, "screenshot_file": None,
        "response_tool_calls": wire or None, "model_endpoint": "http://127.0.0.1:8000/v1",
        "model_version": "m-1", "prompt_tokens": 100 * n, "completion_tokens": 7,
        "timing": {"model_s": 0.01, "env_s": 0.02, "overhead_s": 0.0, "step_s": 0.03},
    }  # fmt: skip
    if calls is not None:
        line["tool_calls"] = calls
    if answer is not None:
        line["answer"] = answer
    return line


def _text_turns(task_id: str, answer: str | None, reward: float) -> list[dict]:
    if task_id != "p1" or answer is None:
        # One reply whose text is the answer (math's way), or none at all.
        return [] if answer is None else [
            _turn_line(1, response=f"Thinking...\nFinal answer: {answer}", answer=answer,
                       reward=reward)]  # fmt: skip
    code = json.dumps({"code": 'print("<script>")\nprint(2)'})
    return [
        _turn_line(1, calls=[_call("c1", "python", code, SCRIPT_OUTPUT, 0)],
                   wire=[_wire("c1", "python", code)]),
        _turn_line(2, response="Let me try <i>again</i>", calls=[
            _call("c2", "python", '{"code": 1}', "error: code must be a string", 1,
                  "python: code must be a string"),
            _call("c3", "python", "{not json", "error: arguments are not a JSON object", 2,
                  "arguments are not a JSON object"),
            _call("c4", "browse", "{}", "error: no tool browse", 3, "unknown tool browse"),
        ], wire=[_wire("c2", "python", '{"code": 1}'), _wire("c3", "python", "{not json"),
                 _wire("c4", "browse", "{}")]),
        _turn_line(3, wire=[_wire("c5", "answer", json.dumps({"answer": answer}))],
                   answer=answer, reward=reward),
    ]  # fmt: skip


def _text_record(domain: str, task_id: str, rollout: int, status: str, reward: float | None,
                 answer: str | None, turns: list[dict], started_at: float) -> dict:  # fmt: skip
    calls = [c for t in turns for c in t.get("tool_calls", [])]
    by_tool: dict[str, int] = {}
    for c in calls:
        by_tool[c["name"]] = by_tool.get(c["name"], 0) + 1
    return {
        "episode_id": f"{domain}/{task_id}/{rollout}", "task_id": task_id, "domain": domain,
        "rollout": rollout, "attempt": 1 if status == "infra_error" else 0, "status": status,
        "reward": reward, "steps": len(turns), "started_at": started_at,
        "ended_at": started_at + 2.0, "instruction": f"Question {task_id}: what is x <y>?",
        "infeasible": False, "model_version": "m-1",
        "model_endpoints": ["http://127.0.0.1:8000/v1"], "first_model_version": "m-1",
        "model_versions": ["m-1"], "pass_index": 0, "group_id": f"{domain}/{task_id}/pass-0",
        "group_size": 2, "desktop": None, "desktops_tried": [],
        "error": "model endpoint unreachable" if status == "infra_error" else None,
        "last_action": "answer" if answer is not None else None, "parse_failures": 0,
        "timing": {"model_s": 0.05, "env_s": 0.03, "overhead_s": 0.0, "reset_s": 0.0,
                   "evaluation_s": 0.002, "lease_wait_s": 0.0, "outage_wait_s": 0.0},
        "runner": "runner-0", "node": "node-0",
        "text": {"mode": domain, "benchmark": domain, "metric": _TEXT_METRICS[domain],
                 "variant": "normalized", "answer": answer, "turns": len(turns),
                 "tool_calls": len(calls),
                 "tool_errors": sum(c["returncode"] == 1 for c in calls),
                 "malformed_calls": sum(c["returncode"] == 2 for c in calls),
                 "unknown_tools": sum(c["returncode"] == 3 for c in calls),
                 "over_limit": 0, "by_tool": by_tool},
        "duration_s": 2.0, "mixed_versions": False,
    }  # fmt: skip


def make_text_run(root: Path, name: str, episodes: list[tuple], *,
                  into: Path | None = None) -> Path:  # fmt: skip
    """A run of text ``episodes`` (TEXT_A's tuples); ``into``: added to that run's
    results.jsonl and directories instead (a run with desktop and text episodes)."""
    run_dir = into if into is not None else root / name
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (domain, task_id, rollout, status, reward, answer) in enumerate(episodes):
        turns = _text_turns(task_id, answer, reward or 0.0)
        record = _text_record(domain, task_id, rollout, status, reward, answer, turns,
                              1_700_000_000.0 + 3 * i)  # fmt: skip
        lines.append(json.dumps(record) + "\n")
        ep_dir = run_dir / domain / task_id / str(rollout)
        ep_dir.mkdir(parents=True, exist_ok=True)
        task = {
            "id": task_id, "instruction": record["instruction"],
            "question": record["instruction"], "answer": _TEXT_REFERENCES[task_id],
            "metadata": {"evaluation_metric": _TEXT_METRICS[domain]}, "mode": domain,
            "benchmark": domain,
            "metric": {"name": _TEXT_METRICS[domain], "variant": "normalized",
                       "tolerance": 1e-06},
        }  # fmt: skip
        (ep_dir / "task_config.json").write_text(json.dumps(task))
        (ep_dir / "episode.json").write_text(json.dumps(record))
        (ep_dir / "traj.jsonl").write_text("".join(json.dumps(t) + "\n" for t in turns))
        if reward is not None:
            (ep_dir / "result.txt").write_text(f"{reward}\n")
        messages = [{"role": "system", "content": f"You solve {domain} <problems>."},
                    {"role": "user", "content": record["instruction"]}]  # fmt: skip
        (ep_dir / "messages.json").write_text(json.dumps(messages))
    with (run_dir / "results.jsonl").open("a") as f:
        f.writelines(lines)
    if not (run_dir / "run.json").exists():
        (run_dir / "run.json").write_text(json.dumps({
            "run": name, "run_dir": str(run_dir), "started_at": 1_700_000_000.0,
            "ended_at": 1_700_000_100.0, "status": "finished", "config": {}, "versions": {},
            "host": "test", "command": "",
        }))  # fmt: skip
    return run_dir


@pytest.fixture
def text_a(tmp_path: Path) -> Path:
    return make_text_run(tmp_path, "text_a", TEXT_A)


@pytest.fixture
def text_b(tmp_path: Path) -> Path:
    return make_text_run(tmp_path, "text_b", TEXT_B)


def test_text_fixture_scores_by_hand(text_a, text_b, capsys):
    # The figures the stats and compare tests build on, as show_result reports them.
    a = _json_of(capsys, show_result.main, [str(text_a), "--json"])["text"]["rows"]
    assert {k: r["score"] for k, r in a["benchmarks"].items()} == {
        "math": pytest.approx(1 / 3), "py": 1.0, "rag": 1.0}  # fmt: skip
    assert (a["all"]["episodes"], a["all"]["score"]) == (5, pytest.approx(0.6))
    assert a["metrics"]["numeric_match"]["score"] == pytest.approx(0.5)
    assert (a["benchmarks"]["py"]["tool_errors"], a["benchmarks"]["py"]["malformed_calls"],
            a["benchmarks"]["py"]["unknown_tools"]) == (1, 1, 1)  # fmt: skip
    b = _json_of(capsys, show_result.main, [str(text_b), "--json"])["text"]["rows"]
    assert b["benchmarks"]["py"]["score"] == pytest.approx(0.5)
    assert b["all"]["score"] == pytest.approx(5 / 6)


def test_viewer_renders_a_text_episodes_turns_and_tool_calls(text_a, tmp_path):
    out = tmp_path / "view"
    assert view_trajectory.main([str(text_a), "--out", str(out)]) == 0
    page = (out / "episodes" / "py__p1__0.html").read_text()
    # No screenshots: no image, no "screenshot not found", no image directory.
    assert "<img" not in page and "screenshot" not in page and "<figure" not in page
    assert not [p for p in (out / "episodes").iterdir() if p.is_dir()]
    assert _step_count(page) == 0 and page.count('<section class="turn"') == 3
    # The question and the system prompt, escaped.
    assert '<pre class="instruction">Question p1: what is x &lt;y&gt;?</pre>' in page
    assert "You solve py &lt;problems&gt;." in page
    turn1, turn2, turn3 = page.split('<section class="turn"')[1:]
    # Turn 1: no reply text, one python call: pretty-printed arguments, the code as text,
    # the output (untrusted) escaped.
    assert "no text: the reply only called tools" in turn1
    assert '<code class="tool-name">python</code>' in turn1
    assert "ok (return code 0)" in turn1 and 'class="tool-call failed"' not in turn1
    assert '<pre class="arguments">{\n  &quot;code&quot;: ' in turn1
    assert ('<pre class="argument-text">print(&quot;&lt;script&gt;&quot;)\nprint(2)</pre>'
            in turn1)  # fmt: skip
    assert "<script>" not in page
    assert ('<pre class="tool-output">&lt;script&gt;alert(&#x27;pwned&#x27;)&lt;/script&gt;\n2'
            "</pre>") in turn1  # fmt: skip
    # Turn 2: the reply's text, and three refused calls, each highlighted with its reason.
    assert '<pre class="response">Let me try &lt;i&gt;again&lt;/i&gt;</pre>' in turn2
    assert turn2.count('class="tool-call failed"') == 3
    assert "tool error (return code 1)" in turn2
    assert "arguments not a JSON object (return code 2)" in turn2
    assert "unknown tool (return code 3)" in turn2
    assert '<p class="tool-error">error: python: code must be a string</p>' in turn2
    assert ('<p class="tool-error">arguments: not JSON</p><pre class="arguments">{not json</pre>'
            in turn2)  # fmt: skip
    # Turn 3: the answer tool's call (not in tool_calls) and the answer.
    assert '<code class="tool-name">answer</code>' in turn3
    assert '<pre class="turn-answer">832040</pre>' in turn3
    assert "<h3>Timing</h3>" in turn3 and "<th>prompt_tokens</th><td>300</td>" in turn3
    # The final answer against the task's reference, the metric and the score.
    answer = page.split('<section class="answer">')[1].split("</section>")[0]
    assert '<pre class="final-answer">832040</pre>' in answer
    assert '<pre class="reference">832040</pre>' in answer
    assert "<td>numeric_match (normalized)</td>" in answer
    assert '<tr class="st-success"><th>score</th><td>1</td></tr>' in answer
    assert "<th>tool errors / malformed / unknown / over limit</th><td>1/1/1/0</td>" in page

    # A math reply whose text is the answer; the answer is escaped.
    page = (out / "episodes" / "math__m1__1.html").read_text()
    assert page.count('<section class="turn"') == 1 and "<b>" not in page
    assert '<pre class="final-answer">41 &lt;b&gt;bold&lt;/b&gt;</pre>' in page
    assert '<tr class="st-failure"><th>score</th><td>0</td></tr>' in page
    # An infra error: no answer, no turns; the reference lists every accepted answer.
    page = (out / "episodes" / "math__m2__0.html").read_text()
    assert '<p class="empty">no answer</p>' in page
    assert '<pre class="reference">7\nseven</pre><p>(any one of these)</p>' in page
    assert "- (an infra error: 0 in the score)" in page
    assert "no turns recorded" in page and "model endpoint unreachable" in page
    # The index: turns, not steps, and the text benchmarks' scores.
    index = (out / "index.html").read_text()
    assert "3 turns" in index and " steps" not in index
    assert ("Text benchmarks: math 33.3% (3 episodes); py 100.0% (1 episodes); rag 100.0% "
            "(1 episodes); all 60.0%.") in index  # fmt: skip
    assert "<img" not in index


def test_viewer_names_the_tool_return_codes():
    from cua_rollout.envs import tools

    assert set(view_trajectory._TOOL_RETURNCODES) == {
        tools.TOOL_FAILED, tools.TOOL_MALFORMED, tools.TOOL_UNKNOWN, tools.TOOL_OVER_LIMIT}
    assert tools.TOOL_OK == 0
    assert view_trajectory._TOOL_RETURNCODES[tools.TOOL_MALFORMED].startswith("arguments not")
    assert view_trajectory._TOOL_RETURNCODES[tools.TOOL_UNKNOWN] == "unknown tool"


def test_viewer_a_task_config_without_the_reference(text_a, tmp_path):
    (text_a / "rag" / "r1" / "0" / "task_config.json").unlink()
    out = tmp_path / "view"
    assert view_trajectory.main([str(text_a), "--out", str(out), "--task", "rag/r1"]) == 0
    page = (out / "episodes" / "rag__r1__0.html").read_text()
    assert "not found (task_config.json missing or without one)" in page
    # The metric and the question from the result line instead.
    assert "<td>contains_answer (normalized)</td>" in page
    assert '<pre class="instruction">Question r1: what is x &lt;y&gt;?</pre>' in page


def test_viewer_desktop_pages_are_unchanged_next_to_text_episodes(run_a, tmp_path):
    before = tmp_path / "before"
    assert view_trajectory.main([str(run_a), "--out", str(before)]) == 0
    make_text_run(tmp_path, "run_a", TEXT_A, into=run_a)
    after = tmp_path / "after"
    assert view_trajectory.main([str(run_a), "--out", str(after)]) == 0
    pages = sorted(p.name for p in (before / "episodes").glob("*.html"))
    assert len(pages) == len(RUN_A)
    for name in pages:
        assert (after / "episodes" / name).read_text() == (before / "episodes" / name).read_text()
    assert len(list((after / "episodes").glob("*.html"))) == len(RUN_A) + len(TEXT_A)
    # The index: the desktop rows as before, the text scores above the table.
    index_before, index_after = ((d / "index.html").read_text() for d in (before, after))
    assert "Text benchmarks" not in index_before and "Text benchmarks" in index_after
    for row in re.findall(r'<tr data-task="(?:chrome|gimp|os)/.*?</tr>', index_before):
        assert row in index_after


def test_experiment_stats_text_section(text_a, text_b, run_a, tmp_path, capsys):
    stats = _json_of(capsys, experiment_result_stats.main, [str(text_a), str(text_b), "--json"])
    text = stats["text"]
    assert text["runs"] == ["text_a", "text_b"]
    assert list(text["benchmarks"]) == ["math", "py", "rag"]
    math_row = text["benchmarks"]["math"]
    assert math_row["scores"] == [pytest.approx(1 / 3), 1.0]
    assert math_row["episodes"] == [3, 3]
    assert math_row["mean"] == pytest.approx(2 / 3)
    assert math_row["std"] == pytest.approx((2 / 3) / math.sqrt(2))  # n - 1
    assert text["benchmarks"]["py"]["scores"] == [1.0, 0.5]
    assert text["benchmarks"]["rag"]["std"] == pytest.approx(0.0)
    assert list(text["modes"]) == ["math", "py", "rag"]
    assert list(text["metrics"]) == ["contains_answer", "numeric_match"]
    assert text["metrics"]["numeric_match"]["scores"] == [pytest.approx(0.5), pytest.approx(0.8)]
    assert text["all"]["mean"] == pytest.approx((0.6 + 5 / 6) / 2)
    assert text["all"]["std"] == pytest.approx((5 / 6 - 0.6) / math.sqrt(2))

    assert experiment_result_stats.main([str(text_a), str(text_b)]) == 0
    out = capsys.readouterr().out
    assert "text benchmarks: score across 2 runs" in out
    table = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
             for line in out.split("text benchmarks")[1].splitlines()
             if line.startswith("│")}  # fmt: skip
    assert table["math"] == ["33.3%", "100.0%", "66.7%", "47.1%"]
    assert table["mode py"] == ["100.0%", "50.0%", "75.0%", "35.4%"]
    assert table["metric numeric_match"] == ["50.0%", "80.0%", "65.0%", "21.2%"]
    assert table["all"] == ["60.0%", "83.3%", "71.7%", "16.5%"]

    # A desktop run next to a text run: no text score for it, none in the mean.
    stats = _json_of(capsys, experiment_result_stats.main, [str(run_a), str(text_a), "--json"])
    assert stats["text"]["benchmarks"]["math"]["scores"] == [None, pytest.approx(1 / 3)]
    assert stats["text"]["benchmarks"]["math"]["episodes"] == [0, 3]
    assert stats["text"]["all"]["mean"] == pytest.approx(0.6)
    assert stats["text"]["all"]["std"] is None


def test_experiment_stats_without_text_episodes_has_no_text_section(run_a, run_b, capsys):
    stats = _json_of(capsys, experiment_result_stats.main, [str(run_a), str(run_b), "--json"])
    assert "text" not in stats
    assert experiment_result_stats.main([str(run_a), str(run_b)]) == 0
    assert "text benchmarks" not in capsys.readouterr().out


def test_compare_text_runs_scores_and_changed_items(text_a, text_b, tmp_path, capsys):
    out = tmp_path / "changes.jsonl"
    assert compare_exp_result.main([str(text_a), str(text_b), "-o", str(out)]) == 0
    summary = capsys.readouterr().out
    changes = [json.loads(line) for line in out.read_text().splitlines()]
    # By the text score: math/m2/0's infra error counts 0, so infra_error -> success is
    # b_better; py/p1/1 was cancelled in A (no score): status_changed.
    assert [(c["change"], c["key"], c["delta"]) for c in changes] == [
        ("a_better", "py/p1/0", -1.0),
        ("b_better", "math/m1/1", 1.0),
        ("b_better", "math/m2/0", 1.0),
        ("status_changed", "py/p1/1", None),
    ]
    m2 = changes[2]
    assert (m2["status_a"], m2["reward_a"], m2["status_b"], m2["reward_b"]) == (
        "infra_error", 0.0, "success", 1.0)  # fmt: skip
    assert list(m2)[-3:] == ["metric", "answer_a", "answer_b"]
    assert (m2["metric"], m2["answer_a"], m2["answer_b"]) == ("numeric_match", None, "7")
    assert (changes[0]["answer_a"], changes[0]["answer_b"]) == ("832040", "0")
    # The summary: the scores A vs B per benchmark and the text items whose score changed.
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in summary.split("text benchmarks: score")[1].splitlines()
            if line.startswith("│")}  # fmt: skip
    assert rows["math"] == ["33.3%", "100.0%", "+66.7 pp", "3", "3"]
    assert rows["py"] == ["100.0%", "50.0%", "-50.0 pp", "1", "2"]
    assert rows["rag"] == ["100.0%", "100.0%", "+0.0 pp", "1", "1"]
    assert rows["all"] == ["60.0%", "83.3%", "+23.3 pp", "5", "6"]
    listed = summary.split("text items whose score changed: 3")[1]
    assert "  a_better: py/p1/0 1 -> 0  Question p1: what is x <y>?" in listed
    assert '      answer "832040" -> "0"' in listed
    assert '  b_better: math/m2/0 0 -> 1' in listed and '      answer (none) -> "7"' in listed
    # Listed once: not again with the desktop items.
    assert summary.count("py/p1/0") == 1

    # Per task, to CSV: the task's score is the mean over its rollouts (cancelled left out).
    out_csv = tmp_path / "tasks.csv"
    assert compare_exp_result.main([str(text_a), str(text_b), "--by", "task",
                                    "-o", str(out_csv)]) == 0  # fmt: skip
    rows = list(csv.DictReader(out_csv.read_text().splitlines()))
    assert list(rows[0])[-3:] == ["metric", "answer_a", "answer_b"]
    got = {r["key"]: (r["change"], float(r["reward_a"]), float(r["reward_b"])) for r in rows}
    assert got == {"py/p1": ("a_better", 1.0, 0.5), "math/m1": ("b_better", 0.5, 1.0),
                   "math/m2": ("b_better", 0.0, 1.0)}  # fmt: skip
    assert {r["answer_a"] for r in rows} == {""}
    assert "text items whose score changed: 3" in capsys.readouterr().out


def test_compare_without_text_episodes_is_unchanged(run_a, run_b, tmp_path, capsys):
    out_jsonl, out_csv = tmp_path / "c.jsonl", tmp_path / "c.csv"
    assert compare_exp_result.main([str(run_a), str(run_b), "-o", str(out_jsonl)]) == 0
    summary = capsys.readouterr().out
    assert "text benchmarks" not in summary and "text items" not in summary
    assert "  a_better: chrome/t1/0 1 -> 0  Do the thing of t1" in summary
    for line in out_jsonl.read_text().splitlines():
        assert tuple(json.loads(line)) == compare_exp_result.FIELDS
    assert compare_exp_result.main([str(run_a), str(run_b), "-o", str(out_csv)]) == 0
    assert out_csv.read_text().splitlines()[0] == ",".join(compare_exp_result.FIELDS)



# --------------------------------------------------------------------------- plots


def test_plots_from_metrics_results_and_trajectories(run_a, tmp_path, capsys):
    out = tmp_path / "plots"
    assert plot_run.main([str(run_a), "--out", str(out)]) == 0
    for name in plot_run.PLOTS:
        with Image.open(out / f"{name}.png") as image:
            assert image.format == "PNG" and image.size[0] >= 600
    model_s, env_s, problems = plot_run.step_latencies(load_run(run_a))
    assert len(model_s) == len(env_s) == sum(e.steps for e in RUN_A) and problems == []


def test_plots_without_metrics_skip_only_the_timeline(run_a, tmp_path, capsys):
    (run_a / "metrics.jsonl").unlink()
    assert plot_run.main([str(run_a)]) == 0
    captured = capsys.readouterr()
    assert "metrics.jsonl: missing, skipping progress and desktops plots" in captured.err
    made = sorted(p.name for p in (run_a / "plots").iterdir())
    # The utilization plot falls back to the split the timeline gives.
    assert made == ["latency.png", "success_by_domain.png", "timeline.png",
                    "timeline_runners.png", "utilization.png"]


# --------------------------------------------------------------------------- the CLIs


def _cli(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_every_script_runs_as_a_command_from_another_cwd(run_a, run_b, tmp_path):
    # Relative run paths from a directory that is not the repository.
    shown = _cli("show_result.py", "run_a", "--json", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["overall"]["success_rate"] == pytest.approx(0.5)
    stats = _cli("experiment_result_stats.py", "run_a", "run_b", "-o", "s.csv", cwd=tmp_path)
    assert stats.returncode == 0, stats.stderr
    assert (tmp_path / "s.csv").is_file() and "any-correct rate: 66.7%" in stats.stdout
    compared = _cli("compare_exp_result.py", "run_a", "run_b", cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr
    assert len((tmp_path / "compare_run_a_vs_run_b.jsonl").read_text().splitlines()) == 7
    viewed = _cli("view_trajectory.py", "run_a", cwd=tmp_path)
    assert viewed.returncode == 0, viewed.stderr
    assert (run_a / "viewer" / "index.html").is_file()
    plotted = _cli("plot_run.py", "run_a", "--out", "p", cwd=tmp_path)
    assert plotted.returncode == 0, plotted.stderr
    assert len(list((tmp_path / "p").glob("*.png"))) == len(plot_run.PLOTS) + 1  # + runners
    missing = _cli("show_result.py", "no_such_run", cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip() == "show_result.py: error: no_such_run: no such directory"
    # The same command through the package's one entry point.
    command = subprocess.run([sys.executable, "-m", "cua_rollout", "results", "show", "run_a",
                              "--json"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
    assert command.returncode == 0, command.stderr
    assert json.loads(command.stdout) == json.loads(shown.stdout)


def test_the_scripts_and_the_library_import_no_heavy_module_up_front(tmp_path):
    # Reading results needs no Ray; matplotlib and PIL only when a script draws.
    names = ", ".join(f"cua_rollout.cli.{Path(s).stem}" for s in ALL_SCRIPTS)
    heavy = ("ray", "matplotlib", "PIL")
    for imports in (f"import sys, {names}", "import sys, cua_rollout.results"):
        code = f"{imports}; print(sorted(m for m in {heavy!r} if m in sys.modules))"
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "[]", imports


def test_the_result_commands_use_the_results_library():
    for script in ALL_SCRIPTS:
        text = (REPO / "cua_rollout" / "cli" / script).read_text()
        assert "from cua_rollout.results import" in text, script
    assert not (SCRIPTS / "results_io.py").exists()


def test_public_surface_of_rollout_results():
    import importlib

    package = importlib.import_module("cua_rollout.results")
    for module_name in ("runs", "rates", "summary", "cli", "versions"):
        module = importlib.import_module(f"cua_rollout.results.{module_name}")
        for name in module.__all__:
            assert not name.startswith("_") and hasattr(module, name), (module_name, name)
            assert getattr(package, name) is getattr(module, name), name
    assert sorted(package.__all__) == sorted(
        name for m in ("runs", "rates", "summary", "cli", "versions")
        for name in importlib.import_module(f"cua_rollout.results.{m}").__all__
    )  # fmt: skip
    for script in ALL_SCRIPTS:
        module = importlib.import_module(f"cua_rollout.cli.{Path(script).stem}")
        assert "main" in module.__all__ and all(hasattr(module, n) for n in module.__all__)


def test_failures_whose_evaluation_raised_are_counted_apart(tmp_path, capsys):
    run = make_run(tmp_path, "raised", [Ep("os", "a", 0, "success", 1.0),
                                        Ep("os", "b", 0, "failure", 0.0),
                                        Ep("os", "c", 0, "failure", 0.0)], metrics=False)
    path = run / "results.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    lines[2]["evaluation_error"] = "EvaluatorRaised: metric is_in_list raised TypeError: x"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = _json_of(capsys, show_result.main, [str(run), "--json"])
    # Still a scored failure (in every rate), and counted apart.
    assert summary["overall"]["scored_episodes"] == 3
    assert summary["overall"]["evaluation_errors"] == 1
    assert summary["domains"]["os"]["evaluation_errors"] == 1
    assert show_result.main([str(run)]) == 0
    assert ("failures whose evaluation raised on what the agent left (scored 0, reason in "
            "results.jsonl's evaluation_error): 1") in capsys.readouterr().out
