"""Our native metrics and getters against OSWorld's own (desktop-env, run by the evaluator
worker under .venv-osworld): the same inputs give the same value, or both raise. Metrics on
generated inputs (hypothesis), getters on a real local desktop (Xvfb, our desktop server with
a bearer token, reached by OSWorld's PythonController through the worker); and whole
evaluations routed through OSWorld's code end to end."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import EvaluatorRaised, UnsupportedEvaluator
from cua_rollout.core.http import ThreadedServer
from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.contract import DesktopAddress
from cua_rollout.envs.providers.local import LocalProvider
from cua_rollout.evaluation import Evaluator, route_problem
from cua_rollout.evaluation.getters import GETTERS, EvalContext
from cua_rollout.evaluation.metrics import METRICS
from cua_rollout.evaluation.osworld_bridge import OSWorldBridge, default_python
from tests.support import unavailable

pytestmark = pytest.mark.integration

TOKEN_ENV = "CUA_PARITY_TOKEN"


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def bridge(loop: asyncio.AbstractEventLoop) -> Iterator[OSWorldBridge]:
    if not default_python().exists():
        unavailable("OSWorld's evaluator environment (.venv-osworld) is not set up")
    bridge = OSWorldBridge(default_python())
    catalog = loop.run_until_complete(bridge.catalog())
    assert len(catalog.metrics) > 100 and len(catalog.getters) > 40, catalog
    yield bridge
    loop.run_until_complete(bridge.close())
    assert bridge._proc is None


def _both(loop: asyncio.AbstractEventLoop, bridge: OSWorldBridge, name: str,
          args: list[Any], options: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """(ours, OSWorld's): each a float, or the string "raised" when the metric itself raised
    on these inputs. Only the metric's own error counts as "raised" on OSWorld's side: a worker
    that died, timed out or refused the request raises here, failing the test with its
    message (two failures for different reasons are no parity)."""
    try:
        ours: Any = float(METRICS[name](*args, **(options or {})))
    except Exception:  # our metric runs in this process: any error is the metric's own
        ours = "raised"
    try:
        theirs: Any = loop.run_until_complete(bridge.call(
            {"op": "metric", "name": name, "args": args, "options": options or {}}, 60))
    except EvaluatorRaised:
        return ours, "raised"
    try:
        return ours, float(theirs)
    except (TypeError, ValueError):  # OSWorld's metric returned what is not a score
        return ours, "raised"


TEXT = st.text(alphabet=st.sampled_from("ab c\t\nAB'\"{}:1"), max_size=12)
VALUES = st.one_of(st.none(), TEXT, st.lists(TEXT, max_size=3), st.integers(-2, 2))
FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(result=VALUES, expected=VALUES)
def test_exact_match_and_is_in_list(loop, bridge, result, expected):
    for name in ("exact_match", "is_in_list"):
        ours, theirs = _both(loop, bridge, name, [result, {"expected": expected}])
        assert ours == theirs, (name, result, expected)


@FAST
@given(result=VALUES, include=st.lists(TEXT, max_size=3), exclude=st.lists(TEXT, max_size=3))
def test_check_include_exclude(loop, bridge, result, include, exclude):
    rules = {"include": include, "exclude": exclude}
    ours, theirs = _both(loop, bridge, "check_include_exclude", [result, rules])
    assert ours == theirs, (result, rules)


@FAST
@given(a=TEXT, b=TEXT, blanks=st.booleans(), case=st.booleans(), missing=st.booleans())
def test_compare_text_file(loop, bridge, tmp_path, a, b, blanks, case, missing):
    left, right = tmp_path / "a.txt", tmp_path / "b.txt"
    left.write_text(a)
    right.write_text(b)
    args = [None if missing else str(left), str(right)]
    ours, theirs = _both(loop, bridge, "compare_text_file", args,
                         {"ignore_blanks": blanks, "ignore_case": case})
    assert ours == theirs, (a, b, blanks, case)


@FAST
@given(lines=st.lists(st.sampled_from(["alpha", "beta 2", "gamma", "", "x=1"]), max_size=5),
       expect=st.lists(st.sampled_from(["^alpha$", "beta", r"\d", "zeta"]), max_size=2),
       unexpect=st.lists(st.sampled_from(["gamma", "^$", "omega"]), max_size=2))
def test_check_list(loop, bridge, tmp_path, lines, expect, unexpect):
    path = tmp_path / "list.txt"
    path.write_text("\n".join(lines))
    rules = {"expect": expect, "unexpect": unexpect}
    ours, theirs = _both(loop, bridge, "check_list", [str(path), rules])
    assert ours == theirs, (lines, rules)


def test_every_native_metric_is_parity_tested_here():
    tested = {"exact_match", "is_in_list", "check_include_exclude", "compare_text_file",
              "check_list", "infeasible"}
    assert set(METRICS) == tested


# ------------------------------------------------------------------ getters, on a desktop


@pytest.fixture(scope="module")
def desktop(loop: asyncio.AbstractEventLoop) -> Iterator[tuple[RemoteDesktopEnv, DesktopAddress]]:
    if shutil.which("Xvfb") is None:
        unavailable("Xvfb is not installed")
    state = Path(tempfile.mkdtemp(prefix="parity-"))
    os.environ[TOKEN_ENV] = "parity-secret-token"
    cfg = DesktopsConfig(count=1, warm_spares=0, screen_width=1024, screen_height=768,
                         token_env=TOKEN_ENV, download_cache_dir=state / "cache",
                         local={"state_dir": state / "desktops", "start_timeout_s": 60})
    provider = LocalProvider(cfg)
    started = loop.run_until_complete(provider.start(0))
    env = RemoteDesktopEnv(started.url, cfg)
    try:
        yield env, DesktopAddress(started.url, "parity-secret-token")
    finally:
        loop.run_until_complete(env.close())
        loop.run_until_complete(provider.stop(started))
        os.environ.pop(TOKEN_ENV, None)
        shutil.rmtree(state, ignore_errors=True)


def _native(loop, env, getter: str, cfg: dict[str, Any], scratch: Path) -> Any:
    ctx = EvalContext(env, scratch, "t1", scratch)
    return loop.run_until_complete(GETTERS[getter](ctx, cfg))


def _osworld(loop, bridge, address, cfg: dict[str, Any], scratch: Path) -> Any:
    return loop.run_until_complete(bridge.call(
        {"op": "getter", "config": cfg, "desktop": address.wire(), "cache_dir": str(scratch)},
        60))


def _contents(value: Any) -> Any:
    """Paths replaced by (file name, bytes): the two sides write to different directories."""
    if isinstance(value, list):
        return [_contents(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value) and os.path.isfile(value):
        return (os.path.basename(value), Path(value).read_bytes())
    return value


def test_getters_read_the_desktop_as_osworld_reads_it(loop, bridge, desktop, tmp_path):
    env, address = desktop
    home = loop.run_until_complete(env.execute(["bash", "-c", "echo -n $HOME"]))["output"]
    setup = (f"mkdir -p {home}/Desktop && printf 'a,b\\n1,2\\n' > {home}/Desktop/t.csv && "
             f"printf 'hello' > {home}/notes.txt")
    loop.run_until_complete(env.execute(["bash", "-c", setup]))
    cases = [
        {"type": "vm_file", "path": f"{home}/Desktop/t.csv", "dest": "t.csv"},
        {"type": "vm_file", "path": f"{home}/missing.txt", "dest": "m.txt"},
        {"type": "vm_file", "multi": True, "path": [f"{home}/notes.txt", f"{home}/none",
                                                    f"{home}/Desktop/t.csv"],
         "dest": ["n.txt", "x.txt", "c.csv"], "gives": [0, 1, 2]},
        {"type": "vm_file", "multi": True, "path": [f"{home}/notes.txt",
                                                    f"{home}/Desktop/t.csv"],
         "dest": ["n.txt", "c.csv"]},  # default gives [0]: one path, not a list
        {"type": "vm_command_line", "command": ["bash", "-c", "echo out; echo err >&2"]},
        {"type": "vm_command_line", "command": "printf '%s' \"$((6*7))\"", "shell": True},
        {"type": "rule", "rules": {"expected": ["a", 1]}},
    ]
    for n, cfg in enumerate(cases):
        ours_dir, theirs_dir = tmp_path / f"o{n}", tmp_path / f"t{n}"
        ours_dir.mkdir()
        theirs_dir.mkdir()
        ours = _contents(_native(loop, env, cfg["type"], cfg, ours_dir))
        theirs = _contents(_osworld(loop, bridge, address, cfg, theirs_dir))
        assert ours == theirs, (cfg, ours, theirs)
        if n == 0:
            assert ours == ("t.csv", b"a,b\n1,2\n")


def test_cloud_file_reads_the_shared_cache_as_osworld_downloads(loop, bridge, desktop,
                                                                tmp_path):
    hits: list[str] = []
    body = b"col\n1\n"

    async def app(scope, receive, send):  # a tiny ASGI file server counting its hits
        hits.append(scope["path"])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    with ThreadedServer(app) as server:
        url = f"{server.url}/files/gold.csv"
        cfg = {"type": "cloud_file", "path": url, "dest": "gold.csv"}
        from cua_rollout.envs.downloads import DownloadCache

        evaluator = Evaluator(tmp_path / "cache", "auto", None,
                              DownloadCache(tmp_path / "cache", offline=False, timeout_s=30))
        ctx = EvalContext(desktop[0], tmp_path, "t1", tmp_path / "o", evaluator)
        (tmp_path / "o").mkdir()
        (tmp_path / "t").mkdir()
        ours = _contents(loop.run_until_complete(GETTERS["cloud_file"](ctx, cfg)))
        again = tmp_path / "o2"
        again.mkdir()
        loop.run_until_complete(GETTERS["cloud_file"](
            EvalContext(desktop[0], tmp_path, "t1", again, evaluator), cfg))
        theirs = _contents(_osworld(loop, bridge, desktop[1], cfg, tmp_path / "t"))
    assert ours == theirs == ("gold.csv", body)
    assert hits.count("/files/gold.csv") == 2  # ours once (then the cache), OSWorld's once


# ------------------------------------------------------------------ whole evaluations


def _osworld_python(code: str) -> None:
    """Run ``code`` under OSWorld's interpreter (it has openpyxl; the project's may not)."""
    done = subprocess.run([str(default_python()), "-c", code], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


def test_tasks_without_a_native_route_are_scored_by_osworlds_code(loop, bridge, desktop,
                                                                   tmp_path):
    env, _ = desktop
    home = loop.run_until_complete(env.execute(["bash", "-c", "echo -n $HOME"]))["output"]
    gold, wrong = tmp_path / "gold.xlsx", tmp_path / "wrong.xlsx"
    _osworld_python(
        "import openpyxl, sys\n"
        "for path, last in ((sys.argv[1], 3), (sys.argv[2], 4)):\n"
        "    wb = openpyxl.Workbook(); ws = wb.active\n"
        "    for row in ([1, 2], [2, last]): ws.append(row)\n"
        "    wb.save(path)\n".replace("sys.argv[1]", repr(str(gold)))
        .replace("sys.argv[2]", repr(str(wrong))))
    task = {"id": "t1", "evaluator": {
        "func": ["compare_table", "check_direct_json_object"], "conj": "and",
        "result": [{"type": "vm_file", "path": f"{home}/out.xlsx", "dest": "out.xlsx"},
                   {"type": "vm_command_line", "command": ["cat", f"{home}/answer.json"]}],
        "expected": [{"type": "vm_file", "path": f"{home}/gold.xlsx", "dest": "gold.xlsx"},
                     {"type": "rule", "rules": {"expected": {"city": "Paris"}}}],
        "options": [{"rules": [{"type": "sheet_data", "sheet_idx0": 0, "sheet_idx1": "EI0"}]},
                    {}]}}
    assert route_problem(task["evaluator"], "auto", None)[0] is None  # no native route
    evaluator = Evaluator(tmp_path / "cache", "auto", bridge)
    loop.run_until_complete(env.upload(f"{home}/gold.xlsx", gold.read_bytes()))

    def score(xlsx: Path, answer: str) -> float:
        loop.run_until_complete(env.upload(f"{home}/out.xlsx", xlsx.read_bytes()))
        loop.run_until_complete(env.upload(f"{home}/answer.json", answer.encode()))
        return loop.run_until_complete(evaluator.evaluate(env, task, "DONE", task_id="t1"))

    assert score(gold, json.dumps({"city": "Paris"})) == 1.0
    assert score(wrong, json.dumps({"city": "Paris"})) == 0.0
    assert score(gold, "{'city': 'Rome'}") == 0.0
    assert loop.run_until_complete(evaluator.evaluate(env, task, "FAIL", task_id="t1")) == 0.0
    # An unknown metric is refused by name, not scored 0.
    bad = {"id": "t2", "evaluator": {**task["evaluator"], "func": ["compare_table", "nope"]}}
    with pytest.raises(UnsupportedEvaluator, match="nope"):
        loop.run_until_complete(evaluator.evaluate(env, bad, "DONE", task_id="t2"))
    assert bridge.started == 1  # the same warm worker served everything
