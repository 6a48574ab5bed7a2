"""The worked example (docs/examples/gym_vlm_loop.py): a tiny random Qwen2.5-VL served by a
real run_model.py pool on vLLM's CPU build (the session's) drives CuaDesktopEnv on the real
desktop service.
The model's replies are random: the test checks the loop runs end to end, every step an
executed action, a terminal one or a recorded parse error, and the reward the evaluation's."""

from __future__ import annotations

import importlib.util

import pytest

from tests.integration.test_gym_env import SCREEN, TOKEN_ENV, Service, own_leases, task
from tests.integration.test_gym_env import service as service  # the fixture
from tests.support import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLE = REPO_ROOT / "docs" / "examples" / "gym_vlm_loop.py"
MAX_STEPS = 4


def _example():
    spec = importlib.util.spec_from_file_location("gym_vlm_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def model(tiny_vlm) -> tuple[str, str]:
    """The session's tiny-VLM pool (tests/integration/conftest.py): its URL and model name."""
    return tiny_vlm.url, tiny_vlm.cfg.model.name


@pytest.mark.parametrize("constrain", [True, False], ids=["grammar", "free"])
def test_the_example_loop_runs_a_tiny_vlm_on_the_gym_env(service: Service, model, constrain):
    model_url, model_name = model
    example = _example()
    env = example.CuaDesktopEnv(service.url, token_env=TOKEN_ENV, action_kind="uitars",
                                screen=SCREEN, max_steps=MAX_STEPS)
    try:
        result = example.run_episode(env, task("terminal", "terminal-hello-file"),
                                     model_url=model_url, model=model_name,
                                     constrain=constrain)
    finally:
        env.close()
    steps = result["steps"]
    assert 1 <= len(steps) <= MAX_STEPS
    assert result["terminated"] or (result["truncated"] and len(steps) == MAX_STEPS)
    for step in steps[:-1]:
        assert step["terminal"] not in ("DONE", "FAIL"), step
    for step in steps:
        # Each step is an action that ran, a terminal one, or a parse error recorded.
        ran = step["executed"] is not None and step["returncode"] is not None
        assert ran or step["terminal"] in ("DONE", "FAIL", "WAIT") \
            or step["parse_error"], step
        if constrain:  # the grammar holds every reply to an action the parser takes
            assert step["parse_error"] is None, step
    # The episode was scored by the task's evaluator (a random policy does not write the
    # file: 0.0), and the lease went back with it.
    assert result["evaluated"] is True and result["evaluation_error"] is None
    assert result["reward"] == 0.0
    assert own_leases(service) == []
