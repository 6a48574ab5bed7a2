"""The runtime: the episode loop and its runner actor, the coordinator that schedules episodes,
the storage actor, the desktop pool actor, the task loader, and what a run reports (metrics,
utilization, progress)."""

__all__: list[str] = []
