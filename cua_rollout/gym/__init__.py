"""Gymnasium environments over the desktop service (docs/desktop_service.md):
``CuaDesktopEnv`` (sync, a ``gymnasium.Env``), ``AsyncCuaDesktopEnv`` (the same on the
caller's event loop), registered as ``cua_rollout/Desktop-v0``. ``cua_rollout.gym.skyrl``
wraps it for SkyRL-gym (imported on its own: skyrl-gym is not a dependency)."""

from __future__ import annotations

import gymnasium

from cua_rollout.gym.env import (
    ACTION_KINDS,
    ENV_ID,
    OBSERVE_KINDS,
    AnyText,
    AsyncCuaDesktopEnv,
    CuaDesktopEnv,
    LeaseEnded,
)

__all__ = [
    "ACTION_KINDS",
    "ENV_ID",
    "OBSERVE_KINDS",
    "AnyText",
    "AsyncCuaDesktopEnv",
    "CuaDesktopEnv",
    "LeaseEnded",
]

if ENV_ID not in gymnasium.registry:
    # nondeterministic: a desktop is not seeded (clocks, caret blinks, app start-up).
    gymnasium.register(ENV_ID, entry_point="cua_rollout.gym.env:CuaDesktopEnv",
                       nondeterministic=True)
