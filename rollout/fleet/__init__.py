"""The vLLM fleet behind ``run_model.py``: checkpoints, devices and ports, replica processes,
the supervisor with its rolling reload, its control API, and the state file it publishes."""

__all__: list[str] = []
