"""The Kubernetes provider's map of watched pods (cua_rollout/envs/providers/kubernetes.py)
against the Kubernetes API test server (tests/doubles/kube_api.py), no kubelet: a pod gone is
forgotten, so a long run's map holds its live pods only (issue 33), while a start waiting on
a pod still learns that it was deleted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cua_rollout.config import DesktopsConfig
from cua_rollout.core.errors import DesktopError
from cua_rollout.envs.providers.kubernetes import KubernetesProvider
from tests.doubles.kube_api import KubeAPIServer
from tests.support import until

NS = "rollout"


@pytest.fixture
def server() -> Iterator[KubeAPIServer]:
    api = KubeAPIServer(bookmark_interval_s=0.2)
    api.start()
    try:
        yield api
    finally:
        api.stop()


def _provider(server: KubeAPIServer, tmp_path: Path) -> KubernetesProvider:
    kubeconfig = server.kubeconfig(tmp_path / "kubeconfig", NS)
    return KubernetesProvider(DesktopsConfig(
        provider="kubernetes", count=1, warm_spares=0,
        kubernetes={"namespace": NS, "image": "desktop:test", "kubeconfig": str(kubeconfig),
                    "startup_timeout_s": 20, "api_timeout_s": 10}))


async def _create(provider: KubernetesProvider, name: str) -> None:
    await provider._connect()("create_namespaced_pod", NS, provider.pod_manifest(name, 0))


async def _delete(provider: KubernetesProvider, name: str) -> None:
    await provider._connect()("delete_namespaced_pod", name, NS, grace_period_seconds=0)


async def test_deleted_pods_leave_the_map(server: KubeAPIServer, tmp_path: Path) -> None:
    provider = _provider(server, tmp_path)
    try:
        provider._connect()
        provider._start_watch()
        names = [f"cua-{provider.run}-{i}-abcd" for i in range(30)]
        for name in names:
            await _create(provider, name)
        await until(lambda: set(provider._pods) == set(names), timeout_s=20)
        for name in names[:-2]:  # desktops replaced over a long run
            await _delete(provider, name)
        await until(lambda: set(provider._pods) == set(names[-2:]), timeout_s=20)
    finally:
        await provider.close()


async def test_a_start_waiting_on_a_deleted_pod_hears_of_it_and_forgets_it(
        server: KubeAPIServer, tmp_path: Path) -> None:
    provider = _provider(server, tmp_path)
    try:
        provider._connect()
        provider._start_watch()
        name = f"cua-{provider.run}-0-abcd"
        await _create(provider, name)
        waiting = asyncio.ensure_future(provider._wait_ready(name, time.monotonic()))
        await until(lambda: name in provider._pods and provider._waiters.get(name),
                    timeout_s=20)
        await _delete(provider, name)
        with pytest.raises(DesktopError, match="deleted before it was ready"):
            await asyncio.wait_for(waiting, 20)
        assert name not in provider._pods
    finally:
        await provider.close()


def test_a_relist_forgets_pods_that_went_while_the_watch_was_away(tmp_path: Path) -> None:
    """The re-list after a broken watch: pods missing from it are gone; one a start waits
    on stays, marked deleted, for that start."""
    provider = KubernetesProvider(DesktopsConfig(
        provider="kubernetes", kubernetes={"namespace": NS, "image": "desktop:test"}))

    def pod(name: str) -> dict[str, Any]:
        return {"metadata": {"name": name}, "status": {"phase": "Pending"}}

    loop = asyncio.new_event_loop()
    try:
        provider._apply("list", [pod("a"), pod("b"), pod("c")])
        waiter = loop.create_future()
        provider._waiters["b"] = [waiter]
        provider._apply("list", [pod("c"), pod("d")])
        assert sorted(provider._pods) == ["b", "c", "d"]
        assert provider._pods["b"].get("deleted") is True and waiter.done()
        provider._apply("DELETED", [pod("c")])
        assert sorted(provider._pods) == ["b", "d"]
    finally:
        loop.close()
