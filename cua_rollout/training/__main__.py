"""``python -m cua_rollout.training``: see ``cua_rollout.training.cli``."""

import sys

from cua_rollout.training.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
