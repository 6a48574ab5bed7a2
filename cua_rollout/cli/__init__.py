"""The command line: ``cua-rollout`` and its subcommands (``main.py``), each a module here."""

__all__: list[str] = []
