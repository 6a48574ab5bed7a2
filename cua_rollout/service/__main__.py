"""``python -m cua_rollout.service --config C``: the desktop service (``serve.py``)."""

from cua_rollout.service.serve import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main())
