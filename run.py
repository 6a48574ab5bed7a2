"""Roll out (the design card's command): ``python run.py --config configs/demo.yaml``.

The same as ``cua-rollout run``; the code is ``cua_rollout.cli.run`` (the driver) over
``cua_rollout.runtime`` (the actors). A checkout's entry point: the wheel installs the package.
"""

from cua_rollout.cli.run import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
