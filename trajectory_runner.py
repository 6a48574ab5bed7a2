"""The design card's TrajectoryRunner: the actor that runs episodes.

The code is ``cua_rollout.runtime.runner``; this file re-exports it for a checkout.
"""

from cua_rollout.runtime.runner import TrajectoryRunner

__all__ = ["TrajectoryRunner"]
