"""The trainer's index of a run (or of many runs): episodes and groups in a database through
SQLAlchemy 2 Core, SQLite in WAL mode by default (``<run_dir>/index.db``), PostgreSQL (or
MySQL) by URL when consumers sit on several machines.

The run directory stays the source of truth: ``reindex`` rebuilds a run's rows from its
results.jsonl at any time, and ``record_episode`` keeps them current as episodes end. A group
(every rollout of one task in one pass) gets its row, state ``ready``, once it holds
``group_size`` episodes; consumers then ``claim_groups`` (each group to one consumer at a
time: ``SELECT ... FOR UPDATE SKIP LOCKED`` on PostgreSQL, one ``BEGIN IMMEDIATE`` writer at a
time on SQLite), ``ack`` what they trained on, ``release`` what they give back; a lease that
runs out lets another consumer claim the group, and the first one's ack then fails.

Concurrency. Writes of one group are serialised (SQLite: ``BEGIN IMMEDIATE``; PostgreSQL: a
transaction-scoped advisory lock per group; MySQL: ``GET_LOCK``, untested here), so two writers
that finish the last two episodes of a group at once still create it exactly once. Leases are
compared with the clocks of the processes that claim (``time.time()``): keep them in sync
(NTP) to well within a lease.

Versions. Every model version string any record mentions gets a ``seq`` in the order this
database first saw it (``versions``); staleness (``max_staleness``, ``min_version``) compares
seqs, never the strings. A group's ``min_version_seq`` is its oldest version's; a group with no
known version never passes a version filter.

One file on purpose: the tables and the claim / ack / release / extend protocol that keeps a
group with one consumer share every invariant; split, they would be checked apart.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Boolean,
    Column,
    Double,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    and_,
    bindparam,
    create_engine,
    event,
    func,
    insert,
    inspect,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects.mysql import LONGTEXT
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, SQLAlchemyError

from cua_rollout.core.files import (
    LineMark,
    iter_jsonl_lines,
    iter_lines_from,
    last_line_mark,
    read_json,
)
from cua_rollout.core.http import redact_url
from cua_rollout.core.layout import INDEX_FILE, RESULTS_FILE, RUN_FILE, TRAJ_FILE
from cua_rollout.core.retention import RetentionMarker, read_marker
from cua_rollout.training.groups import fill_defaults, group_record, is_scored

__all__ = [
    "SCHEMA_VERSION",
    "STATES",
    "ClaimRef",
    "ClaimedGroup",
    "IndexedGroup",
    "TrainingIndex",
    "TrainingIndexError",
    "default_url",
    "index_url",
    "read_steps",
    "redacted",
]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
# failed_infra: an episode of the group ended infra_error (its retries used up): the group is
# never handed out (a smaller group would skew its advantages); a later line of that episode
# (a rerun on resume) that is scored makes it ready.
STATES = ("ready", "claimed", "acked", "failed_infra")
# Episode ids per IN (...) list: below every backend's bound-parameter limit.
_CHUNK = 500
# Groups per transaction when reindexing: each holds a lock (PostgreSQL's lock table is finite).
_REINDEX_GROUPS = 500
# The execution option that makes a SQLite transaction BEGIN DEFERRED (reads) instead of
# BEGIN IMMEDIATE (writes).
_SQLITE_BEGIN = "training_sqlite_begin"
_SCHEMA_LOCK_KEY = 0x637561_7472616E  # "cua" "tran": the advisory lock of create_all


class TrainingIndexError(Exception):
    """The index cannot do what was asked: a database it cannot open or of another schema
    version, an episode's files that cannot be read. The message names the URL (password
    redacted), file and line."""


# ----------------------------------------------------------------- schema

_metadata = MetaData()
_LONG_TEXT = Text().with_variant(LONGTEXT(), "mysql")
# Key columns have lengths (MySQL indexes no TEXT); 190 + 500 characters fit InnoDB's key.
_meta = Table(
    "meta", _metadata,
    Column("key", String(64), primary_key=True),
    Column("value", String(255), nullable=False),
)
_versions = Table(
    "versions", _metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("version", String(255), nullable=False, unique=True),
    Column("first_seen", Double, nullable=False),
    sqlite_autoincrement=True,
)
_episodes = Table(
    "episodes", _metadata,
    Column("run", String(190), primary_key=True),
    Column("episode_id", String(500), primary_key=True),
    Column("run_dir", Text, nullable=False),
    Column("group_id", String(500), nullable=False),
    Column("domain", String(255)),
    Column("task_id", String(255)),
    Column("pass_index", Integer, nullable=False),
    Column("rollout", Integer),
    Column("attempt", Integer),
    Column("status", String(32), nullable=False),
    Column("reward", Double),
    Column("steps", Integer),
    Column("first_version", String(255)),
    Column("last_version", String(255)),
    Column("mixed_versions", Boolean, nullable=False),
    Column("ended_at", Double),
    Column("record", _LONG_TEXT, nullable=False),
    Index("ix_episodes_run_group", "run", "group_id"),
)
_groups = Table(
    "groups", _metadata,
    Column("run", String(190), primary_key=True),
    Column("group_id", String(500), primary_key=True),
    Column("run_dir", Text, nullable=False),
    Column("domain", String(255)),
    Column("task_id", String(255)),
    Column("pass_index", Integer, nullable=False),
    Column("size", Integer, nullable=False),
    Column("record", _LONG_TEXT, nullable=False),
    Column("mean", Double),
    Column("std", Double),
    Column("no_signal", Boolean, nullable=False),
    Column("infra_failures", Integer, nullable=False),
    Column("min_version_seq", Integer),
    Column("max_version_seq", Integer),
    Column("mixed_versions", Boolean, nullable=False),
    Column("created_at", Double, nullable=False),
    Column("state", String(16), nullable=False),
    Column("consumer", String(255)),
    Column("claim_id", String(64)),
    Column("lease_expires", Double),
    Column("claims", Integer, nullable=False, default=0),
    Column("acked_at", Double),
    # Retention (storage.retention, runtime/retention.py): when the group's images were
    # removed (or lossily re-encoded) and by which policy; a group with images_removed_at is
    # never claimed. retention_swept_at: the sweeper has handled the acked group.
    Column("images_removed_at", Double),
    Column("images_removed_by", String(32)),
    Column("retention_swept_at", Double),
    Index("ix_groups_state_created", "state", "created_at"),
    Index("ix_groups_retention", "run", "state", "retention_swept_at", "acked_at"),
)
# Schema upgrades in place: version -> (columns of ``groups`` added, indexes created) that
# bring a database of that version to the next one.
_MIGRATIONS: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {
    1: (("images_removed_at", "images_removed_by", "retention_swept_at"),
        ("ix_groups_retention",)),
}


# ----------------------------------------------------------------- values handed out


@dataclass(frozen=True)
class ClaimedGroup:
    """A group this consumer holds until ``lease_expires`` (epoch seconds): ``group`` is its
    ``group_record``; ``episodes`` its episodes' result records (defaults filled, see
    ``fill_defaults``) in the group's rollout order, each with ``dir`` (the episode's
    directory, absolute) and, when claimed with ``load_steps``, ``steps`` replaced by the
    list of its traj.jsonl lines."""

    run: str
    group_id: str
    claim_id: str
    consumer: str
    lease_expires: float
    group: dict[str, Any]
    episodes: list[dict[str, Any]]

    def ref(self) -> ClaimRef:
        """What ``ack``/``release``/``extend`` need (and ``claim`` prints)."""
        return (self.run, self.group_id, self.claim_id)


@dataclass(frozen=True)
class IndexedGroup:
    """A group as the index holds it, whatever its state (``TrainingIndex.groups``, the
    exports); ``episodes`` as in ``ClaimedGroup``."""

    run: str
    group_id: str
    state: str
    group: dict[str, Any]
    episodes: list[dict[str, Any]]


# (run, group_id, claim_id)
ClaimRef = tuple[str, str, str]


def default_url(run_dir: str | Path) -> str:
    """The SQLite index of a run directory: ``sqlite:///<run_dir>/index.db`` (absolute)."""
    return f"sqlite:///{Path(run_dir).resolve() / INDEX_FILE}"


