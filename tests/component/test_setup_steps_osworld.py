"""Component: the OSWorld setup steps we added and the host's download cache
(``cua_rollout.envs.downloads``), against a real HTTP server on loopback that counts what it
serves. A URL is downloaded once per host even when two processes ask for it twice each at
the same moment; offline, a miss names the URL and every path looked at; HTTP errors name
their status; OSWorld's cache names are read as they are; a cached name linked out of the
cache is refused. ``step_problem`` judges steps without a desktop.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import multiprocessing
import socket
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import BadTaskStep, TaskSetupError, UnsupportedSetupStep
from cua_rollout.core.http import ThreadedServer
from cua_rollout.envs.chrome import (
    HISTORY_TEMPLATE_NAME,
    HISTORY_TEMPLATE_URL,
    DevTools,
    chrome_time,
    same_page_url,
)
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.downloads import DownloadCache, download_cache
from cua_rollout.envs.setup_steps import (
    STEP_PARAMETERS,
    STEP_TYPES,
    run_setup_step,
    step_problem,
)

# How long the server takes over a body: long enough that concurrent fetches overlap.
SLOW_BODY_S = 0.5


# --------------------------------------------------------------------------- the file server


class FileServer:
    """Serves ``/files/<name>`` (a body derived from the name, sent slowly in two halves),
    ``/missing`` (404) and ``/flaky/<name>`` (503 the first time, then the file); counts
    every request by path."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self._server = ThreadedServer(self._app)

    @property
    def url(self) -> str:
        return self._server.url

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        query = scope["query_string"].decode()
        path = scope["path"] + (f"?{query}" if query else "")  # the request target, as sent
        self.hits[path] += 1  # one event loop: no lock needed
        count = self.hits[path]
        name = path.rsplit("/", 1)[-1]
        if path.startswith("/files/") or (path.startswith("/flaky/") and count > 1):
            body = body_of(name)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body[: len(body) // 2],
                        "more_body": True})
            await asyncio.sleep(SLOW_BODY_S)
            await send({"type": "http.response.body", "body": body[len(body) // 2:]})
            return
        status = 503 if path.startswith("/flaky/") else 404
        payload = b'{"error": "no such file here"}'
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    def __enter__(self) -> FileServer:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()


def body_of(name: str) -> bytes:
    return (f"contents of {name}\n" * 1000).encode()


@pytest.fixture
def server() -> Iterator[FileServer]:
    with FileServer() as running:
        yield running


@pytest.fixture
def cache_dir(tmp: Path) -> Path:
    path = tmp / "cache"
    path.mkdir()
    return path


def cache(root: Path, *, offline: bool = False) -> DownloadCache:
    return DownloadCache(root, offline=offline, timeout_s=30.0)


# --------------------------------------------------------------------------- the cache


def _fetch_twice(root: str, url: str, start: Any, results: Any) -> None:
    """In a child process: wait for the other child, then fetch ``url`` twice at once."""

    async def both() -> list[str]:
        store = cache(Path(root))
        paths = await asyncio.gather(store.fetch(url, "data.bin"), store.fetch(url, "data.bin"))
        return [str(p) for p in paths]

    try:
        start.wait(timeout=60)
        results.put(("ok", asyncio.run(both())))
    except Exception as exc:  # told to the parent, which would otherwise wait for a result
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def test_two_processes_fetching_a_url_twice_each_download_it_once(
        server: FileServer, cache_dir: Path) -> None:
    url = f"{server.url}/files/data.bin"
    context = multiprocessing.get_context("spawn")  # fork in a threaded process is unsafe
    start, results = context.Barrier(2), context.Queue()
    children = [context.Process(target=_fetch_twice, args=(str(cache_dir), url, start, results))
                for _ in range(2)]
    for child in children:
        child.start()
    try:
        outcomes = [results.get(timeout=120) for _ in children]
    finally:
        for child in children:
            child.join(timeout=60)
    assert [kind for kind, _ in outcomes] == ["ok", "ok"], outcomes
    paths = [path for _, fetched in outcomes for path in fetched]
    assert server.hits[url.removeprefix(server.url)] == 1
    expected = cache(cache_dir).store_path(url, "data.bin")
    key = hashlib.sha256(url.encode()).hexdigest()[:32]
    assert expected == cache_dir / "by-url" / key / "data.bin"
    assert paths == [str(expected.resolve())] * 4
    assert expected.read_bytes() == body_of("data.bin")
    assert not list(expected.parent.glob(".*")), "a temporary file was left behind"


async def test_a_fetched_file_is_not_fetched_again(server: FileServer, cache_dir: Path) -> None:
    url = f"{server.url}/files/once.txt"
    first = await cache(cache_dir).fetch(url, "once.txt")
    again = await cache(cache_dir, offline=True).fetch(url, "once.txt")
    assert first == again
    assert server.hits["/files/once.txt"] == 1


async def test_offline_a_miss_names_the_url_and_every_path_looked_at(
        server: FileServer, cache_dir: Path) -> None:
    url = f"{server.url}/files/report.xlsx?download=true"
    store = cache(cache_dir, offline=True)
    with pytest.raises(TaskSetupError) as caught:
        await store.fetch(url, "report.xlsx", "task-1")
    message = str(caught.value)
    assert url in message and "desktops.offline is set" in message
    looked = store.candidates(url, "report.xlsx", "task-1")
    assert cache_dir / "task-1" / "report.xlsx" in looked
    assert cache_dir / f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_report.xlsx" in looked
    for path in looked:
        assert str(path) in message
    assert sum(server.hits.values()) == 0
    assert store.lookup(url, "report.xlsx", "task-1") is None


async def test_an_http_error_names_its_status_and_leaves_nothing(
        server: FileServer, cache_dir: Path) -> None:
    url = f"{server.url}/missing"
    with pytest.raises(TaskSetupError, match="HTTP 404") as caught:
        await cache(cache_dir).fetch(url, "missing.txt")
    assert url in str(caught.value) and "no such file here" in str(caught.value)
    assert server.hits["/missing"] == 1, "a 404 is not tried again"
    store = cache(cache_dir).store_path(url, "missing.txt")
    assert not store.exists() and not list(store.parent.iterdir())


async def test_a_server_error_is_tried_again(server: FileServer, cache_dir: Path) -> None:
    url = f"{server.url}/flaky/f.txt"
    path = await cache(cache_dir).fetch(url, "f.txt")
    assert path.read_bytes() == body_of("f.txt")
    assert server.hits["/flaky/f.txt"] == 2


async def test_an_unreachable_server_names_the_url(cache_dir: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/gone.txt"  # bound, not listening
        store = DownloadCache(cache_dir, offline=False, timeout_s=5.0)
        with pytest.raises(TaskSetupError, match="ConnectError") as caught:
            await store.fetch(url, "gone.txt")
    assert url in str(caught.value)


@pytest.mark.parametrize("layout", ["uuid5", "task", "flat", "url-name"])
async def test_osworlds_cache_names_are_read(server: FileServer, cache_dir: Path,
                                             layout: str) -> None:
    url = f"{server.url}/files/source.docx?dl=1"
    name = "Report.docx"
    placed = {
        "uuid5": cache_dir / f"{uuid.uuid5(uuid.NAMESPACE_URL, url)}_{name}",
        "task": cache_dir / "t-7" / name,
        "flat": cache_dir / name,
        "url-name": cache_dir / "source.docx",
    }[layout]
    placed.parent.mkdir(parents=True, exist_ok=True)
    placed.write_bytes(b"from OSWorld's cache")
    store = cache(cache_dir, offline=True)
    assert store.lookup(url, name, "t-7") == placed.resolve()
    assert await store.fetch(url, name, "t-7") == placed.resolve()
    assert sum(server.hits.values()) == 0


async def test_a_cached_name_linked_out_of_the_cache_is_refused(
        server: FileServer, cache_dir: Path) -> None:
    secret = cache_dir.parent / "secret.txt"
    secret.write_text("sk-secret\n")
    (cache_dir / "notes.txt").symlink_to(secret)
    url = f"{server.url}/files/notes.txt"
    for offline in (True, False):
        with pytest.raises(BadTaskStep, match="outside the directories") as caught:
            await cache(cache_dir, offline=offline).fetch(url, "notes.txt")
        assert str(cache_dir / "notes.txt") in str(caught.value)
    assert sum(server.hits.values()) == 0


async def test_a_name_that_is_no_file_name_is_refused(cache_dir: Path) -> None:
    for name in ("", "..", "/"):
        with pytest.raises(BadTaskStep, match="names no file"):
            await cache(cache_dir).fetch("http://127.0.0.1:9/x", name)


def test_the_cache_follows_the_config(tmp: Path) -> None:
    cfg = DesktopsConfig(download_cache_dir=tmp / "c", offline=True, download_timeout_s=12.0)
    store = download_cache(cfg)
    assert (store.root, store.offline, store.timeout_s) == (tmp / "c", True, 12.0)


# --------------------------------------------------------------------------- the steps


class RecordingTarget:
    """A desktop for setup steps that keeps what is uploaded to it."""

    def __init__(self, cfg: DesktopsConfig, task_id: str = "task-9") -> None:
        self.cfg = cfg
        self.task_id: str | None = task_id
        self.uploads: dict[str, bytes] = {}
        self.devtools_url = "http://127.0.0.1:9"
        self.client_password = None

    async def upload(self, path: str, data: bytes) -> None:
        self.uploads[path] = data


async def test_a_download_step_fetches_into_the_cache_and_uploads(
        server: FileServer, cache_dir: Path) -> None:
    target = RecordingTarget(DesktopsConfig(download_cache_dir=cache_dir))
    url = f"{server.url}/files/sheet.xlsx"
    step = {"type": "download",
            "parameters": {"files": [{"url": url, "path": "~/Desktop/sheet.xlsx"}]}}
    await run_setup_step(target, step)
    await run_setup_step(target, step)
    assert target.uploads == {"~/Desktop/sheet.xlsx": body_of("sheet.xlsx")}
    assert server.hits["/files/sheet.xlsx"] == 1


async def test_an_offline_download_step_names_the_step_and_the_url(cache_dir: Path) -> None:
    target = RecordingTarget(DesktopsConfig(download_cache_dir=cache_dir, offline=True))
    url = "https://example.org/data/file.csv"
    step = {"type": "download", "parameters": {"files": [{"url": url, "path": "/tmp/f.csv"}]}}
    with pytest.raises(TaskSetupError) as caught:
        await run_setup_step(target, step, 3)
    assert not isinstance(caught.value, BadTaskStep)
    message = str(caught.value)
    assert "task task-9 config[3] (download)" in message
    assert url in message and "desktops.offline is set" in message
    assert str(cache_dir / "task-9" / "f.csv") in message
    assert target.uploads == {}


@pytest.mark.parametrize("kind", ["login", "googledrive"])
async def test_sign_in_steps_are_refused_with_the_reason(tmp: Path, kind: str) -> None:
    step = {"type": kind, "parameters": {"settings_file": "settings/google/settings.json",
                                         "platform": "googledrive"}}
    without = RecordingTarget(DesktopsConfig(download_cache_dir=tmp))
    with pytest.raises(UnsupportedSetupStep, match=r"desktops\.accounts_dir.*network"):
        await run_setup_step(without, step)
    with_accounts = RecordingTarget(DesktopsConfig(download_cache_dir=tmp, accounts_dir=tmp))
    with pytest.raises(UnsupportedSetupStep, match="OSWorld's own SetupController"):
        await run_setup_step(with_accounts, step)


# --------------------------------------------------------------------------- step_problem

# One runnable step of every type (the table must cover STEP_TYPES).
VALID_STEPS: dict[str, dict[str, Any]] = {
    "launch": {"command": ["google-chrome", "--remote-debugging-port=1337"]},
    "execute": {"command": "echo hi", "shell": True, "until": {"returncode": 0}},
    "command": {"command": "mkdir -p ~/a", "shell": "true"},  # as OSWorld's tasks write it
    "open": {"path": "/home/user/a.txt"},
    "sleep": {"seconds": 0.5},
    "activate_window": {"window_name": "Chrome", "strict": False},
    "close_window": {"window_name": "Writer", "by_class": True},
    "upload_file": {"files": [{"local_path": "CACHE/shipped.txt", "path": "~/a.txt"}]},
    "download": {"files": [{"url": "https://example.org/x.pdf", "path": "~/x.pdf"}]},
    "chrome_open_tabs": {"urls_to_open": ["https://example.org"]},
    "chrome_close_tabs": {"urls_to_close": ["https://example.org"]},
    "update_browse_history": {"history": [
        {"url": "https://a.org", "title": "A", "visit_time_from_now_in_seconds": 60}]},
    "login": {"settings_file": "s.json", "platform": "googledrive"},
    "googledrive": {"settings_file": "s.yml", "operation": ["delete"], "args": [{}]},
}


@pytest.fixture
def cfg(cache_dir: Path, tmp: Path) -> DesktopsConfig:
    (cache_dir / "shipped.txt").write_text("shipped\n")
    return DesktopsConfig(download_cache_dir=cache_dir, accounts_dir=tmp / "settings")


def with_cache(params: dict[str, Any], cache_dir: Path) -> dict[str, Any]:
    if "files" in params and "local_path" in params["files"][0]:
        return {"files": [{**f, "local_path": f["local_path"].replace("CACHE", str(cache_dir))}
                          for f in params["files"]]}
    return params


def test_every_step_type_has_a_runnable_example_that_passes(cfg: DesktopsConfig,
                                                            cache_dir: Path) -> None:
    assert set(VALID_STEPS) == set(STEP_TYPES)
    for kind, params in VALID_STEPS.items():
        step = {"type": kind, "parameters": with_cache(params, cache_dir)}
        assert step_problem(step, cfg) is None, kind


def test_the_parameter_table_matches_the_handlers() -> None:
    for kind, spec in STEP_PARAMETERS.items():
        accepted = list(inspect.signature(STEP_TYPES[kind]).parameters)[1:]
        assert set(accepted) == set(spec), kind
        required = {name for name in accepted
                    if inspect.signature(STEP_TYPES[kind]).parameters[name].default
                    is inspect.Parameter.empty}
        assert required == {name for name, p in spec.items() if p.required}, kind
    assert set(STEP_TYPES) - set(STEP_PARAMETERS) == {"login", "googledrive"}


@pytest.mark.parametrize(("step", "expected"), [
    ("not a step", "must be a mapping"),
    ({"parameters": {}}, "needs a 'type'"),
    ({"type": "execute", "parameters": ["ls"]}, "'parameters' must be a mapping"),
    ({"type": "tidy_desktop", "parameters": {}}, "'tidy_desktop' is not supported"),
    ({"type": "launch", "parameters": {}}, "missing 'command'"),
    ({"type": "launch", "parameters": {"command": []}}, "'command' must be a command"),
    ({"type": "execute", "parameters": {"command": "ls", "shell": "always"}},
     "'shell' must be true or false"),
    ({"type": "sleep", "parameters": {"seconds": "2"}}, "'seconds' must be a number"),
    ({"type": "open", "parameters": {"path": "/a", "mode": "r"}}, "unknown parameter 'mode'"),
    ({"type": "download", "parameters": {"files": [{"url": "https://a/b"}]}},
     "'files' must be a list of {url, path}"),
    ({"type": "chrome_open_tabs", "parameters": {"urls_to_open": "https://a.org"}},
     "'urls_to_open' must be a list of URLs"),
    ({"type": "update_browse_history", "parameters": {"history": [{"url": "u", "title": "t"}]}},
     "'history' must be a list of {url, title, visit_time_from_now_in_seconds}"),
    ({"type": "execute", "parameters": {"command": "echo {CLIENT_PASSWORD} | sudo -S true"}},
     "desktops.client_password_env is not set"),
])
def test_a_step_that_cannot_run_is_told(cfg: DesktopsConfig, step: Any, expected: str) -> None:
    problem = step_problem(step, cfg)
    assert problem is not None and expected in problem, problem


@pytest.mark.parametrize("kind", ["login", "googledrive"])
def test_sign_in_steps_need_the_accounts_dir(cache_dir: Path, kind: str) -> None:
    step = {"type": kind, "parameters": VALID_STEPS[kind]}
    problem = step_problem(step, DesktopsConfig(download_cache_dir=cache_dir))
    assert problem is not None
    assert "desktops.accounts_dir" in problem and "network" in problem
    with_accounts = DesktopsConfig(download_cache_dir=cache_dir, accounts_dir=cache_dir)
    assert step_problem(step, with_accounts) is None


def test_offline_a_download_must_be_cached(cache_dir: Path) -> None:
    url = "https://example.org/files/budget.xlsx"
    step = {"type": "download", "parameters": {"files": [{"url": url, "path": "~/b.xlsx"}]}}
    offline = DesktopsConfig(download_cache_dir=cache_dir, offline=True)
    problem = step_problem(step, offline, task_id="t1")
    assert problem is not None and url in problem and "desktops.offline is set" in problem
    assert str(cache_dir / "t1" / "b.xlsx") in problem
    assert step_problem(step, DesktopsConfig(download_cache_dir=cache_dir)) is None
    (cache_dir / "t1").mkdir()
    (cache_dir / "t1" / "b.xlsx").write_bytes(b"xlsx")
    assert step_problem(step, offline, task_id="t1") is None
    assert step_problem(step, offline, task_id="t2") is not None


def test_offline_the_history_template_must_be_cached(cache_dir: Path) -> None:
    step = {"type": "update_browse_history", "parameters": VALID_STEPS["update_browse_history"]}
    offline = DesktopsConfig(download_cache_dir=cache_dir, offline=True)
    problem = step_problem(step, offline)
    assert problem is not None and HISTORY_TEMPLATE_URL in problem
    (cache_dir / HISTORY_TEMPLATE_NAME).write_bytes(b"sqlite")  # OSWorld's cache name
    assert step_problem(step, offline) is None


def test_a_cached_download_linked_out_of_the_cache_is_a_problem(cache_dir: Path) -> None:
    (cache_dir.parent / "secret").write_text("x")
    (cache_dir / "k.txt").symlink_to(cache_dir.parent / "secret")
    step = {"type": "download",
            "parameters": {"files": [{"url": "https://e.org/k.txt", "path": "~/k.txt"}]}}
    problem = step_problem(step, DesktopsConfig(download_cache_dir=cache_dir, offline=True))
    assert problem is not None and "outside the directories" in problem


def test_an_upload_outside_the_roots_or_missing_is_a_problem(cfg: DesktopsConfig,
                                                             cache_dir: Path) -> None:
    def upload(local: str) -> dict[str, Any]:
        return {"type": "upload_file",
                "parameters": {"files": [{"local_path": local, "path": "~/f"}]}}

    outside = step_problem(upload("/etc/passwd"), cfg)
    assert outside is not None and "outside the directories" in outside
    missing = step_problem(upload(str(cache_dir / "absent.txt")), cfg)
    assert missing is not None and "absent.txt" in missing and "not a file" in missing
    assert step_problem(upload(str(cache_dir / "shipped.txt")), cfg) is None


# --------------------------------------------------------------------------- chrome pieces


@pytest.mark.parametrize(("a", "b", "same"), [
    ("https://www.airbnb.com/", "https://airbnb.com.sg", True),
    ("https://www.bbc.co.uk/news", "https://bbc.com/news", True),
    ("airbnb.com", "http://www.airbnb.com/", True),
    ("http://127.0.0.1:8000/a.html", "http://127.0.0.1:9000/a.html", True),
    ("https://maps.google.com/", "https://google.com/", False),
    ("https://a.org/x", "https://a.org/y", False),
    ("https://a.org/x?q=1", "https://a.org/x?q=2", False),
    ("http://a.org/", "https://a.org/", False),
    (None, None, True),
    (None, "https://a.org", False),
])
def test_tabs_match_urls_as_osworld_compares_them(a: str | None, b: str | None,
                                                   same: bool) -> None:
    assert same_page_url(a, b) is same
    assert same_page_url(b, a) is same


def test_chrome_time_counts_microseconds_from_1601_utc() -> None:
    moment = datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)
    expected = (moment - datetime(1601, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
    assert chrome_time(moment.timestamp()) == expected


async def test_a_browser_that_never_answers_is_named() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening: refused
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        async with DevTools(url, timeout_s=2.0) as devtools:
            with pytest.raises(TaskSetupError, match="no browser answered") as caught:
                await devtools.wait_until_up(1.0)
    assert url in str(caught.value) and "desktops.chromium_port" in str(caught.value)


def test_a_remote_desktops_devtools_endpoint_is_on_its_host() -> None:
    cfg = DesktopsConfig(chromium_port=9333)
    assert RemoteDesktopEnv("http://user:pw@10.1.2.3:5000/", cfg).devtools_url == \
        "http://10.1.2.3:9333"
    assert RemoteDesktopEnv("http://[fd00::7]:5000", cfg).devtools_url == "http://[fd00::7]:9333"


@pytest.mark.parametrize(("until", "reply", "met"), [
    ({"returncode": 0}, {"returncode": 0, "output": "", "error": ""}, True),
    ({"returncode": 0}, {"returncode": 1, "output": "", "error": ""}, False),
    # OSWorld's SetupController: any one given field that matches ends the wait.
    ({"returncode": 0, "stdout": "ready"}, {"returncode": 1, "output": "ready\n", "error": ""},
     True),
    ({"returncode": 0, "stdout": "ready"}, {"returncode": 0, "output": "", "error": ""}, True),
    ({"stderr": "done"}, {"returncode": 1, "output": "done", "error": ""}, False),
    ({"stderr": "done"}, {"returncode": 1, "output": "", "error": "all done"}, True),
])
def test_until_is_met_as_osworld_reads_it(until: dict, reply: dict, met: bool) -> None:
    from cua_rollout.envs.setup_steps import until_met
    assert until_met(reply, until) is met


@pytest.mark.parametrize("name", ["/etc/passwd", "../out.txt", "a/../../b", "a//b"])
def test_a_setup_output_name_must_stay_in_the_task_cache(cfg: DesktopsConfig, name: str
                                                         ) -> None:
    step = {"type": "execute", "parameters": {"command": ["ls"], "stdout": name}}
    assert "stdout" in (step_problem(step, cfg) or "")
