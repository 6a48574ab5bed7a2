"""Desktop providers, one file each, chosen by ``desktops.provider``. Adding one: a file with
a ``DesktopProvider`` subclass and a line in ``PROVIDERS``; no other provider changes."""

from __future__ import annotations

import importlib

from cua_rollout.config import DesktopsConfig
from cua_rollout.envs.providers.base import Desktop, DesktopProvider

__all__ = ["PROVIDERS", "Desktop", "DesktopProvider", "make_provider"]

# desktops.provider -> "module:class", imported only when chosen (a provider may pull in a
# client library the others do not need).
PROVIDERS: dict[str, str] = {
    "local": "cua_rollout.envs.providers.local:LocalProvider",
    "static": "cua_rollout.envs.providers.static:StaticProvider",
    "container": "cua_rollout.envs.providers.container:ContainerProvider",
    "kubernetes": "cua_rollout.envs.providers.kubernetes:KubernetesProvider",
    "vm": "cua_rollout.envs.providers.vm:VMProvider",
    "remote": "cua_rollout.envs.providers.remote:RemoteProvider",
}


def make_provider(cfg: DesktopsConfig) -> DesktopProvider:
    """The provider ``cfg.provider`` names (the config's Literal allows only ``PROVIDERS``'
    keys), built from the desktops config."""
    module, name = PROVIDERS[cfg.provider].split(":")
    cls: type[DesktopProvider] = getattr(importlib.import_module(module), name)
    return cls(cfg)  # type: ignore[call-arg]
