"""The design card's env_k8s: the desktop environment as the runner sees it, and the pool of
desktops with their providers (Kubernetes pods among them).

The code is ``cua_rollout.envs`` (contract, client, providers) and ``cua_rollout.runtime.pool``;
this file re-exports the main names for a checkout.
"""

from cua_rollout.envs.client import RemoteDesktopEnv
from cua_rollout.envs.contract import DesktopEnv
from cua_rollout.envs.providers import PROVIDERS, make_provider
from cua_rollout.runtime.pool import DesktopPool

__all__ = ["PROVIDERS", "DesktopEnv", "DesktopPool", "RemoteDesktopEnv", "make_provider"]
