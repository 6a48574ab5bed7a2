"""The trainer's index (cua_rollout/training) on SQLite files in a temporary directory, over run
directories the tests write (results.jsonl, run.json, each episode's traj.jsonl): groups made
when complete, reindex = incremental, claims exactly once across threads and processes,
leases, release, version filters, exports that reproduce the files, the CLI's exit codes."""

from __future__ import annotations

import json
import logging
import multiprocessing
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cua_rollout.training import (
    TrainingIndex,
    TrainingIndexError,
    default_url,
    export,
    export_rows,
    group_record,
    index_url,
)
from cua_rollout.training.cli import main
from tests.support import REPO_ROOT

RUN = "demo-run"


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def episode(task, rollout, status="success", reward=1.0, *, pass_index=0, size=4, version="v1",
            started=None, **extra):
    record = {
        "episode_id": f"chrome/{task}/{rollout}", "task_id": task, "domain": "chrome",
        "rollout": rollout, "attempt": 0, "status": status, "reward": reward, "steps": 2,
        "started_at": float(started if started is not None else 1000 + rollout),
        "ended_at": float(2000 + rollout), "instruction": f"do {task}", "model_version": version,
        "pass_index": pass_index, "group_id": f"chrome/{task}/pass-{pass_index}",
        "group_size": size, "first_model_version": version,
        "model_versions": [version] if version else [], "mixed_versions": False,
    }
    record.update(extra)
    return record


def steps_of(record):
    """The traj.jsonl lines written for an episode: token ids derived from its id."""
    seed = sum(map(ord, record["episode_id"]))
    out = []
    for n in (1, 2):
        step = {
            "step_num": n, "response": f"Action: click {seed} {n}", "action": "pyautogui.click()",
            "actions": [], "thought": None, "model_version": record["model_version"],
            "observation_file": f"step_{n - 1}.png", "screenshot_file": f"step_{n}.png",
            "reward": 0, "done": n == 2, "prompt_tokens": 4, "completion_tokens": 2,
            "prompt_token_ids": [seed, n, 151655, 151655], "token_ids": [seed + n, 2],
            "logprobs": [-0.5 * n, -0.25], "images": [{"file": f"step_{n - 1}.png", "tokens": 2}],
        }
        if n == 1:
            step["image_spans"] = [[2, 2]]
            step["discarded"] = [{"response": "junk", "token_ids": [7], "prompt_token_ids": [1],
                                  "logprobs": [-3.0], "model_version": "v1", "error": "parse"}]
        out.append(step)
    return out


