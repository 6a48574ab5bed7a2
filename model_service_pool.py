"""The design card's ModelServicePool: generations routed over the vLLM endpoints.

The code is ``cua_rollout.model.service_pool``; this file re-exports it for a checkout.
"""

from cua_rollout.model.service_pool import Generation, ModelServicePool

__all__ = ["Generation", "ModelServicePool"]
