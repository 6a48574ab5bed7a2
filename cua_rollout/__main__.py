"""``python -m cua_rollout``: the ``cua-rollout`` command."""

from cua_rollout.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
