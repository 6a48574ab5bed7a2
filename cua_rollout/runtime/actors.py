"""Typed clients of the run's actors (desktop pool, storage, runners, coordinator): one method
per remote method used, over a Ray actor handle or a plain local object (in-process tests and
tools), so a call site names a method the type checker sees instead of a string."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, cast

from cua_rollout.core.types import EpisodeResult, EpisodeSpec
from cua_rollout.runtime.pool import Lease

__all__ = ["CoordinatorClient", "PoolClient", "RunnerClient", "StorageClient", "send"]


def send(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Awaitable[Any]:
    """Send one call at once and return what to await for its answer: a Ray actor method's
    ``.remote`` (an awaitable ObjectRef), or a local method's coroutine scheduled as a task
    (so calls start in the order they are made, as Ray's do). A local method that answers
    synchronously (``stats``) gives a future that is already done. A Ray handle's answer is
    the ObjectRef itself, so a synchronous driver may ``ray.get`` it with a timeout."""
    remote = getattr(method, "remote", None)
    if remote is not None:
        return cast(Awaitable[Any], remote(*args, **kwargs))
    result = method(*args, **kwargs)
    if inspect.isawaitable(result):
        return asyncio.ensure_future(result)
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    done.set_result(result)
    return done


class _Client:
    def __init__(self, target: Any) -> None:
        self.target = target  # a Ray actor handle or the local object itself


class PoolClient(_Client):
    """``cua_rollout.runtime.pool.DesktopPool``: one pool or one shard of a run's pool
    (``cua_rollout.runtime.pool_shards.ShardedPool`` is the client of all of them)."""

    def lease(self, owner: str, timeout_s: float | None = None, avoid: Iterable[str] = ()
              ) -> Awaitable[Lease]:
        return send(self.target.lease, owner, timeout_s, avoid)

    def release(self, lease_id: str, healthy: bool = True) -> Awaitable[None]:
        return send(self.target.release, lease_id, healthy)

    def release_owned(self, owner_prefix: str, healthy: bool = True) -> Awaitable[int]:
        return send(self.target.release_owned, owner_prefix, healthy)

    def withdraw(self, owner: str) -> Awaitable[int]:
        return send(self.target.withdraw, owner)

    def stats(self) -> Awaitable[dict[str, Any]]:
        return send(self.target.stats)

    def describe(self) -> Awaitable[list[dict[str, Any]]]:
        return send(self.target.describe)

    def release_desktop(self, desktop_id: str) -> Awaitable[str]:
        return send(self.target.release_desktop, desktop_id)

    def quarantine(self, desktop_id: str) -> Awaitable[str]:
        return send(self.target.quarantine, desktop_id)

    def remove(self, desktop_id: str) -> Awaitable[str]:
        return send(self.target.remove, desktop_id)

    def start(self) -> Awaitable[dict[str, Any]]:
        return send(self.target.start)

    def stop(self) -> Awaitable[None]:
        return send(self.target.stop)


class StorageClient(_Client):
    """``cua_rollout.runtime.storage.StorageActor``."""

    def start_run(self, info: dict[str, Any], *, rerun_infra_errors: bool = True
                  ) -> Awaitable[dict[str, Any]]:
        return send(self.target.start_run, info, rerun_infra_errors=rerun_infra_errors)

    def end_run(self, status: str, summary: dict[str, Any] | None = None) -> Awaitable[None]:
        return send(self.target.end_run, status, summary)

    def begin_episode(self, episode_id: str, attempt: int, task: dict[str, Any]
                      ) -> Awaitable[None]:
        return send(self.target.begin_episode, episode_id, attempt, task)

    def step_files_target(self) -> Awaitable[dict[str, str]]:
        return send(self.target.step_files_target)

    def write_step(self, episode_id: str, attempt: int, record: dict[str, Any] | None,
                   png_name: str | None = None, *png_parts: bytes) -> Awaitable[None]:
        return send(self.target.write_step, episode_id, attempt, record, png_name, *png_parts)

    def finish_episode(self, episode_id: str, attempt: int, record: dict[str, Any],
                       messages: list[dict[str, Any]] | None = None) -> Awaitable[str | None]:
        return send(self.target.finish_episode, episode_id, attempt, record, messages)

    def record_result(self, record: dict[str, Any], staging: str | None = None,
                      discard: list[str] | None = None) -> Awaitable[None]:
        return send(self.target.record_result, record, staging, discard)

    def record_results(self, items: list[tuple[dict[str, Any], str | None, list[str]]]
                       ) -> Awaitable[list[str | None]]:
        return send(self.target.record_results, items)

    def place_unrecorded(self, episode_id: str, attempt: int, staging: str) -> Awaitable[None]:
        return send(self.target.place_unrecorded, episode_id, attempt, staging)

    def forget_episode(self, episode_id: str, attempt: int) -> Awaitable[None]:
        return send(self.target.forget_episode, episode_id, attempt)

    def write_metrics(self, sample: dict[str, Any]) -> Awaitable[None]:
        return send(self.target.write_metrics, sample)

    def close(self) -> Awaitable[None]:
        return send(self.target.close)


class RunnerClient(_Client):
    """``cua_rollout.runtime.runner.TrajectoryRunner``."""

    def run_episode(self, spec: EpisodeSpec, avoid: list[str] | None = None
                    ) -> Awaitable[EpisodeResult]:
        return send(self.target.run_episode, spec, avoid)

    def await_episode(self, episode_id: str) -> Awaitable[EpisodeResult | None]:
        return send(self.target.await_episode, episode_id)

    def cancel(self, episode_ids: list[str] | None = None) -> Awaitable[int]:
        return send(self.target.cancel, episode_ids)

    def stats(self) -> Awaitable[dict[str, Any]]:
        return send(self.target.stats)

    def close(self) -> Awaitable[None]:
        return send(self.target.close)


class CoordinatorClient(_Client):
    """``cua_rollout.runtime.coordinator.AgentCoordinator``."""

    def start(self, prestart: bool = False) -> Awaitable[None]:
        return send(self.target.start, prestart=prestart)

    def submit(self, specs: list[EpisodeSpec]) -> Awaitable[int]:
        return send(self.target.submit, specs)

    def poll(self) -> Awaitable[dict[str, Any]]:
        return send(self.target.poll)

    def drain(self, cancel: bool = False, timeout_s: float | None = None
              ) -> Awaitable[dict[str, Any]]:
        return send(self.target.drain, cancel, timeout_s)

    def cancel_all(self) -> Awaitable[int]:
        return send(self.target.cancel_all)

    def shutdown(self) -> Awaitable[dict[str, Any]]:
        return send(self.target.shutdown)
