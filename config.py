"""The one YAML schema (the design card's name): ``from config import Config, load_config``.

The schema is ``cua_rollout.config``; ``python config.py`` is ``cua-rollout config``. A
checkout's entry point: the wheel installs the package.
"""

from cua_rollout.cli.config import main
from cua_rollout.config import Config, load_config

__all__ = ["Config", "load_config", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