def index_url(url: str | URL, password_env: str | None = None) -> URL:
    """``url`` parsed, with its password taken from the environment variable named
    ``password_env`` when one is named (so that no password is written in a config file or
    on a command line). ValueError names a bad URL or a variable that is not set. The URL
    object prints with its password hidden; pass it to ``TrainingIndex`` as it is."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ValueError(f"bad database URL {redacted(url)}: {exc}") from None
    if password_env:
        password = os.environ.get(password_env)
        if password is None:
            raise ValueError(f"the environment variable {password_env} (the password of "
                             f"{redacted(parsed)}) is not set")
        parsed = parsed.set(password=password)
    return parsed


def redacted(url: str | URL) -> str:
    """``url`` for messages: its password replaced."""
    if isinstance(url, URL):
        return url.render_as_string(hide_password=True)
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return redact_url(url)


def read_steps(episode_dir: str | Path, *, missing_ok: bool = False) -> list[dict[str, Any]]:
    """The traj.jsonl lines of an episode directory. A missing file is an error unless
    ``missing_ok`` ([] then); a line that is not a JSON object always is (the episode is
    finished, so its file is complete)."""
    path = Path(episode_dir) / TRAJ_FILE
    steps: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in iter_jsonl_lines(f):
                if line.error is not None:
                    raise TrainingIndexError(f"{path}:{line.number}: not JSON ({line.error.msg})")
                if not isinstance(line.value, dict):
                    raise TrainingIndexError(f"{path}:{line.number}: not a JSON object")
                steps.append(line.value)
    except FileNotFoundError:
        if missing_ok:
            return []
        raise TrainingIndexError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TrainingIndexError(f"{path}: cannot read ({exc})") from exc
    return steps


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def _lock_key(run: str, group_id: str) -> int:
    digest = hashlib.blake2b(f"{run}\0{group_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _cursor_key(run: str) -> str:
    """The meta row holding ``run``'s results cursor (a run name can be longer than a key)."""
    return "results_cursor:" + hashlib.sha1(run.encode()).hexdigest()[:32]


def _one_line(exc: BaseException) -> str:
    """A database error in one line: the driver's first line, not SQLAlchemy's SQL dump."""
    orig = getattr(exc, "orig", None) or exc
    lines = str(orig).strip().splitlines()
    return f"{type(orig).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # SQLAlchemy's pysqlite recipe: the driver emits no BEGIN; _sqlite_begin does.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA busy_timeout=30000")  # first: the mode switch may wait
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def _sqlite_begin(conn: Connection) -> None:
    # IMMEDIATE: a writer takes the write lock up front, so two transactions never both
    # read and then deadlock upgrading to write (SQLITE_BUSY that no timeout resolves).
    conn.exec_driver_sql(f"BEGIN {conn.get_execution_options().get(_SQLITE_BEGIN, 'IMMEDIATE')}")


