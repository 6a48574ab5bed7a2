"""CuaDesktopEnv without a service: its settings are checked when it is made (each error
names the setting), its spaces follow ``screen`` and ``observe``, and it is registered with
Gymnasium. Its behaviour against the real service: tests/integration/test_gym_env.py."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest

from cua_rollout.core.errors import ConfigError
from cua_rollout.gym import ENV_ID, AnyText, AsyncCuaDesktopEnv, CuaDesktopEnv

URL = "http://127.0.0.1:9"  # nothing is sent: these tests only make and close envs


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"url": "ftp://x"}, "url"),
    ({"action_kind": "clicks"}, "action_kind"),
    ({"screen": (1280,)}, "screen"),
    ({"screen": (0, 720)}, "screen"),
    ({"max_steps": 0}, "max_steps"),
    ({"observe": ("a11y_tree",)}, "observe"),
    ({"observe": ("screenshot", "video")}, "observe"),
    ({"access": "tunnel"}, "access"),
    ({"task": "terminal-hello-file"}, "task"),
    ({"render_mode": "human"}, "render_mode"),
    ({"token": "t", "token_env": "CUA_X"}, "token_env"),
    ({"token_env": "CUA_GYM_TEST_UNSET_TOKEN"}, "CUA_GYM_TEST_UNSET_TOKEN"),
])
def test_a_wrong_setting_is_an_error_naming_it(kwargs, named, monkeypatch):
    monkeypatch.delenv("CUA_GYM_TEST_UNSET_TOKEN", raising=False)
    kwargs = {"url": URL, **kwargs}
    url = kwargs.pop("url")
    with pytest.raises(ConfigError, match=named):
        CuaDesktopEnv(url, **kwargs)


def test_the_spaces_follow_screen_and_observe():
    env = CuaDesktopEnv(URL, screen=(1280, 720), render_mode="rgb_array")
    try:
        assert env.observation_space == gymnasium.spaces.Box(0, 255, (720, 1280, 3), np.uint8)
        assert env.action_space.contains("pyautogui.click(10, 10)")
        assert not env.action_space.contains("")          # an action is never empty
        assert env.render() is None  # nothing observed yet
    finally:
        env.close()
        env.close()  # a second close does nothing
    both = AsyncCuaDesktopEnv(URL, screen=(1920, 1080), observe=("screenshot", "a11y_tree"))
    space = both.observation_space
    assert isinstance(space, gymnasium.spaces.Dict)
    assert space["screenshot"].shape == (1080, 1920, 3)
    assert space.contains({"screenshot": np.zeros((1080, 1920, 3), np.uint8),
                           "a11y_tree": "tag\tname\n文件\t🙂"})


def test_any_text_holds_any_string_and_samples_printable_text():
    space = AnyText(10, min_length=1, seed=0)
    assert space.contains("ünï €")
    assert not space.contains("x" * 11)
    assert not space.contains(b"bytes")
    for _ in range(20):
        sample = space.sample()
        assert space.contains(sample) and sample.isprintable()


def test_it_is_registered_with_gymnasium_as_nondeterministic():
    spec = gymnasium.spec(ENV_ID)
    assert spec.nondeterministic is True
    env = gymnasium.make(ENV_ID, url=URL, screen=(1280, 720), token="t")
    try:
        assert isinstance(env.unwrapped, CuaDesktopEnv)
        assert env.unwrapped.async_env.max_steps == 15
    finally:
        env.close()


async def test_a_closed_env_refuses_to_reset_or_step():
    env = CuaDesktopEnv(URL, token="t")
    env.close()
    with pytest.raises(gymnasium.error.ClosedEnvironmentError):
        env.reset()
    with pytest.raises(gymnasium.error.ClosedEnvironmentError):
        env.step("WAIT")
    async_env = AsyncCuaDesktopEnv(URL, token="t")
    await async_env.close()
    with pytest.raises(gymnasium.error.ClosedEnvironmentError):
        await async_env.reset()
