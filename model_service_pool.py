"""The design card's ModelServicePool: generations routed over the vLLM endpoints.

The code is ``cua_rollout.model.client``; this file re-exports it for a checkout.
"""

from cua_rollout.model.client import Generation, ModelServicePool

__all__ = ["Generation", "ModelServicePool"]
