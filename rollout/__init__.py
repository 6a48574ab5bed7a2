"""The rollout service's internals, one package per concern named in ``docs/architecture.md``.

The design card's top-level files (``run.py``, ``agent_coordinator.py``, ``env_k8s.py`` ...)
are the entry points; what needs more than one file lives here. Importing this package
imports nothing else.
"""

__all__: list[str] = []
