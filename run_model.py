"""Serve the vLLM fleet (the design card's command): ``python run_model.py serve --config C``,
``status``, ``reload``, ``make-tiny-vlm DIR``.

The same as ``cua-rollout model``; the code is ``cua_rollout.cli.model`` over
``cua_rollout.model.fleet``. A checkout's entry point: the wheel installs the package.
"""

from cua_rollout.cli.model import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
