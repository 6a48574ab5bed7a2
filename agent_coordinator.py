"""The design card's AgentCoordinator: K episodes in flight over runner actors.

The code is ``cua_rollout.runtime.coordinator``; this file re-exports it for a checkout.
"""

from cua_rollout.runtime.coordinator import AgentCoordinator

__all__ = ["AgentCoordinator"]
