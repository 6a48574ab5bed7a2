"""The state the fleet publishes for model clients: ``<model_pool.state_dir>/endpoints.json``,
written by the supervisor (run_model.py), read by every ModelServicePool. Light: the model
client imports this module, never the supervisor."""

from __future__ import annotations

__all__ = ["ENDPOINTS_FILE"]

ENDPOINTS_FILE = "endpoints.json"  # written by run_model.py under model_pool.state_dir