def write_run(run_dir: Path, records, *, status="running", run=RUN, traj=True):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps({"run": run, "status": status}))
    with open(run_dir / "results.jsonl", "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
            directory = run_dir / record["episode_id"]
            if traj and record["status"] != "infra_error":
                directory.mkdir(parents=True, exist_ok=True)
                (directory / "traj.jsonl").write_text(
                    "".join(json.dumps(s) + "\n" for s in steps_of(record)))
    return run_dir


def four(task, rewards=(1.0, 0.0, 1.0, 0.0), *, first=0, **kw):
    """A group of four episodes (rollouts ``first``..``first + 3``: a later pass numbers its
    rollouts on); reward None is an infra error."""
    return [episode(task, first + i, "success" if r == 1.0 else
                    ("infra_error" if r is None else "failure"), r, **kw)
            for i, r in enumerate(rewards)]


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def index(tmp_path, clock):
    idx = TrainingIndex(default_url(tmp_path), clock=clock)
    yield idx
    idx.close()


def group_rows(url):
    path = url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:
        groups = db.execute("SELECT run, group_id, run_dir, domain, task_id, pass_index, size, "
                            "record, mean, std, no_signal, infra_failures, min_version_seq, "
                            "max_version_seq, mixed_versions, state FROM groups "
                            "ORDER BY run, group_id").fetchall()
        episodes = db.execute("SELECT * FROM episodes ORDER BY run, episode_id").fetchall()
    return groups, episodes


# ----------------------------------------------------------------- recording


def test_the_database_is_sqlite_in_wal_mode(index, tmp_path):
    assert (tmp_path / "index.db").is_file()
    with sqlite3.connect(tmp_path / "index.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("2",)


def test_a_group_is_made_when_its_last_episode_arrives(index, tmp_path):
    records = four("t0")
    for record in records[:3]:
        assert index.record_episode(RUN, tmp_path, record) is None
    assert index.status()["groups"]["total"] == 0
    group = index.record_episode(RUN, tmp_path, records[3])
    assert group == group_record("chrome/t0/pass-0", domain="chrome", task_id="t0",
                                 pass_index=0, group_size=4, episodes=records)
    assert group["mean"] == 0.5 and group["std"] == 0.5
    status = index.status()
    assert status["groups"] == {"ready": 1, "claimed": 0, "acked": 0, "failed_infra": 0,
                                "total": 1}
    assert status["episodes"] == 4 and status["newest_version"] == "v1"
    # The same line again changes nothing.
    assert index.record_episode(RUN, tmp_path, records[3]) is None
    assert index.status()["groups"]["total"] == 1


def test_a_group_with_an_infra_error_is_never_handed_out_until_a_rerun_scores_it(
        index, tmp_path):
    """Issue 34: a group is never trained partial. Its infra error (retries used up) fails it
    as a whole (state failed_infra): no claim hands it out; a rerun's scored line makes it
    ready, whole."""
    records = four("t0", (1.0, None, 0.0, 0.0)) + four("t1", (1.0, 0.0, 0.0, 1.0))
    made = index.record_episodes(RUN, tmp_path, records)
    assert {g["group_id"]: g["infra_failures"] for g in made} == {
        "chrome/t0/pass-0": 1, "chrome/t1/pass-0": 0}
    assert index.status()["groups"] == {"ready": 1, "claimed": 0, "acked": 0,
                                        "failed_infra": 1, "total": 2}
    assert [c.group_id for c in index.claim_groups(5, "a")] == ["chrome/t1/pass-0"]
    assert index.claim_groups(5, "b") == []
    assert [g.group_id for g in index.groups(state="failed_infra")] == ["chrome/t0/pass-0"]

    rebuilt = index.record_episode(RUN, tmp_path, episode("t0", 1, "success", 1.0))
    assert rebuilt is not None and rebuilt["masked"] == [] and rebuilt["mean"] == 0.5
    [claim] = index.claim_groups(5, "b")
    assert claim.group_id == "chrome/t0/pass-0"
    assert claim.group["rewards"] == [1.0, 1.0, 0.0, 0.0]


def test_a_change_to_a_claimed_group_is_logged_and_left_out(index, tmp_path, caplog):
    index.record_episodes(RUN, tmp_path, four("t0", (1.0, 0.0, 0.0, 0.0)))
    assert len(index.claim_groups(1, "a")) == 1
    with caplog.at_level(logging.WARNING, logger="cua_rollout.training.index"):
        assert index.record_episode(RUN, tmp_path, episode("t0", 1, "success", 1.0)) is None
    assert "chrome/t0/pass-0" in caplog.text and "claimed" in caplog.text
    [group] = index.groups()
    assert group.state == "claimed" and group.group["rewards"] == [1.0, 0.0, 0.0, 0.0]


def test_reindex_equals_incremental_and_is_idempotent(tmp_path):
    run_dir = tmp_path / "run"
    records = (four("t0") + four("t1", (0.0, 0.0, 0.0, 0.0)) + four("t2", (1.0, None, 1.0, 0.0))
               + four("t3")[:2]                                         # incomplete
               + [episode("t2", 1, "success", 1.0)]                     # supersedes the infra one
               + four("t0", first=4, pass_index=1, version="v2"))
    write_run(run_dir, records)
    incremental = TrainingIndex(f"sqlite:///{tmp_path / 'inc.db'}", clock=Clock())
    for record in records:
        incremental.record_episode(RUN, run_dir, record)
    rebuilt = TrainingIndex(f"sqlite:///{tmp_path / 're.db'}", clock=Clock())
    counts = rebuilt.reindex(run_dir)
    assert counts["run"] == RUN and counts["episodes"] == 18 and counts["lines"] == 19
    assert counts["groups"] == 4 and counts["incomplete_groups"] == 1
    assert group_rows(str(incremental.url)) == group_rows(str(rebuilt.url))
    again = rebuilt.reindex(run_dir)
    assert (again["inserted"], again["replaced"], again["groups_created"]) == (0, 0, 0)
    assert again["unchanged"] == 18
    assert group_rows(str(rebuilt.url)) == group_rows(str(incremental.url))
    incremental.close()
    rebuilt.close()


def test_reindex_streams_in_batches_and_a_rerun_line_wins_across_them(tmp_path, monkeypatch):
    """Transactions of two groups at most: an infra error in the first batch, its rerun in
    the last one, is never written (the later line wins, as it does read whole); a straggler
    cut (cancelled) likewise; a group split over batches is made once complete; versions are
    numbered in the order the run first used them, whatever the file's order."""
    import cua_rollout.training.index as index_module

    monkeypatch.setattr(index_module, "_REINDEX_GROUPS", 2)
    run_dir = tmp_path / "run"
    t3 = four("t3", version="v2", started=50)
    records = [*four("t0", (1.0, None, 0.0, 0.0)),
               episode("t1", 0, "cancelled", None, version="v2", started=5000),
               *four("t2", version="v3"), *t3[:3],
               episode("t0", 1, "success", 1.0), episode("t1", 0, "success", 1.0),
               *four("t1")[1:], t3[3]]
    write_run(run_dir, records)
    incremental = TrainingIndex(f"sqlite:///{tmp_path / 'inc.db'}", clock=Clock())
    incremental.record_episodes(RUN, run_dir, [r for r in records if r["status"] != "cancelled"
                                               and r["episode_id"] != "chrome/t0/1"]
                                + [episode("t0", 1, "success", 1.0)])
    rebuilt = TrainingIndex(f"sqlite:///{tmp_path / 're.db'}", clock=Clock())
    counts = rebuilt.reindex(run_dir)
    assert (counts["episodes"], counts["inserted"], counts["replaced"]) == (16, 16, 0)
    assert (counts["groups"], counts["groups_created"], counts["groups_rebuilt"]) == (4, 4, 0)
    assert counts["incomplete_groups"] == 0
    assert group_rows(str(incremental.url)) == group_rows(str(rebuilt.url))
    with sqlite3.connect(tmp_path / "re.db") as db:  # t3 (v2) started first
        assert [v for v, in db.execute("SELECT version FROM versions ORDER BY seq")] == [
            "v2", "v1", "v3"]
    incremental.close()
    rebuilt.close()


def test_records_without_group_size_make_groups_once_the_run_finished(index, tmp_path, caplog):
    old = [{k: v for k, v in r.items()
            if k not in ("group_size", "group_id", "pass_index", "first_model_version",
                         "model_versions", "mixed_versions")}
           for r in four("t0")[:3] + four("t1")]
    run_dir = write_run(tmp_path / "old", old)
    with (run_dir / "results.jsonl").open("a") as f:
        f.write('{"episode_id": "cut sho\n[1, 2]\n'
                '{"episode_id": "chrome/t9/0", "status": "success", "rollout": "zero"}\n')
    with caplog.at_level(logging.WARNING, logger="cua_rollout.training.index"):
        counts = index.reindex(run_dir, run="old")
    assert counts["skipped"] == 3 and counts["groups"] == 0 and counts["episodes"] == 7
    assert "results.jsonl:8: not JSON" in caplog.text
    assert "results.jsonl:9: not an episode record" in caplog.text
    assert "results.jsonl:10: run old, episode chrome/t9/0: rollout:" in caplog.text
    write_run(run_dir, [], status="finished")
    counts = index.reindex(run_dir, run="old")
    assert counts["groups_created"] == 2
    sizes = sorted(g.group["size"] for g in index.groups())
    assert sizes == [3, 4]


def test_a_record_that_does_not_fit_is_refused_by_name(index, tmp_path):
    with pytest.raises(ValueError, match="episode chrome/t0/0: group_size: 'eight'"):
        index.record_episode(RUN, tmp_path, episode("t0", 0, size="eight"))
    with pytest.raises(ValueError, match="episode chrome/t0/0: reward"):
        index.record_episode(RUN, tmp_path, episode("t0", 0, reward="high"))
    with pytest.raises(ValueError, match="without an episode_id"):
        index.record_episode(RUN, tmp_path, {"status": "success"})
    assert index.status()["episodes"] == 0


def test_reindex_of_a_missing_directory(index, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        index.reindex(tmp_path / "nowhere")


def test_another_schema_version_is_refused(tmp_path):
    TrainingIndex(default_url(tmp_path)).close()
    with sqlite3.connect(tmp_path / "index.db") as db:
        db.execute("UPDATE meta SET value = '7' WHERE key = 'schema_version'")
    with pytest.raises(TrainingIndexError, match="schema version 7"):
        TrainingIndex(default_url(tmp_path))


# ----------------------------------------------------------------- claims


def _fill(index, run_dir, groups=30):
    records = [r for t in range(groups) for r in four(f"t{t:02d}")]
    index.record_episodes(RUN, run_dir, records)
    return {f"chrome/t{t:02d}/pass-0" for t in range(groups)}


def test_four_threads_claim_each_group_once(tmp_path):
    index = TrainingIndex(default_url(tmp_path))
    expected = _fill(index, tmp_path, 40)
    got: dict[str, list[str]] = {}
    barrier = threading.Barrier(4)

    def consumer(name):
        barrier.wait()
        mine = got.setdefault(name, [])
        while claims := index.claim_groups(3, name):
            mine += [c.group_id for c in claims]
            assert index.ack(claims) == []

    threads = [threading.Thread(target=consumer, args=(f"c{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    claimed = [g for mine in got.values() for g in mine]
    assert sorted(claimed) == sorted(expected)  # disjoint and complete
    assert index.status()["groups"] == {"ready": 0, "claimed": 0, "acked": 40,
                                             "failed_infra": 0, "total": 40}
    index.close()


def process_consumer(url, name, out, start):
    """A consumer in a process of its own: claims two at a time until nothing is left."""
    index = TrainingIndex(url)
    start.wait()
    with open(out, "w") as f:
        while claims := index.claim_groups(2, name, lease_s=300):
            for claim in claims:
                f.write(claim.group_id + "\n")
            f.flush()
    index.close()


def test_two_processes_claim_each_group_once(tmp_path):
    index = TrainingIndex(default_url(tmp_path))
    expected = _fill(index, tmp_path, 60)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=process_consumer,
                         args=(str(index.url), f"p{i}", tmp_path / f"p{i}.txt", start))
             for i in range(2)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    seen = [(tmp_path / f"p{i}.txt").read_text().split() for i in range(2)]
    assert sorted(seen[0] + seen[1]) == sorted(expected)
    assert not set(seen[0]) & set(seen[1])
    assert set(index.status()["consumers"]) <= {"p0", "p1"}
    index.close()


def test_an_expired_lease_goes_to_another_consumer(tmp_path):
    clock = Clock()
    index = TrainingIndex(default_url(tmp_path), clock=clock)
    _fill(index, tmp_path, 1)
    [first] = index.claim_groups(5, "a", lease_s=10)
    assert first.lease_expires == clock.now + 10
    clock.now += 5
    assert index.claim_groups(5, "b", lease_s=10) == []   # still held
    clock.now += 6
    [second] = index.claim_groups(5, "b", lease_s=10)
    assert second.group_id == first.group_id and second.claim_id != first.claim_id
    assert index.extend([first], 10) == [(RUN, first.group_id)]
    assert index.ack([first]) == [(RUN, first.group_id)]  # lost to b
    assert index.release([first]) == 0
    assert index.ack([second.ref()]) == []
    assert index.ack([second]) == []                       # twice is harmless
    assert index.status()["groups"]["acked"] == 1


def test_claims_follow_the_created_order_of_ready_and_expired_groups(index, clock, tmp_path):
    for task in ("g0", "g1", "g2"):
        clock.now += 1
        index.record_episodes(RUN, tmp_path, four(task))
    first = index.claim_groups(2, "a", lease_s=10)
    assert [c.group["task_id"] for c in first] == ["g0", "g1"]
    assert index.release(first[:1]) == 1                   # g0 ready again, g1 held
    clock.now += 20                                        # g1's lease is over
    later = index.claim_groups(3, "b")
    assert [c.group["task_id"] for c in later] == ["g0", "g1", "g2"]


def test_a_late_ack_stands_when_nobody_took_the_group(index, clock, tmp_path):
    _fill(index, tmp_path, 1)
    [claim] = index.claim_groups(1, "a", lease_s=1)
    clock.now += 100
    assert index.status()["expired_leases"] == 1
    assert index.ack([claim]) == []


def test_release_and_extend(index, clock, tmp_path):
    expected = _fill(index, tmp_path, 3)
    claims = index.claim_groups(2, "a", lease_s=10)
    assert index.status()["consumers"] == {"a": 2}
    assert index.extend(claims, 100) == []
    clock.now += 50                                        # past the first lease, within the new
    assert [c.group_id for c in index.claim_groups(5, "b")] == sorted(
        expected - {c.group_id for c in claims})
    assert index.release(claims) == 2
    assert index.release(claims) == 0
    again = index.claim_groups(5, "c")
    assert sorted(c.group_id for c in again) == sorted(c.group_id for c in claims)
    assert index.status()["consumers"] == {"b": 1, "c": 2}


def test_min_version_and_max_staleness(index, tmp_path):
    index.record_episodes(RUN, tmp_path, four("a", version="v1") + four("b", version="v2")
                          + four("c", version="v3"))
    mixed = four("m", version="v3")
    mixed[0] |= {"first_model_version": "v2", "model_versions": ["v2", "v3"],
                 "mixed_versions": True}
    index.record_episodes(RUN, tmp_path, mixed)

    def claimable(**kw):
        claims = index.claim_groups(10, "probe", **kw)
        index.release(claims)
        return sorted(c.group["task_id"] for c in claims)

    assert claimable() == ["a", "b", "c", "m"]
    assert claimable(min_version="v2") == ["b", "c", "m"]
    assert claimable(min_version="v3") == ["c"]
    assert claimable(max_staleness=0) == ["c"]
    assert claimable(max_staleness=1) == ["b", "c", "m"]
    assert claimable(max_staleness=1, min_version="v3") == ["c"]
    with pytest.raises(ValueError, match=r"'v9'.*v3, v2, v1"):
        index.claim_groups(1, "x", min_version="v9")


def test_groups_without_signal_can_be_skipped(index, tmp_path):
    index.record_episodes(RUN, tmp_path, four("flat", (0.0, 0.0, 0.0, 0.0)) + four("good"))
    assert [c.group["task_id"] for c in index.claim_groups(5, "a", include_no_signal=False)] \
        == ["good"]
    assert [c.group["task_id"] for c in index.claim_groups(5, "a")] == ["flat"]


def test_claims_carry_the_episodes_and_their_steps(index, tmp_path):
    run_dir = write_run(tmp_path / "run", four("t0", (1.0, 0.0, 0.0, 1.0)))
    index.reindex(run_dir)
    [claim] = index.claim_groups(1, "a", load_steps=True)
    assert [e["episode_id"] for e in claim.episodes] == [f"chrome/t0/{i}" for i in range(4)]
    first = claim.episodes[0]
    assert first["dir"] == str(run_dir.resolve() / "chrome/t0/0")
    assert first["steps"] == steps_of(first)


def test_a_missing_trajectory_is_named_and_the_claim_given_back(index, tmp_path):
    run_dir = write_run(tmp_path / "run", four("t0"))
    (run_dir / "chrome/t0/2/traj.jsonl").unlink()
    index.reindex(run_dir)
    with pytest.raises(TrainingIndexError, match=r"chrome/t0/2/traj\.jsonl: missing"):
        index.claim_groups(1, "a", load_steps=True)
    assert index.status()["groups"]["ready"] == 1
    (run_dir / "chrome/t0/2/traj.jsonl").write_text('{"step_num": 1}\n{"step_n\n')
    with pytest.raises(TrainingIndexError, match=r"traj\.jsonl:2: not JSON"):
        index.claim_groups(1, "a", load_steps=True)


# ----------------------------------------------------------------- exports


def test_exports_reproduce_the_files(index, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    failed = four("t2", (1.0, None, 0.0, 0.0))  # failed_infra: never trained, not exported
    records = four("t0", (1.0, 0.0, 0.0, 0.0)) + four("t1", (0.0, 1.0, 1.0, 1.0), version="v2")
    run_dir = write_run(tmp_path / "run", records + failed)
    index.reindex(run_dir)
    by_id = {r["episode_id"]: r for r in records + failed}
    groups = {g.group_id: g.group for g in index.groups()}

    rows = list(export_rows(index, per="episode"))
    assert [r["episode_id"] for r in rows] == [r["episode_id"] for r in records]
    asked = list(export_rows(index, per="episode", state="failed_infra"))
    assert [r["episode_id"] for r in asked] == [r["episode_id"] for r in failed]
    assert asked[1]["advantage"] is None and asked[0]["advantage"] > 0
    for row in rows:
        group = groups[row["group_id"]]
        assert row["reward"] == (None if row["status"] == "infra_error"
                                 else by_id[row["episode_id"]]["reward"])
        assert row["advantage"] == group["advantages"][row["episode_id"]]
        assert (row["group_mean"], row["group_std"]) == (group["mean"], group["std"])
    assert rows[0]["advantage"] > 0 > rows[1]["advantage"]

    step_rows = list(export_rows(index, per="step"))
    assert len(step_rows) == 8 * 2
    for row in step_rows:
        expected = steps_of(by_id[row["episode_id"]])[row["step_num"] - 1]
        for key in ("prompt_token_ids", "token_ids", "logprobs", "images", "response"):
            assert row[key] == expected[key]
        assert row["image_spans"] == expected.get("image_spans")
        assert row["discarded"] == expected.get("discarded", [])
        assert row["observation_path"] == str(Path(row["dir"]) / f"step_{row['step_num'] - 1}.png")
        assert row["advantage"] == groups[row["group_id"]]["advantages"][row["episode_id"]]

    out = tmp_path / "out"
    out.mkdir()
    assert export(out / "steps.jsonl", index, per="step") == 16
    lines = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert lines == step_rows
    assert export(out / "steps.parquet", index, per="step") == 16
    table = pq.read_table(out / "steps.parquet")
    assert table.schema.field("token_ids").type.value_type == pa.int64()
    assert table.schema.field("prompt_token_ids").type.value_type == pa.int64()
    assert table.schema.field("logprobs").type.value_type == pa.float64()
    assert table.schema.field("images").type == pa.string()
    back = table.to_pylist()
    for got, want in zip(back, step_rows, strict=True):
        assert got["token_ids"] == want["token_ids"]
        assert got["prompt_token_ids"] == want["prompt_token_ids"]
        assert got["logprobs"] == want["logprobs"]
        assert got["advantage"] == want["advantage"] and got["reward"] == want["reward"]
        assert json.loads(got["images"]) == want["images"]
        assert json.loads(got["discarded"]) == want["discarded"]
    assert export(out / "episodes.parquet", index, per="episode", state="acked") == 0
    assert pq.read_table(out / "episodes.parquet").num_rows == 0
    assert sorted(p.name for p in out.iterdir()) == ["episodes.parquet", "steps.jsonl",
                                                     "steps.parquet"]  # no temporary left


def test_export_of_claimed_groups(index, tmp_path):
    run_dir = write_run(tmp_path / "run", four("t0"))
    index.reindex(run_dir)
    claims = index.claim_groups(1, "a", load_steps=True)
    rows = list(export_rows(claims, per="step"))
    assert [r["token_ids"] for r in rows] == [
        s["token_ids"] for r in four("t0") for s in steps_of(r)]
    assert {r["steps"] for r in export_rows(claims, per="episode")} == {2}


# ----------------------------------------------------------------- CLI


def cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_round_trip(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", four("t0") + four("t1") + four("t2"))
    code, out, _ = cli(capsys, "reindex", run_dir)
    assert code == 0 and json.loads(out)["groups_created"] == 3
    code, out, _ = cli(capsys, "--run-dir", run_dir, "claim", "-n", "2", "--consumer", "me")
    assert code == 0
    claims = [json.loads(x) for x in out.splitlines()]
    assert [c["group_id"] for c in claims] == ["chrome/t0/pass-0", "chrome/t1/pass-0"]
    (tmp_path / "claims.jsonl").write_text(out)
    code, out, _ = cli(capsys, "--run-dir", run_dir, "ack", "--claims", tmp_path / "claims.jsonl")
    assert code == 0 and json.loads(out) == {"acked": 2, "lost": []}
    code, out, _ = cli(capsys, "--run-dir", run_dir, "claim", "-n", "5", "--consumer", "me",
                       "--json")
    [full] = [json.loads(x) for x in out.splitlines()]
    assert full["group"]["task_id"] == "t2" and len(full["episodes"]) == 4
    (tmp_path / "full.jsonl").write_text(out)
    code, out, _ = cli(capsys, "--run-dir", run_dir, "release", "--claims",
                       tmp_path / "full.jsonl")
    assert code == 0 and json.loads(out) == {"released": 1}
    code, out, _ = cli(capsys, "--run-dir", run_dir, "export", tmp_path / "acked.jsonl",
                       "--per", "step", "--state", "acked")
    assert code == 0 and json.loads(out)["rows"] == 16
    code, out, _ = cli(capsys, "--run-dir", run_dir, "status")
    status = json.loads(out)
    assert status["groups"] == {"ready": 1, "claimed": 0, "acked": 2,
                                "failed_infra": 0, "total": 3}


def test_cli_ack_of_a_lost_claim_fails(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", four("t0"))
    cli(capsys, "reindex", run_dir)
    code, out, _ = cli(capsys, "--run-dir", run_dir, "claim", "-n", "1", "--consumer", "a",
                       "--lease-s", "0.001")
    (tmp_path / "a.jsonl").write_text(out)
    with TrainingIndex(default_url(run_dir), clock=Clock(4e9)) as later:
        assert len(later.claim_groups(1, "b")) == 1
    code, out, err = cli(capsys, "--run-dir", run_dir, "ack", "--claims", tmp_path / "a.jsonl")
    assert code == 1 and json.loads(out)["lost"] == [[RUN, "chrome/t0/pass-0"]]
    assert len(err.splitlines()) == 1 and "could not be acked" in err


@pytest.mark.parametrize("argv, code, message", [
    (["--db", "nonsense", "status"], 2, "bad database URL"),
    (["--db", "nodialect://x/y", "status"], 2, "bad database URL"),
    (["--db", "postgresql+psycopg://u:s3cret@127.0.0.1:1/db", "status"], 1,
     "cannot open postgresql+psycopg://u:***@127.0.0.1:1/db"),
    (["--db", "sqlite:////nonexistent/dir/index.db", "status"], 1, "cannot open"),
    (["--run-dir", "{tmp}/missing", "status"], 2, "missing: no such run directory"),
    (["reindex", "{tmp}/missing"], 2, "missing: no such run directory"),
    (["status"], 2, "no database"),
    (["--run-dir", "{tmp}", "ack", "--claims", "{tmp}/nope.jsonl"], 2, "nope.jsonl: cannot read"),
    (["--run-dir", "{tmp}", "ack", "--claims", "{tmp}/bad.jsonl"], 2,
     "bad.jsonl:2: not a claim"),
    (["--run-dir", "{tmp}", "release", "--claims", "{tmp}/broken.jsonl"], 2,
     "broken.jsonl:1: not JSON"),
    (["--run-dir", "{tmp}", "claim", "-n", "0", "--consumer", "x"], 2, "-n must be"),
    (["--run-dir", "{tmp}", "claim", "-n", "1", "--consumer", "x", "--min-version", "v9"], 2,
     "unknown model version 'v9'"),
    (["--run-dir", "{tmp}", "--password-env", "CUA_NO_SUCH_VARIABLE", "status"], 2,
     "environment variable CUA_NO_SUCH_VARIABLE"),
    (["--run-dir", "{tmp}", "claim", "-n", "1"], 2, "--consumer"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, argv, code, message):
    (tmp_path / "bad.jsonl").write_text('{"run": "r", "group_id": "g", "claim_id": "c"}\n'
                                        '{"run": "r"}\n')
    (tmp_path / "broken.jsonl").write_text("{\n")
    got, _, err = cli(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert got == code, err
    assert len(err.strip().splitlines()) == 1, err
    assert message in err
    assert "s3cret" not in err


def test_index_url_takes_the_password_from_the_environment(monkeypatch):
    monkeypatch.setenv("CUA_TEST_DB_PASSWORD", "s3cret")
    url = index_url("postgresql+psycopg://trainer@db.example:5432/runs", "CUA_TEST_DB_PASSWORD")
    assert url.password == "s3cret"
    assert "s3cret" not in str(url) and "s3cret" not in repr(url)
    assert index_url("sqlite:////tmp/x.db").database == "/tmp/x.db"
    monkeypatch.delenv("CUA_TEST_DB_PASSWORD")
    with pytest.raises(ValueError, match="CUA_TEST_DB_PASSWORD"):
        index_url("postgresql+psycopg://trainer@db.example/runs", "CUA_TEST_DB_PASSWORD")
    with pytest.raises(ValueError, match="bad database URL"):
        index_url("not a url")


def test_cli_password_comes_from_the_environment(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "CUA_TEST_DB_PASSWORD": "s3cret"}
    done = subprocess.run(
        [sys.executable, "-m", "cua_rollout.training", "--db",
         "postgresql+psycopg://trainer@127.0.0.1:1/db", "--password-env", "CUA_TEST_DB_PASSWORD",
         "status"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("python -m cua_rollout.training: error: cannot open "
                                  "postgresql+psycopg://trainer:***@127.0.0.1:1/db")
    assert "s3cret" not in done.stderr and len(done.stderr.splitlines()) == 1
