"""The trainer's index on a REAL PostgreSQL server (Debian's binaries, started by the module's
fixture in a temporary directory on a free loopback port): writer processes recording
episodes of many groups while consumer processes claim them, a consumer killed with its
claims held, the psycopg URL form."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from cua_rollout.training import TrainingIndex
from tests.support import unavailable

pytestmark = pytest.mark.integration

GROUP_SIZE = 4
LEASE_S = 2.0


def _server_bin() -> Path:
    """The newest /usr/lib/postgresql/<major>/bin with initdb and pg_ctl."""
    found = [p.parent for p in Path("/usr/lib/postgresql").glob("*/bin/initdb")
             if (p.parent / "pg_ctl").exists() and p.parent.parent.name.isdigit()]
    if not found:
        unavailable("PostgreSQL's server binaries are not installed "
                    "(apt-get install postgresql)")
    return max(found, key=lambda p: int(p.parent.name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A PostgreSQL server of our own; yields the URL of its ``postgres`` database. The
    server refuses to run as root: then initdb and pg_ctl run as the ``postgres`` user."""
    bindir = _server_bin()
    prefix: list[str] = []
    owner = None
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            unavailable("running as root and there is no postgres user to run the server as")
        prefix = ["runuser", "-u", "postgres", "--"]
    root = Path(tempfile.mkdtemp(prefix="cua-pg-"))
    data, sockets, logfile = root / "data", root / "sock", root / "server.log"
    sockets.mkdir()
    if owner is not None:
        for path in (root, sockets):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    started = False
    try:
        subprocess.run([*prefix, str(bindir / "initdb"), "-D", str(data), "--auth=trust",
                        "-U", "postgres", "-E", "UTF8", "--no-sync"],
                       check=True, capture_output=True, text=True, timeout=120)
        for _ in range(3):  # a port taken between the probe and the bind: another one
            port = _free_port()
            options = (f"-k {sockets} -p {port} -c listen_addresses=127.0.0.1 -c fsync=off "
                       "-c synchronous_commit=off -c full_page_writes=off")
            done = subprocess.run([*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-l",
                                   str(logfile), "-w", "-t", "60", "-o", options, "start"],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                started = True
                break
        assert started, f"pg_ctl start failed: {done.stderr}\n{logfile.read_text()[-2000:]}"
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        if started:
            subprocess.run([*prefix, str(bindir / "pg_ctl"), "-D", str(data), "stop", "-m",
                            "fast"], capture_output=True, timeout=120, check=False)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def db_url(postgres) -> Iterator[str]:
    """A fresh database on the module's server, dropped afterwards."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:10]}"
    plain = postgres.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield postgres.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(plain, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def record(run: str, group: int, rollout: int) -> dict:
    task = f"task{group:03d}"
    version = f"v{group // 10}"
    return {
        "episode_id": f"os/{task}/{rollout}", "task_id": task, "domain": "os",
        "rollout": rollout, "attempt": 0, "status": "success" if (group + rollout) % 2 else
        "failure", "reward": float((group + rollout) % 2), "steps": 3,
        "started_at": 1000.0 + group, "ended_at": 2000.0 + group, "instruction": task,
        "model_version": version, "pass_index": 0, "group_id": f"os/{task}/pass-0",
        "group_size": GROUP_SIZE, "first_model_version": version, "model_versions": [version],
        "mixed_versions": False,
    }


# ----------------------------------------------------------------- the processes


def writer(url: str, run: str, groups: int, out: str, start) -> None:
    """One thread per rollout number, each walking the groups in the same order and meeting
    the others at each group: the episodes of a group arrive at once, on different
    connections (the race on the group's completion)."""
    index = TrainingIndex(url)
    created: list[str] = []
    lock = threading.Lock()
    together = threading.Barrier(GROUP_SIZE)

    def work(rollout: int) -> None:
        for group in range(groups):
            together.wait(60)
            made = index.record_episode(run, f"/runs/{run}", record(run, group, rollout))
            if made is not None:
                with lock:
                    created.append(made["group_id"])

    start.wait()
    threads = [threading.Thread(target=work, args=(r,)) for r in range(GROUP_SIZE)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    Path(out).write_text(json.dumps(created))
    index.close()


def consumer(url: str, name: str, out: str, start, writers_done) -> None:
    """Claims three at a time and acks, until the writers are done and nothing is left."""
    index = TrainingIndex(url)
    start.wait()
    with open(out, "w") as f:
        while True:
            finished = writers_done.is_set()
            claims = index.claim_groups(3, name, lease_s=60)
            for claim in claims:
                f.write(json.dumps([claim.run, claim.group_id, len(claim.episodes)]) + "\n")
            f.flush()
            if claims:
                lost = index.ack(claims)
                if lost:
                    raise SystemExit(f"lost {lost}")
            elif finished:
                break
            else:
                time.sleep(0.01)
    index.close()


def claim_and_hang(url: str, out: str, lease_s: float) -> None:
    """Claims three groups, says which, and hangs (to be killed) without acking."""
    index = TrainingIndex(url)
    claims = index.claim_groups(3, "doomed", lease_s=lease_s)
    with open(out, "w") as f:
        for claim in claims:
            f.write(json.dumps({"run": claim.run, "group_id": claim.group_id,
                                "claim_id": claim.claim_id,
                                "lease_expires": claim.lease_expires}) + "\n")
    time.sleep(600)


# ----------------------------------------------------------------- tests


def test_the_psycopg_url_form(db_url):
    assert db_url.startswith("postgresql+psycopg://postgres@127.0.0.1:")
    with TrainingIndex(db_url) as index:
        assert index.url.get_backend_name() == "postgresql"
        assert index.url.get_driver_name() == "psycopg"
        status = index.status()
        assert status["groups"]["total"] == 0 and status["url"] == db_url
    with TrainingIndex(db_url) as again:  # the schema is there: opened, not recreated
        assert again.status()["episodes"] == 0


def test_writers_and_consumers_at_once(db_url, tmp_path):
    runs, groups = ["run-a", "run-b"], 40
    TrainingIndex(db_url).close()  # the schema, before the race below
    ctx = multiprocessing.get_context("spawn")
    start, writers_done = ctx.Event(), ctx.Event()
    writers = [ctx.Process(target=writer, args=(db_url, run, groups, str(tmp_path / f"{run}.w"),
                                                start)) for run in runs]
    consumers = [ctx.Process(target=consumer, args=(db_url, f"c{i}", str(tmp_path / f"c{i}.c"),
                                                    start, writers_done)) for i in range(2)]
    for p in writers + consumers:
        p.start()
    try:
        start.set()
        for p in writers:
            p.join(120)
            assert p.exitcode == 0
        writers_done.set()
        for p in consumers:
            p.join(120)
            assert p.exitcode == 0
    finally:
        for p in writers + consumers:
            if p.is_alive():
                p.kill()
    every = {(run, f"os/task{g:03d}/pass-0") for run in runs for g in range(groups)}
    created = [(run, g) for run in runs
               for g in json.loads((tmp_path / f"{run}.w").read_text())]
    assert sorted(created) == sorted(every)  # each group made once, none missing
    seen = {i: [json.loads(x) for x in (tmp_path / f"c{i}.c").read_text().splitlines()]
            for i in range(2)}
    claimed = [(run, group) for i in seen for run, group, _ in seen[i]]
    assert Counter(claimed).most_common(1)[0][1] == 1  # no group seen twice
    assert set(claimed) == every
    assert {n for i in seen for _, _, n in seen[i]} == {GROUP_SIZE}
    with TrainingIndex(db_url) as index:
        status = index.status()
        assert status["groups"] == {"ready": 0, "claimed": 0, "acked": len(every),
                                    "failed_infra": 0, "total": len(every)}
        assert status["episodes"] == len(every) * GROUP_SIZE
        assert status["versions"] == 4 and status["newest_version"] == "v3"


def test_a_killed_consumers_groups_return_after_its_lease(db_url, tmp_path):
    with TrainingIndex(db_url) as index:
        for group in range(6):
            for rollout in range(GROUP_SIZE):
                index.record_episode("run", "/runs/run", record("run", group, rollout))
    out = tmp_path / "doomed.jsonl"
    ctx = multiprocessing.get_context("spawn")
    doomed = ctx.Process(target=claim_and_hang, args=(db_url, str(out), LEASE_S))
    doomed.start()
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and len(out.read_text().splitlines()) == 3):
            assert doomed.is_alive() and time.monotonic() < deadline, "no claims written"
            time.sleep(0.05)
    finally:
        doomed.kill()
        doomed.join(30)
    held = [json.loads(x) for x in out.read_text().splitlines()]
    held_ids = {h["group_id"] for h in held}
    expires = min(h["lease_expires"] for h in held)

    # Within the lease (the clock pinned inside it, whatever this machine's speed): the
    # killed consumer's groups are not to be had; the others are.
    with TrainingIndex(db_url, clock=lambda: expires - LEASE_S / 2) as early:
        others = early.claim_groups(10, "survivor", lease_s=60)
        assert len(others) == 3 and not {c.group_id for c in others} & held_ids
        assert early.ack(others) == []
    # After it, on the real clock: they come back, to this consumer only.
    with TrainingIndex(db_url) as index:
        deadline = time.monotonic() + 30
        while not (again := index.claim_groups(10, "survivor", lease_s=60)):
            assert time.monotonic() < deadline, "the lease never ran out"
            time.sleep(0.1)
        assert time.time() > expires
        assert {c.group_id for c in again} == held_ids
        assert index.claim_groups(10, "third") == []
        assert index.ack([(h["run"], h["group_id"], h["claim_id"]) for h in held]) == [
            ("run", h["group_id"]) for h in held]
        assert index.ack(again) == []
        status = index.status()
        assert status["groups"] == {"ready": 0, "claimed": 0, "acked": 6,
                                    "failed_infra": 0, "total": 6}


def test_schema_opened_by_many_processes_at_once(db_url):
    """Opening a fresh database from several processes at once creates the schema once."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_open_only, args=(db_url,)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    with TrainingIndex(db_url) as index:
        assert index.status()["groups"]["total"] == 0


def _open_only(url: str) -> None:
    with contextlib.closing(TrainingIndex(url)):
        pass


def test_a_schema_1_database_is_upgraded_and_removed_groups_are_not_claimed(db_url, tmp_path):
    """storage.retention's columns added in place to a version-1 database on PostgreSQL; a
    group marked images-removed is never claimed; acked groups come out for the sweeper
    oldest ack first, until swept."""
    from sqlalchemy import create_engine, text

    with TrainingIndex(db_url) as index:
        index.record_episodes("r", tmp_path, [record("r", g, k) for g in range(3)
                                              for k in range(GROUP_SIZE)])
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("DROP INDEX ix_groups_retention"))
        for column in ("images_removed_at", "images_removed_by", "retention_swept_at"):
            conn.execute(text(f"ALTER TABLE groups DROP COLUMN {column}"))
        conn.execute(text("UPDATE meta SET value = '1' WHERE key = 'schema_version'"))
    engine.dispose()
    with TrainingIndex(db_url) as index:
        assert index.status("r")["groups"]["ready"] == 3
        assert index.mark_images_removed("r", ["os/task000/pass-0"], "manual") == 1
        claims = index.claim_groups(5, "t", lease_s=60)
        assert sorted(c.group_id for c in claims) == ["os/task001/pass-0", "os/task002/pass-0"]
        assert index.ack(claims) == []
        released = index.released_groups("r", 10)
        assert {g.group_id for g in released} == {"os/task001/pass-0", "os/task002/pass-0"}
        index.mark_swept("r", [released[0].group_id])
        assert [g.group_id for g in index.released_groups("r", 10)] == [released[1].group_id]
