"""How an error ends an episode, and the shape of results (the agent's decisions on a reply:
tests/unit/test_uitars_agent.py); the episode loop itself is
exercised in tests/component/test_episode_loop.py (fakes) and on real Ray and real desktops
in the integration tests."""

from __future__ import annotations

from cua_rollout.core.errors import (
    ConfigError,
    DesktopError,
    DesktopUnavailable,
    ModelRequestError,
    ModelUnavailable,
    StorageError,
    TaskSetupError,
    UnsupportedEvaluator,
    UnsupportedSetupStep,
)
from cua_rollout.core.types import STATUSES, EpisodeSpec, infra_result
from cua_rollout.runtime.episode import episode_error
from tests.support import REPO_ROOT

ROOT = REPO_ROOT
TASK = {"id": "t1", "instruction": "do it", "evaluator": {"func": "infeasible"}}


def test_how_each_error_ends_an_episode_is_the_errors_class():
    # (error, retryable, desktop healthy, outage, fatal)
    cases = {
        DesktopError("x/execute: cannot connect"): (True, False, None, False),
        DesktopUnavailable("no desktop"): (True, True, "desktop", False),
        TaskSetupError("launch failed"): (True, True, None, False),
        UnsupportedSetupStep("googledrive"): (False, True, None, False),
        UnsupportedEvaluator("compare_pdf"): (False, True, None, False),
        ModelUnavailable("500 after retries"): (True, True, None, False),
        ModelUnavailable("no endpoint", outage=True): (True, True, "model", False),
        ModelRequestError(400, "too long"): (False, True, None, False),
        ModelRequestError(401, "bad key"): (False, True, None, True),
        ModelRequestError(404, "no such model"): (False, True, None, True),
        ConfigError("model.api_key_env names $K, which is not set"): (False, True, None, True),
        StorageError("results.jsonl: No space left"): (False, True, None, True),
        KeyError("a bug of ours"): (False, True, None, False),
    }
    for exc, expected in cases.items():
        ended = episode_error(exc, "d0")
        assert (ended.retryable, ended.healthy, ended.outage, ended.fatal) == expected, exc
        assert str(exc).strip("'") in ended.text
    assert episode_error(DesktopError("boom"), None)[0] == "desktop (none leased): boom"
    assert episode_error(UnsupportedEvaluator("m"), "d0")[0] == "evaluator: m"


def test_an_infra_result_is_never_a_score():
    spec = EpisodeSpec("t1", "d", 2, TASK, attempt=1)
    result = infra_result(spec, "runner died", runner="r")
    record = result.record()
    assert record["status"] == "infra_error" and record["reward"] is None
    assert record["episode_id"] == "d/t1/2" and record["attempt"] == 1
    assert record["infeasible"] is True and "retryable" not in record
    assert set(STATUSES) == {"success", "failure", "max_steps", "timeout", "infra_error",
                             "cancelled"}
