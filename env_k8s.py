"""The desktop environment as the runner sees it (the design card's name): the OSWorld desktop
client, the pool of desktops and their providers — Kubernetes pods among them — and the
contract every environment meets.

The code lives in ``rollout/envs/``: ``contract.py`` (DesktopEnv, DesktopProbe, StepResult),
``client.py`` (RemoteDesktopEnv over ``desktop/protocol.py``), ``setup_steps.py`` (OSWorld
setup steps), ``pool.py`` (DesktopPool, Lease), ``providers/`` (one file per provider),
``checker.py`` (check_desktop_env) and ``local_session.py`` (the local provider's launcher).
Providers: ``local`` (this machine), ``static`` (by URL), ``container`` (podman / docker),
``kubernetes`` (pods, through the official client: ``providers/kubernetes.py``).
"""

from __future__ import annotations

from rollout.envs.checker import check_desktop_env
from rollout.envs.client import (
    RemoteDesktopEnv,
    close_shared_client,
    lease_client,
    shared_client,
)
from rollout.envs.contract import (
    DONE,
    FAIL,
    SPECIAL_ACTIONS,
    WAIT,
    DesktopEnv,
    DesktopProbe,
    StepResult,
)
from rollout.envs.pool import DesktopPool, Lease
from rollout.envs.providers import PROVIDERS, Desktop, DesktopProvider, make_provider
from rollout.envs.providers.container import ContainerProvider
from rollout.envs.providers.kubernetes import KubernetesProvider
from rollout.envs.providers.local import LocalProvider
from rollout.envs.providers.static import StaticProvider

__all__ = [
    "DONE",
    "FAIL",
    "PROVIDERS",
    "SPECIAL_ACTIONS",
    "WAIT",
    "ContainerProvider",
    "Desktop",
    "DesktopEnv",
    "DesktopPool",
    "DesktopProbe",
    "DesktopProvider",
    "KubernetesProvider",
    "Lease",
    "LocalProvider",
    "RemoteDesktopEnv",
    "StaticProvider",
    "StepResult",
    "check_desktop_env",
    "close_shared_client",
    "lease_client",
    "make_provider",
    "shared_client",
]
