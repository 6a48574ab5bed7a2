"""Environments as the runners see them: the contract every environment meets
(``contract.py``) and its conformance checker (``checker.py``); the OSWorld desktop client
(``client.py``) and its setup-step interpreter (``setup_steps.py``); the pool of desktops
(``pool.py``) and where desktops come from (``providers/``, one file per provider).
``env_k8s.py`` at the top level is the public entry point."""

__all__: list[str] = []
