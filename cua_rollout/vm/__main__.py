"""``python -m cua_rollout.vm``: the launcher of one VM (``launcher.py``), as a pod runs it."""

from cua_rollout.vm.launcher import main

if __name__ == "__main__":
    raise SystemExit(main())
