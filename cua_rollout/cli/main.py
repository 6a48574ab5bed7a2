"""``cua-rollout``: one command, a subcommand per job. Each subcommand is a module of this
package with its own ``main(argv)``, imported only when chosen (``cua-rollout results`` needs
neither Ray nor vLLM)."""

from __future__ import annotations

import importlib
import sys

__all__ = ["COMMANDS", "main"]

# name -> (module with main(argv), one line of help). "results" has subcommands of its own.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("cua_rollout.cli.run", "roll out a config's tasks (python run.py)"),
    "model": ("cua_rollout.cli.model",
              "serve | status | reload the vLLM fleet; make-tiny-vlm (python run_model.py)"),
    "config": ("cua_rollout.cli.config", "validate a config and print it with its defaults"),
    "results": ("", "show | stats | compare | view | plot a run's results"),
    "training": ("cua_rollout.training.cli",
                 "the trainer's index: status, claim, ack, release, export, reindex"),
    "desktops": ("cua_rollout.cli.desktops",
                 "list, act on or sweep the desktops of a run or service; serve them"),
    "check-tasks": ("cua_rollout.cli.check_tasks", "can these tasks be set up and scored here"),
    "replay": ("cua_rollout.runtime.replay", "play a task's reference solution on a desktop"),
}
RESULTS: dict[str, tuple[str, str]] = {
    "show": ("cua_rollout.cli.show_result", "success rates of one run"),
    "stats": ("cua_rollout.cli.experiment_result_stats", "statistics of one or more runs"),
    "compare": ("cua_rollout.cli.compare_exp_result", "two runs side by side"),
    "view": ("cua_rollout.cli.view_trajectory", "an episode's steps as an HTML page"),
    "plot": ("cua_rollout.cli.plot_run", "a run's curves and timelines as PNG files"),
}


def _usage(prog: str, commands: dict[str, tuple[str, str]]) -> str:
    width = max(map(len, commands))
    lines = [f"usage: {prog} COMMAND [ARGS ...]   ({prog} COMMAND --help for its options)",
             "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in commands.items()]
    return "\n".join(lines)


def _dispatch(prog: str, commands: dict[str, tuple[str, str]], argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(prog, commands))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"{prog}: unknown command {name!r}\n\n{_usage(prog, commands)}", file=sys.stderr)
        return 2
    if name == "results" and commands is COMMANDS:
        return _dispatch(f"{prog} results", RESULTS, rest)
    module = importlib.import_module(commands[name][0])
    code = module.main(rest)
    return int(code or 0)


def main(argv: list[str] | None = None) -> int:
    return _dispatch("cua-rollout", COMMANDS, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())
