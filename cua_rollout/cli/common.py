"""What every command shares: the ``--config`` / ``--set`` options and loading the config
they name (exit 2 with the error on stderr)."""

from __future__ import annotations

import argparse
import sys

from cua_rollout.config import Config, load_config
from cua_rollout.core.errors import ConfigError

__all__ = ["add_config_arguments", "config_from_args"]

def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--config`` and ``--set`` options every CLI of the project shares."""
    parser.add_argument("--config", "-c", required=True, help="YAML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set coordinator.max_concurrent_episodes=16",
    )


def config_from_args(args: argparse.Namespace) -> Config:
    """Load the config named on the command line, or exit 2 with the error on stderr."""
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