def _episode_row(run: str, run_dir: str, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The episodes row of a results.jsonl record (plus ``started_at`` and ``versions``, for
    the versions' order); ValueError naming the episode and the field that does not fit."""
    episode_id = raw.get("episode_id")
    if not isinstance(episode_id, str) or not episode_id:
        raise ValueError(f"run {run}: a record without an episode_id: {_dumps(raw)[:200]}")
    if not isinstance(raw.get("status"), str):
        raise ValueError(f"run {run}, episode {episode_id}: no status")
    key = None
    try:
        f = fill_defaults(raw)
        row: dict[str, Any] = {
            "run": run, "episode_id": episode_id, "run_dir": run_dir,
            "group_id": str(f["group_id"]), "domain": f.get("domain"),
            "task_id": f.get("task_id"), "pass_index": f["pass_index"],
            "status": f["status"], "first_version": f["first_model_version"],
            "last_version": f.get("model_version"), "mixed_versions": bool(f["mixed_versions"]),
            "record": _dumps(raw), "versions": f["model_versions"],
        }
        for key, kind in (("rollout", int), ("attempt", int), ("steps", int),
                          ("reward", float), ("ended_at", float), ("started_at", float)):
            value = f.get(key)
            row[key] = kind(value) if value is not None else None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"run {run}, episode {episode_id}: {f'{key}: ' if key else ''}{exc}"
                         ) from None
    row["started_at"] = row["started_at"] or 0.0
    return row


def _started(record: Mapping[str, Any]) -> float:
    try:
        return float(record.get("started_at") or 0.0)
    except (TypeError, ValueError):
        return 0.0


def _claim_items(claims: Iterable[ClaimedGroup | Sequence[str]]) -> list[ClaimRef]:
    out = []
    for claim in claims:
        if isinstance(claim, ClaimedGroup):
            out.append(claim.ref())
        else:
            run, group_id, claim_id = claim
            out.append((str(run), str(group_id), str(claim_id)))
    return out


# ----------------------------------------------------------------- the index


class TrainingIndex:
    """Episodes and groups of runs in the database at ``url`` (tables created on open).
    Thread-safe: each call takes a pooled connection of its own. ``clock`` gives the time
    leases are measured with (epoch seconds)."""

    def __init__(self, url: str | URL, *, clock: Callable[[], float] = time.time) -> None:
        try:
            self.url = make_url(url)
        except ArgumentError as exc:
            raise ValueError(f"bad database URL {redacted(url)}: {exc}") from None
        self._clock = clock
        self._backend = self.url.get_backend_name()
        self._seqs: dict[str, int] = {}  # version -> seq, committed ones only
        try:
            if self._backend == "sqlite":
                self._engine: Engine = create_engine(self.url)
                event.listen(self._engine, "connect", _sqlite_connect)
                event.listen(self._engine, "begin", _sqlite_begin)
                self._reader = self._engine.execution_options(**{_SQLITE_BEGIN: "DEFERRED"})
            else:
                self._engine = create_engine(self.url, pool_pre_ping=True)
                self._reader = self._engine
        except ArgumentError as exc:  # an unknown dialect
            raise ValueError(f"bad database URL {self}: {exc}") from None
        except ImportError as exc:
            raise ValueError(f"{self}: its driver is not installed ({exc})") from None
        try:
            self._open_schema()
        except SQLAlchemyError as exc:
            self._engine.dispose()
            raise TrainingIndexError(f"cannot open {self}: {_one_line(exc)}") from exc
        except BaseException:
            self._engine.dispose()
            raise

    def __str__(self) -> str:
        return redacted(self.url)

    def __enter__(self) -> TrainingIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the pooled connections."""
        self._engine.dispose()

    def _open_schema(self) -> None:
        with self._engine.begin() as conn:
            if self._backend == "postgresql":  # concurrent create_all collide in pg_type
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _SCHEMA_LOCK_KEY})
            found = None
            if inspect(conn).has_table("meta"):
                found = conn.execute(
                    select(_meta.c.value).where(_meta.c.key == "schema_version")).scalar()
            if found is not None and found != str(SCHEMA_VERSION):
                self._migrate(conn, found)
            _metadata.create_all(conn)
            if found is None:
                conn.execute(insert(_meta).values(key="schema_version",
                                                  value=str(SCHEMA_VERSION)))

    def _migrate(self, conn: Connection, found: str) -> None:
        """Bring a database of an older schema version to ``SCHEMA_VERSION`` (in the open's
        transaction: all or nothing); a version with no way up is an error."""
        version = int(found) if found.isdigit() else None
        if version is None or version > SCHEMA_VERSION or any(
                v not in _MIGRATIONS for v in range(version, SCHEMA_VERSION)):
            raise TrainingIndexError(
                f"{self}: index schema version {found}, this code reads version "
                f"{SCHEMA_VERSION}; reindex the runs into a new database")
        table = conn.dialect.identifier_preparer.format_table(_groups)
        indexes = {i.name: i for i in _groups.indexes}
        for step in range(version, SCHEMA_VERSION):
            columns, new_indexes = _MIGRATIONS[step]
            for name in columns:
                column = _groups.c[name]
                kind = column.type.compile(dialect=conn.dialect)
                quoted = conn.dialect.identifier_preparer.quote(name)
                conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {quoted} {kind}"))
            for name in new_indexes:
                indexes[name].create(conn, checkfirst=True)
        conn.execute(update(_meta).where(_meta.c.key == "schema_version")
                     .values(value=str(SCHEMA_VERSION)))
        log.warning("%s: index schema upgraded from version %s to %d", self, found,
                    SCHEMA_VERSION)

    # ------------------------------------------------------------- transactions

    @contextlib.contextmanager
    def _writing(self, groups: Iterable[tuple[str, str]] = ()) -> Iterator[Connection]:
        """A write transaction that holds the lock of each (run, group_id) in ``groups``,
        taken in sorted order (no two writers wait on each other in a cycle)."""
        keys = sorted(set(groups))
        with self._engine.connect() as conn:
            held = False
            try:
                if self._backend in ("mysql", "mariadb") and keys:
                    for run, group_id in keys:
                        name = f"cua-training-{_lock_key(run, group_id) & (2**64 - 1):016x}"
                        got = conn.execute(text("SELECT GET_LOCK(:n, 60)"), {"n": name}).scalar()
                        held = True
                        if got != 1:
                            raise TrainingIndexError(f"{self}: lock of group {run} {group_id} "
                                                     "not granted within 60 s")
                    conn.commit()
                with conn.begin():
                    if self._backend == "postgresql":
                        for run, group_id in keys:
                            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"),
                                         {"k": _lock_key(run, group_id)})
                    yield conn
            finally:
                if held:
                    conn.rollback()
                    conn.execute(text("SELECT RELEASE_ALL_LOCKS()"))
                    conn.commit()

    @contextlib.contextmanager
    def _reading(self) -> Iterator[Connection]:
        with self._reader.connect() as conn, conn.begin():
            yield conn

    # ------------------------------------------------------------- versions

    def _register_versions(self, names: Iterable[str]) -> None:
        """Give every version in ``names`` not seen yet its seq, in the order given, in a
        transaction of its own (committed before any group lock is taken)."""
        missing = [v for v in dict.fromkeys(names) if v not in self._seqs]
        if not missing:
            return
        now = self._clock()
        with self._writing() as conn:
            known = self._lookup_seqs(conn, missing)
            for version in missing:
                if version in known:
                    continue
                try:
                    with conn.begin_nested():
                        conn.execute(insert(_versions).values(version=version, first_seen=now))
                except IntegrityError:
                    pass  # another writer registered it first: its seq stands
            found = self._lookup_seqs(conn, missing)
        self._seqs.update(found)

    @staticmethod
    def _lookup_seqs(conn: Connection, names: list[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for i in range(0, len(names), _CHUNK):
            rows = conn.execute(select(_versions.c.version, _versions.c.seq)
                                .where(_versions.c.version.in_(names[i:i + _CHUNK])))
            out.update({v: s for v, s in rows})
        return out

    def _seqs_of(self, conn: Connection, names: list[str]) -> list[int]:
        missing = [v for v in names if v not in self._seqs]
        found = {**self._lookup_seqs(conn, missing), **self._seqs} if missing else self._seqs
        return [found[v] for v in names if v in found]

    # ------------------------------------------------------------- writing episodes

    def record_episode(self, run: str, run_dir: str | Path, record: Mapping[str, Any]
                       ) -> dict[str, Any] | None:
        """Upsert one results.jsonl record of run ``run`` (a later record of the same
        episode replaces the earlier one). Returns the group's ``group_record`` when this
        record completed the group (its row is created, state ``ready``) or changed a group
        still ``ready`` (its row is rebuilt); else None. A change to a group already claimed
        or acked is logged and left out of it."""
        made = self.record_episodes(run, run_dir, [record])
        return made[0] if made else None

    def record_episodes(self, run: str, run_dir: str | Path,
                        records: Iterable[Mapping[str, Any]], *,
                        cursor: LineMark | None = None) -> list[dict[str, Any]]:
        """``record_episode`` for many records in one transaction (the later of two records
        of an episode wins); returns the groups created or rebuilt. ``cursor``: the last of
        those records' line in the run's results.jsonl, every line before it in the index
        now: stored in the same transaction (``reindex(resume=True)`` starts after it)."""
        made, _ = self._record(run, run_dir, list(records), cursor=cursor)
        return made

    def cursor(self, run: str) -> LineMark | None:
        """The line of ``run``'s results.jsonl up to which the index holds every line (as
        its writer last stored it), or None."""
        with self._reading() as conn:
            value = conn.execute(select(_meta.c.value).where(
                _meta.c.key == _cursor_key(run))).scalar()
        return LineMark.from_json(json.loads(value)) if value else None

    def set_cursor(self, run: str, mark: LineMark | None) -> None:
        """Store (None: forget) the line up to which the index holds ``run``'s results: the
        run's storage does so after a compaction rewrote the file it had indexed whole."""
        with self._writing() as conn:
            self._store_cursor(conn, run, mark)

    @staticmethod
    def _store_cursor(conn: Connection, run: str, mark: LineMark | None) -> None:
        key = _cursor_key(run)
        conn.execute(_meta.delete().where(_meta.c.key == key))
        if mark is not None:
            conn.execute(insert(_meta).values(key=key, value=json.dumps(mark.to_json())))

    def _record(self, run: str, run_dir: str | Path, records: list[Mapping[str, Any]],
                changed: set[str] | None = None, cursor: LineMark | None = None
                ) -> tuple[list[dict[str, Any]], Counter[str]]:
        """Upsert ``records`` (and store ``cursor``); the groups created or rebuilt, and
        counts. ``changed`` gets the groups whose episodes changed."""
        run_dir = str(Path(run_dir).resolve())
        latest: dict[str, tuple[str, dict[str, Any]]] = {}  # episode_id -> (line, row)
        for raw in records:
            if raw.get("status") == "cancelled":
                continue  # not final: the episode runs again and its next line counts
            row = _episode_row(run, run_dir, raw)
            latest.pop(row["episode_id"], None)
            latest[row["episode_id"]] = (row["record"], row)
        counts: Counter[str] = Counter()
        if not latest:
            if cursor is not None:
                self.set_cursor(run, cursor)
            return [], counts
        by_start = sorted((r for _, r in latest.values()), key=lambda r: r["started_at"])
        self._register_versions(v for r in by_start for v in r["versions"])

        group_ids = {r["group_id"] for _, r in latest.values()}
        made: list[dict[str, Any]] = []
        with self._writing((run, g) for g in group_ids) as conn:
            ids = list(latest)
            existing: dict[str, tuple[str, str]] = {}  # episode_id -> (group_id, line)
            for i in range(0, len(ids), _CHUNK):
                rows = conn.execute(
                    select(_episodes.c.episode_id, _episodes.c.group_id, _episodes.c.record)
                    .where(_episodes.c.run == run, _episodes.c.episode_id.in_(ids[i:i + _CHUNK])))
                existing.update({e: (g, r) for e, g, r in rows})
            inserts, updates = [], []
            changed = set() if changed is None else changed
            for episode_id, (line, full) in latest.items():
                old = existing.get(episode_id)
                if old is not None and old[1] == line:
                    counts["unchanged"] += 1
                    continue
                row = {c.name: full[c.name] for c in _episodes.columns}
                changed.add(row["group_id"])
                if old is None:
                    inserts.append(row)
                else:
                    updates.append({f"b_{k}": v for k, v in row.items()})
                    changed.add(old[0])  # an episode that moved to another group
            if inserts:
                conn.execute(insert(_episodes), inserts)
            if updates:
                conn.execute(
                    update(_episodes)
                    .where(_episodes.c.run == bindparam("b_run"),
                           _episodes.c.episode_id == bindparam("b_episode_id"))
                    .values({c.name: bindparam(f"b_{c.name}") for c in _episodes.columns
                             if c.name not in ("run", "episode_id")}), updates)
            counts["inserted"] += len(inserts)
            counts["replaced"] += len(updates)
            for group_id in sorted(group_ids | changed):
                group = self._settle_group(conn, run, run_dir, group_id,
                                           group_id in changed, None)
                if group is not None:
                    counts[group.pop("_outcome")] += 1
                    made.append(group)
            if cursor is not None:
                self._store_cursor(conn, run, cursor)
        return made, counts

    def _settle_group(self, conn: Connection, run: str, run_dir: str, group_id: str,
                      changed: bool, size: int | None, *, whole: bool = False
                      ) -> dict[str, Any] | None:
        """Create the group's row when it is complete, rebuild it when it changed and is
        still ready. ``whole``: the run finished, so a group whose records do not say its
        size is complete as it is. Returns its record with ``_outcome`` (created/rebuilt),
        or None."""
        lines = conn.execute(select(_episodes.c.record).where(
            _episodes.c.run == run, _episodes.c.group_id == group_id)).scalars().all()
        records = [fill_defaults(json.loads(line)) for line in lines]
        if size is None:
            size = max((r["group_size"] for r in records if r["group_size"]), default=None)
        if size is None and whole:
            size = len(records)
        if size is None or len(records) < size or not records:
            return None
        where = and_(_groups.c.run == run, _groups.c.group_id == group_id)
        state = conn.execute(select(_groups.c.state).where(where)).scalar()
        if state is not None and not changed:
            return None
        if state not in (None, "ready", "failed_infra"):
            log.warning("run %s, group %s: an episode changed after the group was %s; the "
                        "group is left as it was (reindex into a new database to rebuild it)",
                        run, group_id, state)
            return None
        first = records[0]
        group = group_record(group_id, domain=first.get("domain"), task_id=first.get("task_id"),
                             pass_index=first["pass_index"], group_size=size, episodes=records)
        seqs = self._seqs_of(conn, group["versions"])
        values = {
            "run_dir": run_dir, "domain": group["domain"], "task_id": group["task_id"],
            "pass_index": group["pass_index"], "size": size, "record": _dumps(group),
            "mean": group["mean"], "std": group["std"], "no_signal": group["no_signal"],
            "infra_failures": group["infra_failures"],
            "min_version_seq": min(seqs) if seqs else None,
            "max_version_seq": max(seqs) if seqs else None,
            "mixed_versions": group["mixed_versions"],
        }
        settled = "failed_infra" if group["infra_failures"] else "ready"
        if state is None:
            removed = _markers_of(run_dir, records)
            if removed is not None:  # a reindex of a run whose retention already acted
                values.update(images_removed_at=removed.at, images_removed_by=removed.policy)
            conn.execute(insert(_groups).values(
                run=run, group_id=group_id, created_at=self._clock(), state=settled,
                claims=0, **values))
            return {**group, "_outcome": "groups_created"}
        done = conn.execute(update(_groups).where(where, _groups.c.state == state)
                            .values(state=settled, **values))
        if done.rowcount == 0:  # claimed in the meantime (PostgreSQL: no lock against claims)
            log.warning("run %s, group %s: an episode changed as the group was claimed; the "
                        "group is left as it was", run, group_id)
            return None
        return {**group, "_outcome": "groups_rebuilt"}

    def reindex(self, run_dir: str | Path, run: str | None = None, *,
                resume: bool = False) -> dict[str, Any]:
        """Bring the run's rows in line with its results.jsonl (the last line of each
        episode wins; lines that are not JSON records are skipped with a warning). ``run``
        defaults to run.json's ``run``, else the directory's name. ``resume``: read only
        the lines after the run's cursor (``cursor``: what the storage's feed stored with
        its last transaction), when that line is still where the cursor says; else, and
        by default, the whole file. Either way the cursor ends at the last line read, so a
        run's start costs what was written since the index last heard of it, not the run's
        length (``from_byte`` in the counts says where reading began). Records without
        ``group_size`` complete their group only when run.json says the run ``finished``
        (with the episodes present). Idempotent; returns counts.

        The file is read line by line, twice, and never held: first the versions (the
        order the run first used them in) and the episodes a later line may supersede
        (those with a ``cancelled`` or ``infra_error`` line: a final episode never runs
        again), then the records, written in transactions of at most ``_REINDEX_GROUPS``
        groups. Two final lines of one episode, which no run writes, are both written, the
        later one last."""
        run_dir = Path(run_dir).resolve()
        results = run_dir / RESULTS_FILE
        if not run_dir.is_dir():
            raise FileNotFoundError(f"{run_dir}: no such run directory")
        info = read_json(run_dir / RUN_FILE)
        info = info if isinstance(info, dict) else {}
        if not results.is_file() and not info:
            raise FileNotFoundError(f"{run_dir}: not a run directory (no {RESULTS_FILE}, "
                                    f"no {RUN_FILE})")
        run = run or (str(info["run"]) if info.get("run") else run_dir.name)
        start = 0
        if resume:
            mark = self.cursor(run)
            if mark is not None and mark.found_in(results):
                start = mark.end
            elif mark is not None:
                log.info("%s: not the file the index's cursor was stored for (rewritten "
                         "by a compaction or replaced): read whole", results)
        counts: Counter[str] = Counter()
        first_use: dict[str, tuple[float, int, int]] = {}
        last_of: dict[str, int] = {}  # episode with a line a later one may supersede -> last
        for number, record, _ in self._result_records(results, run, run_dir, None, start):
            row_versions = fill_defaults(record)["model_versions"]
            for i, version in enumerate(row_versions):
                use = (_started(record), number, i)
                if version not in first_use or use < first_use[version]:
                    first_use[version] = use
            episode_id = record["episode_id"]
            if episode_id in last_of or record.get("status") in ("cancelled", "infra_error"):
                last_of[episode_id] = number
        # Versions in the order the run first used them, whatever the batches below.
        self._register_versions(sorted(first_use, key=first_use.__getitem__))
        finished = info.get("status") == "finished"
        legacy: dict[str, bool] = {}  # group without group_size -> changed by this reindex
        episodes = 0
        batch: list[dict[str, Any]] = []
        batch_groups: set[str] = set()

        def write() -> None:
            changed: set[str] = set()
            _, done = self._record(run, run_dir, batch, changed=changed)
            counts.update(done)
            for group_id in changed & legacy.keys():
                legacy[group_id] = True
            batch.clear()
            batch_groups.clear()

        last_read: LineMark | None = None
        for number, record, mark in self._result_records(results, run, run_dir, counts, start):
            last_read = mark
            seen_last = last_of.get(record["episode_id"])
            if seen_last is not None and seen_last != number:
                continue  # superseded by a later line of the episode
            episodes += 1
            if record.get("status") == "cancelled":
                continue  # a cut straggler or a stopped run's episode: not final, runs again
            filled = fill_defaults(record)
            group_id = filled["group_id"]
            if finished and filled["group_size"] is None:
                legacy.setdefault(group_id, False)
            if group_id not in batch_groups and len(batch_groups) >= _REINDEX_GROUPS:
                write()
            batch.append(record)
            batch_groups.add(group_id)
        if batch:
            write()
        if last_read is not None or start == 0:
            # Everything up to the last line read is in now (a file that is gone or empty
            # from the start: no cursor).
            self.set_cursor(run, last_line_mark(results) if last_read is None else last_read)
        # A finished run's groups whose records never said their size: complete as they are.
        group_ids = sorted(legacy)
        for i in range(0, len(group_ids), _REINDEX_GROUPS):
            chunk = group_ids[i:i + _REINDEX_GROUPS]
            with self._writing((run, g) for g in chunk) as conn:
                for group_id in chunk:
                    group = self._settle_group(conn, run, str(run_dir), group_id,
                                               legacy[group_id], None, whole=True)
                    if group is not None:
                        counts[group.pop("_outcome")] += 1
        with self._reading() as conn:
            in_db = conn.execute(select(func.count()).select_from(_groups)
                                 .where(_groups.c.run == run)).scalar_one()
            with_episodes = conn.execute(
                select(func.count(func.distinct(_episodes.c.group_id)))
                .where(_episodes.c.run == run)).scalar_one()
        return {"run": run, "run_dir": str(run_dir), "from_byte": start,
                "lines": counts["lines"],
                "skipped": counts["skipped"], "episodes": episodes,
                "inserted": counts["inserted"], "replaced": counts["replaced"],
                "unchanged": counts["unchanged"], "groups": in_db,
                "groups_created": counts["groups_created"],
                "groups_rebuilt": counts["groups_rebuilt"],
                "incomplete_groups": max(0, with_episodes - in_db)}

    @staticmethod
    def _result_records(results: Path, run: str, run_dir: Path, counts: Counter[str] | None,
                        start: int = 0
                        ) -> Iterator[tuple[int, dict[str, Any], LineMark]]:
        """The episode records of results.jsonl from byte ``start`` with their line numbers
        (counted from there) and marks, read one line at a time; with ``counts``, the lines
        are counted and those skipped logged."""
        number = 0
        try:
            for at, raw in iter_lines_from(results, start):
                if not raw.strip():
                    continue
                number += 1
                where = f"{results}:{number}" if start == 0 else f"{results} (byte {at})"
                try:
                    value = json.loads(raw)
                except ValueError as exc:
                    problem, value = f"not JSON ({exc})", None
                else:
                    problem = None if isinstance(value, dict) else "not an episode record"
                if problem is None:
                    try:
                        _episode_row(run, str(run_dir), value)
                    except ValueError as exc:
                        problem = str(exc)
                    else:
                        if counts is not None:
                            counts["lines"] += 1
                        yield number, value, LineMark.of(at, raw)
                        continue
                if counts is not None:
                    counts["lines"] += 1
                    counts["skipped"] += 1
                    log.warning("%s: %s, skipped", where, problem)
        except FileNotFoundError:
            return

    # ------------------------------------------------------------- consumers

    def claim_groups(self, n: int, consumer: str, *, lease_s: float = 600,
                     min_version: str | None = None, max_staleness: int | None = None,
                     run: str | None = None, include_no_signal: bool = True,
                     load_steps: bool = False) -> list[ClaimedGroup]:
        """Take up to ``n`` groups, oldest first (ready ones and expired leases alike), each
        to this consumer only, until ``now + lease_s``. ``min_version``: only groups made
        entirely by that version or later ones (ValueError when the index never saw it);
        ``max_staleness``: only groups whose oldest version is at most that many versions
        behind the newest seen; ``run``: only that run's; ``include_no_signal`` False: only
        groups with a learning signal. ``load_steps``: read each episode's traj.jsonl (a
        missing file is an error, except for a masked episode; on error the claims are
        released and ``TrainingIndexError`` raised)."""
        if n < 1:
            raise ValueError(f"n must be at least 1, not {n}")
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, not {lease_s}")
        now = self._clock()
        expires = now + lease_s
        with self._writing() as conn:
            conditions = []
            floor = self._version_floor(conn, min_version, max_staleness)
            if floor is not None:
                conditions.append(_groups.c.min_version_seq >= floor)
            if run is not None:
                conditions.append(_groups.c.run == run)
            if not include_no_signal:
                conditions.append(_groups.c.no_signal.is_(False))
            # A group whose images retention removed is never handed out (storage.retention).
            conditions.append(_groups.c.images_removed_at.is_(None))
            # Two indexed queries (state, created_at), not one with an OR: each reads n rows
            # at most; the oldest n of both are taken (PostgreSQL: the others are locked only
            # until this transaction ends, other consumers skip them meanwhile).
            order = (_groups.c.created_at, _groups.c.run, _groups.c.group_id)
            found: list[Any] = []
            for state in (and_(_groups.c.state == "claimed", _groups.c.lease_expires < now),
                          _groups.c.state == "ready"):
                found += conn.execute(
                    select(*order, _groups.c.record).where(state, *conditions)
                    .order_by(*order).limit(n).with_for_update(skip_locked=True)).all()
            picked = sorted(found, key=lambda r: (r.created_at, r.run, r.group_id))[:n]
            if not picked:
                return []
            claim_ids = [uuid.uuid4().hex for _ in picked]
            conn.execute(
                update(_groups)
                .where(_groups.c.run == bindparam("b_run"),
                       _groups.c.group_id == bindparam("b_group_id"))
                .values(state="claimed", consumer=consumer, claim_id=bindparam("b_claim_id"),
                        lease_expires=expires, claims=_groups.c.claims + 1),
                [{"b_run": r.run, "b_group_id": r.group_id, "b_claim_id": c}
                 for r, c in zip(picked, claim_ids, strict=True)])
            groups = {(r.run, r.group_id): json.loads(r.record) for r in picked}
            episodes = self._episodes_of(conn, groups)
        claims = [ClaimedGroup(r.run, r.group_id, c, consumer, expires,
                               groups[r.run, r.group_id], episodes[r.run, r.group_id])
                  for r, c in zip(picked, claim_ids, strict=True)]
        if load_steps:
            try:
                for claim in claims:
                    _load_steps(claim.episodes)
            except BaseException:
                self.release(claims)
                raise
        return claims

    def _version_floor(self, conn: Connection, min_version: str | None,
                       max_staleness: int | None) -> int | None:
        floor: int | None = None
        if min_version is not None:
            floor = conn.execute(select(_versions.c.seq)
                                 .where(_versions.c.version == min_version)).scalar()
            if floor is None:
                newest = conn.execute(select(_versions.c.version)
                                      .order_by(_versions.c.seq.desc()).limit(5)).scalars().all()
                raise ValueError(f"unknown model version {min_version!r}; the newest known: "
                                 f"{', '.join(newest) if newest else 'none'}")
        if max_staleness is not None:
            if max_staleness < 0:
                raise ValueError(f"max_staleness must be >= 0, not {max_staleness}")
            newest_seq = conn.execute(select(func.max(_versions.c.seq))).scalar()
            stale_floor = (newest_seq or 0) - max_staleness
            floor = stale_floor if floor is None else max(floor, stale_floor)
        return floor

    def _episodes_of(self, conn: Connection, groups: Mapping[tuple[str, str], dict[str, Any]]
                     ) -> dict[tuple[str, str], list[dict[str, Any]]]:
        """Each group's episodes (records with defaults and ``dir``) in its rollout order."""
        by_run: dict[str, list[str]] = defaultdict(list)
        for run, group_id in groups:
            by_run[run].append(group_id)
        found: dict[tuple[str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
        for run, ids in by_run.items():
            for i in range(0, len(ids), _CHUNK):
                rows = conn.execute(
                    select(_episodes.c.group_id, _episodes.c.episode_id, _episodes.c.run_dir,
                           _episodes.c.record)
                    .where(_episodes.c.run == run, _episodes.c.group_id.in_(ids[i:i + _CHUNK])))
                for group_id, episode_id, run_dir, line in rows:
                    found[run, group_id][episode_id] = {
                        **fill_defaults(json.loads(line)), "dir": str(Path(run_dir) / episode_id)}
        out = {}
        for key, group in groups.items():
            have = found.get(key, {})
            out[key] = [have[e] for e in group["episode_ids"] if e in have]
        return out

    def ack(self, claims: Iterable[ClaimedGroup | Sequence[str]]) -> list[tuple[str, str]]:
        """Mark claimed groups acked (trained on). A claim is acked only while its claim id
        is the group's (also after its lease ran out, as long as nobody claimed the group
        since); acking twice is harmless. Returns the (run, group_id) of the claims that
        could not be acked: the group was claimed by another consumer (or released)."""
        items = _claim_items(claims)
        now = self._clock()
        lost = []
        with self._writing() as conn:
            for run, group_id, claim_id in items:
                mine = and_(_groups.c.run == run, _groups.c.group_id == group_id,
                            _groups.c.claim_id == claim_id)
                done = conn.execute(update(_groups).where(mine, _groups.c.state == "claimed")
                                    .values(state="acked", acked_at=now, lease_expires=None))
                if done.rowcount == 0 and conn.execute(
                        select(_groups.c.state).where(mine)).scalar() != "acked":
                    lost.append((run, group_id))
        return lost

    def release(self, claims: Iterable[ClaimedGroup | Sequence[str]]) -> int:
        """Give claimed groups back (state ``ready``) where the claim still holds; returns
        how many were released."""
        released = 0
        with self._writing() as conn:
            for run, group_id, claim_id in _claim_items(claims):
                released += conn.execute(
                    update(_groups)
                    .where(_groups.c.run == run, _groups.c.group_id == group_id,
                           _groups.c.claim_id == claim_id, _groups.c.state == "claimed")
                    .values(state="ready", consumer=None, claim_id=None,
                            lease_expires=None)).rowcount
        return released

    def extend(self, claims: Iterable[ClaimedGroup | Sequence[str]], lease_s: float
               ) -> list[tuple[str, str]]:
        """Renew the leases of claims still held to ``now + lease_s`` (the ClaimedGroup's own
        ``lease_expires`` is not updated); returns the (run, group_id) no longer held."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, not {lease_s}")
        expires = self._clock() + lease_s
        lost = []
        with self._writing() as conn:
            for run, group_id, claim_id in _claim_items(claims):
                done = conn.execute(
                    update(_groups)
                    .where(_groups.c.run == run, _groups.c.group_id == group_id,
                           _groups.c.claim_id == claim_id, _groups.c.state == "claimed")
                    .values(lease_expires=expires))
                if done.rowcount == 0:
                    lost.append((run, group_id))
        return lost

    # ------------------------------------------------------------- retention

    def released_groups(self, run: str, limit: int) -> list[IndexedGroup]:
        """Up to ``limit`` acked groups of ``run`` that retention has not handled yet
        (``mark_swept``), oldest ack first, then ``failed_infra`` ones (never trained, so
        never acked: released as they are made): indexed queries that read those rows only."""
        rows: list[Any] = []
        with self._reading() as conn:
            for state, first in (("acked", _groups.c.acked_at),
                                 ("failed_infra", _groups.c.created_at)):
                if len(rows) >= limit:
                    break
                rows += conn.execute(
                    select(_groups.c.run, _groups.c.group_id, _groups.c.state,
                           _groups.c.record)
                    .where(_groups.c.run == run, _groups.c.state == state,
                           _groups.c.retention_swept_at.is_(None))
                    .order_by(first, _groups.c.group_id).limit(limit - len(rows))).all()
            records = {(r.run, r.group_id): json.loads(r.record) for r in rows}
            episodes = self._episodes_of(conn, records)
        return [IndexedGroup(r.run, r.group_id, r.state, records[r.run, r.group_id],
                             episodes[r.run, r.group_id]) for r in rows]

    def mark_images_removed(self, run: str, group_ids: Iterable[str], policy: str,
                            at: float | None = None) -> int:
        """Record that these groups' images are (about to be) removed by ``policy``: no
        claim hands them out from now on. Call it BEFORE removing a group's files (a claim
        in between would hand out missing images); a manual cleanup calls it too. Returns
        how many groups were marked (one already marked keeps its first mark)."""
        ids = list(dict.fromkeys(group_ids))
        at = self._clock() if at is None else at
        marked = 0
        with self._writing() as conn:
            for i in range(0, len(ids), _CHUNK):
                marked += conn.execute(
                    update(_groups).where(_groups.c.run == run,
                                          _groups.c.group_id.in_(ids[i:i + _CHUNK]),
                                          _groups.c.images_removed_at.is_(None))
                    .values(images_removed_at=at, images_removed_by=policy)).rowcount
        return marked

    def mark_swept(self, run: str, group_ids: Iterable[str], at: float | None = None) -> None:
        """Retention has handled these acked groups (``released_groups`` skips them)."""
        ids = list(dict.fromkeys(group_ids))
        at = self._clock() if at is None else at
        with self._writing() as conn:
            for i in range(0, len(ids), _CHUNK):
                conn.execute(update(_groups).where(_groups.c.run == run,
                                                   _groups.c.group_id.in_(ids[i:i + _CHUNK]))
                             .values(retention_swept_at=at))

    # ------------------------------------------------------------- reading

    def status(self, run: str | None = None) -> dict[str, Any]:
        """Counts, of ``run`` only when given: ``groups`` by state (ready, claimed, acked)
        and their ``total``; ``expired_leases`` (claimed groups another consumer may take);
        ``no_signal`` groups; ``episodes``; ``runs``; ``versions`` and the newest;
        ``consumers``: groups held by each consumer."""
        now = self._clock()
        with self._reading() as conn:
            g_where = [_groups.c.run == run] if run is not None else []
            e_where = [_episodes.c.run == run] if run is not None else []
            states = dict(conn.execute(select(_groups.c.state, func.count())
                                       .where(*g_where).group_by(_groups.c.state)).all())
            expired = conn.execute(select(func.count()).select_from(_groups).where(
                *g_where, _groups.c.state == "claimed", _groups.c.lease_expires < now)
            ).scalar_one()
            consumers = dict(conn.execute(
                select(_groups.c.consumer, func.count()).where(*g_where,
                                                               _groups.c.state == "claimed")
                .group_by(_groups.c.consumer)).all())
            no_signal = conn.execute(select(func.count()).select_from(_groups).where(
                *g_where, _groups.c.no_signal.is_(True))).scalar_one()
            images_removed = conn.execute(select(func.count()).select_from(_groups).where(
                *g_where, _groups.c.images_removed_at.is_not(None))).scalar_one()
            episodes = conn.execute(select(func.count()).select_from(_episodes)
                                    .where(*e_where)).scalar_one()
            runs = conn.execute(select(func.count(func.distinct(_episodes.c.run)))
                                .where(*e_where)).scalar_one()
            newest = conn.execute(select(_versions.c.version, _versions.c.seq)
                                  .order_by(_versions.c.seq.desc()).limit(1)).first()
            n_versions = conn.execute(select(func.count()).select_from(_versions)).scalar_one()
        return {
            "url": str(self), "run": run, "runs": runs, "episodes": episodes,
            "groups": {**{s: int(states.get(s, 0)) for s in STATES},
                       "total": sum(states.values())},
            "expired_leases": expired, "no_signal": no_signal,
            "images_removed": images_removed,
            "consumers": {str(c): n for c, n in consumers.items()},
            "versions": n_versions, "newest_version": newest.version if newest else None,
            "newest_version_seq": newest.seq if newest else None,
        }

    def groups(self, *, run: str | None = None, state: str | None = None,
               load_steps: bool = False, page: int = 200) -> Iterator[IndexedGroup]:
        """Every group (of ``run``, in ``state``) in created order, read ``page`` at a time
        (each page in a transaction of its own). ``load_steps`` as in ``claim_groups``."""
        if state is not None and state not in STATES:
            raise ValueError(f"unknown state {state!r}; one of {', '.join(STATES)}")
        after: tuple[float, str, str] | None = None
        order = (_groups.c.created_at, _groups.c.run, _groups.c.group_id)
        while True:
            query = select(*order, _groups.c.state, _groups.c.record).order_by(*order).limit(page)
            if run is not None:
                query = query.where(_groups.c.run == run)
            if state is not None:
                query = query.where(_groups.c.state == state)
            if after is not None:
                query = query.where(tuple_(*order) > tuple_(*after))
            with self._reading() as conn:
                rows = conn.execute(query).all()
                records = {(r.run, r.group_id): json.loads(r.record) for r in rows}
                episodes = self._episodes_of(conn, records)
            for r in rows:
                key = (r.run, r.group_id)
                if load_steps:
                    _load_steps(episodes[key])
                yield IndexedGroup(r.run, r.group_id, r.state, records[key], episodes[key])
            if len(rows) < page:
                return
            last = rows[-1]
            after = (last.created_at, last.run, last.group_id)


def _markers_of(run_dir: str, records: list[dict[str, Any]]) -> RetentionMarker | None:
    """The first retention marker among a group's episodes that changed their images (a
    stat per episode, at the group's creation only)."""
    for record in records:
        marker = read_marker(Path(run_dir) / str(record.get("episode_id")))
        if marker is not None and marker.images_gone:
            return marker
    return None


def _load_steps(episodes: list[dict[str, Any]]) -> None:
    """Replace each episode's ``steps`` count by its traj.jsonl lines (a masked episode may
    have none: its directory can be gone)."""
    for episode in episodes:
        episode["steps"] = read_steps(episode["dir"], missing_ok=not is_scored(episode))
