"""``CuaDesktopEnv`` as a SkyRL-gym environment (``skyrl_gym.envs.base_text_env.BaseTextEnv``):
``init`` leases a desktop for the sample's task and adds its screen to the chat, ``step``
takes the model's reply (a UI-TARS reply by default), returns the next screen as a user
message, the task's reward and ``done``. skyrl-gym is not a dependency of the package:
import this module only where it is installed (``pip install skyrl-gym``).

    from cua_rollout.gym.skyrl import register
    register()                                   # id "cua_desktop"
    env = skyrl_gym.make("cua_desktop", env_config={"url": ..., "token_env": ...,
                         "screen": [1280, 720]}, extras={"task": task, "max_turns": 15})
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pybase64
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType

from cua_rollout.core.errors import ConfigError
from cua_rollout.gym.env import CuaDesktopEnv

__all__ = ["SKYRL_ENV_ID", "CuaSkyRLEnv", "register"]

SKYRL_ENV_ID = "cua_desktop"
# The settings env_config may carry (CuaDesktopEnv's arguments); a typo is an error.
_SETTINGS = ("url", "token", "token_env", "action_kind", "screen", "observe", "access",
             "wait_s", "pause_s", "timeout_s", "label", "max_turns")


class CuaSkyRLEnv(BaseTextEnv):
    """One trajectory on one leased desktop. ``env_config``: the service (``url``,
    ``token_env`` ...; CuaDesktopEnv's arguments) and ``max_turns``; ``extras``: the
    sample's ``task`` (an OSWorld task) and optionally its own ``max_turns``."""

    def __init__(self, env_config: Mapping[str, Any] | None = None,
                 extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        settings = dict(env_config or {})
        unknown = sorted(set(settings) - set(_SETTINGS))
        if unknown:
            raise ConfigError(f"CuaSkyRLEnv: unknown env_config keys {unknown} "
                              f"(known: {', '.join(_SETTINGS)})")
        if "url" not in settings:
            raise ConfigError("CuaSkyRLEnv: env_config.url (the desktop service) is missing")
        extras = dict(extras or {})
        self.task = extras.get("task")
        if not isinstance(self.task, dict):
            raise ConfigError("CuaSkyRLEnv: extras.task (an OSWorld task dict) is missing")
        self.max_turns = int(extras.get("max_turns", settings.pop("max_turns", 15)))
        settings.pop("max_turns", None)
        screen = settings.pop("screen", (1920, 1080))
        self.env = CuaDesktopEnv(
            settings.pop("url"), action_kind=settings.pop("action_kind", "uitars"),
            screen=(int(screen[0]), int(screen[1])), max_steps=self.max_turns, **settings)
        self.reward = 0.0
        self.last_info: dict[str, Any] = {}

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        """Lease the desktop for the task; the prompt then the first screen."""
        _, info = self.env.reset(options={"task": self.task})
        self.turns = 0
        metadata = {key: info[key] for key in ("env_id", "task_id", "setup_s", "waited_s")}
        return [*prompt, _screen_message(info["screenshot_png"])], metadata

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        _, reward, terminated, truncated, info = self.env.step(action)
        done = terminated or truncated
        self.reward, self.last_info = reward, info
        metadata = {key: info.get(key) for key in (
            "step", "executed", "returncode", "error", "parse_error", "terminal",
            "evaluation_error")}
        observations = [] if done else [_screen_message(info["screenshot_png"])]
        return BaseTextEnvStepOutput(observations=observations, reward=reward, done=done,
                                     metadata=metadata, postprocessed_action=None)

    def get_metrics(self) -> dict[str, Any]:
        return {"reward": self.reward, "turns": self.turns,
                "parse_error": int(self.last_info.get("parse_error") is not None)}

    def close(self) -> None:
        self.env.close()


def _screen_message(png: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + pybase64.b64encode(png).decode("ascii")
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}


def register(env_id: str = SKYRL_ENV_ID) -> None:
    """Make ``skyrl_gym.make(env_id, ...)`` build a ``CuaSkyRLEnv`` (once per process)."""
    if env_id not in skyrl_gym.registry:
        skyrl_gym.register(id=env_id, entry_point="cua_rollout.gym.skyrl:CuaSkyRLEnv")
