"""The desktops of a run, for an operator: list them and act on one, on a live run, without
stopping it; or, with no run alive, list and sweep what a provider left behind.

The code is ``cua_rollout.cli.desktops``; see ``cua-rollout --help``.
"""

from cua_rollout.cli.desktops import main

if __name__ == "__main__":
    raise SystemExit(main())
