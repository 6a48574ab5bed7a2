"""The design card's StorageActor: every write of a run.

The code is ``cua_rollout.runtime.storage``; this file re-exports it for a checkout.
"""

from cua_rollout.runtime.storage import EpisodeWriter, StorageActor

__all__ = ["EpisodeWriter", "StorageActor"]
