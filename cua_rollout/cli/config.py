"""``cua-rollout config --config C [--set k=v]``: validate a config and print it with its
defaults."""

from __future__ import annotations

import argparse

import yaml

from cua_rollout.config import add_config_arguments, config_from_args

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``cua-rollout config --config C [--set k=v]``: validate and print the effective config."""
    parser = argparse.ArgumentParser(description="Validate a config and print it with defaults.")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0
