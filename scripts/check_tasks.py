"""Which tasks of a task set can run here, and what the others miss: the pre-flight check
run.py applies when tasks load, for any task set, before any desktop or model time.

The code is ``cua_rollout.cli.check_tasks``; see ``cua-rollout --help``.
"""

from cua_rollout.cli.check_tasks import main

if __name__ == "__main__":
    raise SystemExit(main())
