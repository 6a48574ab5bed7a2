"""``python -m rollout.training``: see ``rollout.training.cli``."""

import sys

from rollout.training.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
