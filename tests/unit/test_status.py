"""runtime/status.py and status_probe.py: the stall rule on a fake clock, /healthz and
/status of a real server on a free port (no Ray), the token, the config's checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cua_rollout.config import load_config
from cua_rollout.core.errors import ConfigError, FatalSetupError
from cua_rollout.core.layout import STATUS_URL_FILE
from cua_rollout.runtime.status import StallWatch, StatusBoard, StatusServer, serve_status
from cua_rollout.runtime.status_probe import probe
from tests.support import get_json

STALL_S = 900.0
LOOP_LATE_S = 210.0


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def stats(*, running: int = 2, queued: int = 3, steps: int = 0, **more: Any) -> dict[str, Any]:
    return {"episodes_in_flight": running, "episodes_queued": queued, "steps": steps,
            "desktops": {"free": 1, "leased": 2, "resetting": 0, "quarantined": 0,
                         "starting": 0},
            "runners": 2, "runners_replaced": 1, "waiting": None,
            "storage_lag": {"results_waiting": 3, "oldest_s": 0.4},
            "outages": {"model": {"outages": 1, "down_s": 12.5}}, "fatal": None,
            "model_servers": {"endpoints": [{"url": "http://m:8000"}],
                              "summary": {"running": 1}}, **more}


def board(clock: Clock, stall_s: float | None = STALL_S) -> StatusBoard:
    return StatusBoard("demo", stall_s=stall_s, loop_late_s=LOOP_LATE_S, clock=clock,
                       wall=lambda: 1.7e9 + clock.t)


def publish(b: StatusBoard, *, done: int = 0, waiting: str | None = None,
            status: str = "running", **kw: Any) -> str:
    return b.publish(status=status, done=done, done_before=5, total=40, stats=stats(**kw),
                     waiting=waiting, poll_s=0.012)


# --------------------------------------------------------------------------- the stall rule

def test_no_progress_for_stall_s_is_a_stall_and_says_so() -> None:
    clock = Clock()
    b = board(clock)
    assert publish(b, steps=10) == ""
    clock.t += STALL_S - 1
    assert publish(b, steps=10) == ""
    assert b.health() == (True, "ok")
    clock.t += 1
    assert publish(b, steps=10) == "stalled: no progress for 900 s"
    assert b.health() == (False, "stalled: no progress for 900 s")
    assert b.status()["stall"] == {"stalled": True, "no_progress_s": 900.0, "stall_s": STALL_S}


@pytest.mark.parametrize("change", [{"steps": 11}, {"done": 1}])
def test_a_step_or_a_finished_episode_is_progress(change: dict[str, int]) -> None:
    clock = Clock()
    b = board(clock)
    publish(b, steps=10)
    clock.t += STALL_S - 1
    publish(b, **{"steps": 10, **change})
    assert b.status()["last_progress_t"] == 1.7e9 + clock.t
    clock.t += STALL_S - 1
    assert publish(b, **{"steps": 10, **change}) == ""
    clock.t += 1
    assert publish(b, **{"steps": 10, **change}).startswith("stalled")


def test_an_outage_wait_is_not_a_stall() -> None:
    clock = Clock()
    b = board(clock)
    publish(b, steps=10)
    for _ in range(4):  # an hour of waiting for the model to come back
        clock.t += STALL_S
        assert publish(b, steps=10, waiting="model endpoints down: waiting") == ""
        assert b.health() == (True, "ok")
    # The clock starts again when the wait ends.
    clock.t += STALL_S - 1
    assert publish(b, steps=10) == ""
    clock.t += 1
    assert publish(b, steps=10).startswith("stalled")


def test_nothing_to_run_is_not_a_stall() -> None:
    clock = Clock()
    b = board(clock)
    publish(b, running=0, queued=0)
    clock.t += 10 * STALL_S  # a service run waiting for new tasks
    assert publish(b, running=0, queued=0) == ""
    clock.t += STALL_S - 1
    assert publish(b, running=0, queued=1) == ""


def test_stall_s_null_never_stalls() -> None:
    clock = Clock()
    b = board(clock, stall_s=None)
    publish(b)
    clock.t += 100 * STALL_S
    assert publish(b) == ""
    assert b.health() == (True, "ok")


def test_stall_watch_records_no_progress_at_the_first_pass() -> None:
    watch = StallWatch(10.0, clock=Clock())
    watch.observe(done=3, steps=100, active=True, waiting=False)
    assert watch.last_progress_t is None


# --------------------------------------------------------------------------- health

def test_a_loop_that_stops_iterating_is_unhealthy() -> None:
    clock = Clock()
    b = board(clock)
    publish(b)
    clock.t += LOOP_LATE_S - 1
    assert b.health() == (True, "ok")
    clock.t += 1
    assert b.health() == (False, f"driver loop not iterating for {LOOP_LATE_S:.0f} s")


def test_a_fatal_error_is_unhealthy_with_its_reason() -> None:
    b = board(Clock())
    publish(b, status="stopping", fatal="disk full: /results")
    assert b.health() == (False, "stopping: disk full: /results")


def test_before_the_first_pass_the_board_is_starting_and_healthy() -> None:
    b = board(Clock())
    assert b.health() == (True, "ok")
    assert b.status()["status"] == "starting"


def test_an_unknown_run_state_is_refused() -> None:
    with pytest.raises(ValueError, match="'paused' is none of"):
        publish(board(Clock()), status="paused")


def test_the_snapshot_is_replaced_not_changed() -> None:
    b = board(Clock())
    publish(b)
    first = b._snapshot
    publish(b, done=1)
    assert first["episodes"]["done_this_start"] == 0  # a reader's snapshot stays whole
    with pytest.raises(TypeError):
        first["status"] = "x"  # type: ignore[index]


# --------------------------------------------------------------------------- the server

@pytest.fixture
def served() -> Any:
    clock = Clock()
    b = board(clock)
    with StatusServer(b, "s3cret", "127.0.0.1", 0) as server:
        yield clock, b, server.url


def test_healthz_answers_ok_then_each_reason_with_503(served: Any) -> None:
    clock, b, url = served
    publish(b, steps=1)
    assert get_json(url + "/healthz") == (200, {"ok": True})
    clock.t += STALL_S
    publish(b, steps=1)
    assert get_json(url + "/healthz") == (503, {"ok": False,
                                           "reason": "stalled: no progress for 900 s"})
    clock.t += LOOP_LATE_S
    assert get_json(url + "/healthz") == (
        503, {"ok": False, "reason": f"driver loop not iterating for {LOOP_LATE_S:.0f} s"})
    publish(b, status="stopping", fatal="the results disk is full")
    assert get_json(url + "/healthz") == (503, {"ok": False,
                                           "reason": "stopping: the results disk is full"})


def test_status_needs_the_token(served: Any) -> None:
    _, b, url = served
    publish(b)
    code, body = get_json(url + "/status")
    assert code == 401 and "monitoring.status_token_env" in body["error"]
    assert get_json(url + "/status", token="wrong")[0] == 401
    assert get_json(url + "/status", token="s3cret")[0] == 200


def test_status_says_what_the_run_does(served: Any) -> None:
    clock, b, url = served
    publish(b, steps=7)
    clock.t += 3
    publish(b, done=2, steps=9, status="draining", waiting=None)
    code, body = get_json(url + "/status", token="s3cret")
    assert code == 200
    assert body["run"] == "demo" and body["status"] == "draining"
    assert body["episodes"] == {"done": 7, "done_this_start": 2, "done_before": 5,
                                "running": 2, "queued": 3, "total_known": 40}
    assert body["steps"] == 9
    assert body["last_progress_t"] == 1.7e9 + clock.t
    assert body["stall"] == {"stalled": False, "no_progress_s": 0.0, "stall_s": STALL_S}
    assert body["outages"] == {"model": {"outages": 1, "down_s": 12.5}}
    assert body["waiting"] is None and body["fatal"] is None
    assert body["desktops"]["leased"] == 2
    assert body["model_servers"]["endpoints"] == [{"url": "http://m:8000"}]
    assert body["runners"] == {"alive": 2, "replaced": 1}
    assert body["storage_lag"] == {"results_waiting": 3, "oldest_s": 0.4}
    assert body["poll_s"] == 0.012
    assert body["healthy"] == {"ok": True, "reason": None}
    assert not any(k.startswith("_") for k in body)


def test_status_without_a_token_configured_is_open() -> None:
    b = board(Clock())
    publish(b)
    with StatusServer(b, None, "127.0.0.1", 0) as server:
        assert get_json(server.url + "/status")[0] == 200


def test_serve_status_writes_its_url_and_a_taken_port_is_a_clear_error(
        tmp_path: Path) -> None:
    b = board(Clock())
    server = serve_status(b, "127.0.0.1", None, tmp_path)
    try:
        url = (tmp_path / STATUS_URL_FILE).read_text().strip()
        assert url == server.url and get_json(url + "/healthz")[0] == 200
        with pytest.raises(FatalSetupError, match=r"monitoring.status_address.*cannot listen"):
            serve_status(b, f"127.0.0.1:{server.port}", None, tmp_path)
    finally:
        server.stop()


def test_the_probe_passes_ok_and_no_listener_and_fails_503(served: Any) -> None:
    clock, b, url = served
    publish(b)
    assert probe(url)[0] is True
    clock.t += LOOP_LATE_S
    ok, why = probe(url)
    assert not ok and "driver loop not iterating" in why
    # Nothing listens: the head pod before or after its job's driver.
    assert probe("http://127.0.0.1:1") == (True, "no driver is serving here")


# --------------------------------------------------------------------------- config

def test_status_is_on_by_default_on_loopback() -> None:
    m = load_config(None).monitoring
    assert m.status_address == "127.0.0.1" and m.status_token_env is None
    assert m.stall_s == 900.0


@pytest.mark.parametrize("address", ["0.0.0.0:8270", "10.1.2.3:8270", "[::]:8270",
                                     "cua-head:8270"])
def test_status_off_loopback_needs_a_token(address: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, [f"monitoring.status_address={address}"])
    assert "monitoring.status_address" in str(exc.value)
    assert "monitoring.status_token_env" in str(exc.value)
    cfg = load_config(None, [f"monitoring.status_address={address}",
                             "monitoring.status_token_env=CUA_STATUS_TOKEN"])
    assert cfg.monitoring.status_token_env == "CUA_STATUS_TOKEN"


@pytest.mark.parametrize(("address", "what"), [("127.0.0.1:http", "no valid port"),
                                               ("10.0.0.0/8", "is a network"),
                                               ("-x:80", "not a host")])
def test_a_malformed_status_address_names_the_key(address: str, what: str) -> None:
    with pytest.raises(ConfigError, match=rf"monitoring.status_address.*{what}"):
        load_config(None, [f"monitoring.status_address={address}"])
