"""The OSWorld evaluator worker as the runner uses it: started once and kept warm, a
crash or a stuck evaluation replaced by a new worker, every failure named; the catalog cached
on disk; the pre-flight check on a task set with the real OSWorld environment behind it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from cua_rollout.config import load_config
from cua_rollout.core.errors import ConfigError, EvaluationError, UnsupportedEvaluator
from cua_rollout.envs.contract import DesktopAddress
from cua_rollout.evaluation.osworld_bridge import OSWorldBridge, catalog_of, default_python
from cua_rollout.evaluation.preflight import TaskChecker
from tests.support import REPO_ROOT, unavailable

pytestmark = pytest.mark.integration


@pytest.fixture
def bridge():
    if not default_python().exists():
        unavailable("OSWorld's evaluator environment (.venv-osworld) is not set up")
    bridge = OSWorldBridge(default_python(), start_timeout_s=120)
    yield bridge
    # Each test closes it on its own loop; one that failed first may leave a worker.
    proc = bridge._proc
    if proc is not None and proc.returncode is None:
        os.killpg(proc.pid, signal.SIGKILL)


def test_one_warm_worker_serves_many_calls_and_a_dead_one_is_replaced(bridge):
    async def main() -> None:
        catalog = await bridge.catalog()
        assert {"compare_table", "compare_pptx_files", "check_direct_json_object"} <= set(
            catalog.metrics)
        assert {"vm_file", "cloud_file", "active_tab_info"} <= set(catalog.getters)
        assert "easyocr" in catalog.unavailable["metric:compare_image_text"]
        started = time.monotonic()
        for n in range(20):
            value = await bridge.call({"op": "metric", "name": "exact_match",
                                       "args": [n, {"expected": n}]}, 30)
            assert value == 1.0
        per_call = (time.monotonic() - started) / 20
        assert bridge.started == 1
        print(f"\nworker: {per_call * 1000:.1f} ms per metric call, warm")
        # OSWorld's function raising: an EvaluationError with its message; the worker lives.
        with pytest.raises(EvaluationError, match="TypeError"):
            await bridge.call({"op": "metric", "name": "is_in_list",
                               "args": [None, {"expected": 1}]}, 30)
        with pytest.raises(UnsupportedEvaluator, match="easyocr"):
            await bridge.call({"op": "metric", "name": "compare_image_text",
                               "args": ["a", "b"]}, 30)
        with pytest.raises(UnsupportedEvaluator, match="no metric 'nope'"):
            await bridge.call({"op": "metric", "name": "nope", "args": []}, 30)
        assert bridge.started == 1
        # Killed from outside: the next call says so, the one after runs on a new worker.
        assert bridge._proc is not None
        os.kill(bridge._proc.pid, signal.SIGKILL)
        with pytest.raises(EvaluationError, match="exited"):
            await bridge.call({"op": "ping"}, 30)
        assert await bridge.call({"op": "metric", "name": "exact_match",
                                  "args": [1, {"expected": 2}]}, 30) == 0.0
        assert bridge.started == 2
        pid = bridge._proc.pid
        await bridge.close()  # EOF on its stdin: it ends by itself
        assert bridge._proc is None and not psutil.pid_exists(pid)

    asyncio.run(main())


def test_a_stuck_evaluation_is_killed_with_its_process_group(bridge, tmp_path):
    async def main() -> None:
        await bridge.catalog()
        assert bridge._proc is not None
        pid = bridge._proc.pid
        # OSWorld's getter waits on a desktop that accepts and never answers.
        held: list[asyncio.StreamWriter] = []
        server = await asyncio.start_server(lambda r, w: held.append(w), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            with pytest.raises(TimeoutError):
                await bridge.evaluate(
                    {"func": "exact_match", "result": {"type": "vm_terminal_output"},
                     "expected": {"type": "rule", "rules": {"expected": ""}}},
                    DesktopAddress(f"http://127.0.0.1:{port}", "t"), tmp_path, timeout_s=3)
        finally:
            for writer in held:
                writer.close()
            server.close()
            await server.wait_closed()
        assert bridge._proc is None
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        assert await bridge.call({"op": "ping"}, 60) is None  # a new worker answers
        assert bridge.started == 2
        await bridge.close()

    asyncio.run(main())


def test_a_configured_interpreter_that_is_missing_is_a_config_error(tmp_path):
    cfg = load_config(None, [f"evaluation.osworld_python={tmp_path / 'nope' / 'python'}"])
    with pytest.raises(ConfigError, match=r"evaluation\.osworld_python"):
        OSWorldBridge.from_config(cfg.evaluation)


def test_the_catalog_is_cached_on_disk(bridge, tmp_path):
    started = time.monotonic()
    first = catalog_of(bridge, tmp_path)
    cold = time.monotonic() - started
    started = time.monotonic()
    again = catalog_of(OSWorldBridge(default_python()), tmp_path)
    warm = time.monotonic() - started
    assert first == again and len(list(tmp_path.glob("osworld-catalog-*.json"))) == 1
    assert warm < cold
    print(f"\ncatalog: {cold:.1f} s from a worker, {warm * 1000:.1f} ms from the cache")


def test_preflight_refuses_exactly_what_cannot_run(tmp_path):
    if not default_python().exists():
        unavailable("OSWorld's evaluator environment (.venv-osworld) is not set up")
    examples = tmp_path / "examples" / "calc"
    examples.mkdir(parents=True)

    def task(tid: str, evaluator: dict, config: list | None = None) -> str:
        body = {"id": tid, "instruction": "do it", "evaluator": evaluator}
        if config is not None:
            body["config"] = config
        (examples / f"{tid}.json").write_text(json.dumps(body))
        return tid

    ids = [
        task("native", {"func": "exact_match", "result": {"type": "rule", "rules": 1},
                        "expected": {"type": "rule", "rules": {"expected": 1}}}),
        task("bridged", {"func": "compare_table",
                         "result": {"type": "vm_file", "path": "/a.xlsx", "dest": "a.xlsx"},
                         "expected": {"type": "cloud_file", "path": "http://x/b.xlsx",
                                      "dest": "b.xlsx"}}),
        task("ocr", {"func": "compare_image_text", "result": {"type": "rule", "rules": 1}}),
        task("unknown", {"func": "compare_nothing", "result": {"type": "rule", "rules": 1}}),
        task("google", {"func": "infeasible"}, [{"type": "googledrive", "parameters": {}}]),
    ]
    (tmp_path / "test_all.json").write_text(json.dumps({"calc": ids}))
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "check_tasks.py"),
         str(tmp_path / "test_all.json"), "--json"],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    runnable = {t["id"]: t["runnable"] for t in report["tasks"]}
    assert runnable == {"native": True, "bridged": True, "ocr": False, "unknown": False,
                        "google": False}
    assert report["missing"] == {"metric:compare_image_text": 1, "metric:compare_nothing": 1,
                                 "setup:googledrive": 1}
    # With engine: native, the bridged task is refused too, with that reason.
    native = TaskChecker(load_config(None, ["evaluation.engine=native"]))
    problems = native(json.loads((examples / "bridged.json").read_text()))
    assert [p.key for p in problems] == ["metric:compare_table"]  # cloud_file is native
    assert "evaluation.engine is 'native'" in problems[0].message
