"""The design card's TaskLoader: task sources to episodes.

The code is ``cua_rollout.runtime.loader``; this file re-exports it for a checkout.
"""

from cua_rollout.runtime.loader import TaskLoader, load_tasks

__all__ = ["TaskLoader", "load_tasks"]
