"""Launch and supervise a pool of vLLM OpenAI servers, and roll new checkpoints onto it.

``python run_model.py --config C`` starts ``model_pool.replicas`` servers, restarts any that
die, and publishes them in ``<state_dir>/endpoints.json`` for ``model_service_pool.py``.
``status`` and ``reload`` reach the running supervisor over its control server on 127.0.0.1.
``make-tiny-vlm DIR`` writes a tiny random Qwen2.5-VL (UI-TARS-1.5's architecture) for a dry run
of the whole path on a CPU (``configs/demo_vlm.yaml``).

This file is the command line only; the fleet lives in ``cua_rollout/model/fleet/``:

    cli.py          the serve / status / reload commands
    supervisor.py   start, restart, health checks, rolling reload
    control.py      the control API (GET /status, POST /reload) and its client
    watch.py        --watch: new checkpoints in a directory
    checkpoints.py  resolving, versions, in-place reload compatibility
    devices.py      GPUs, CUDA_VISIBLE_DEVICES per replica, ports
    launch.py       a replica's vLLM command line and environment
    processes.py    replica process groups, stopping them, the stale-replica sweep
    replica_api.py  a replica's /health, /metrics and in-place weight reload
    state.py        endpoints.json and control.json
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from cua_rollout.cli.fleet import cmd_make_tiny_vlm, cmd_reload, cmd_serve, cmd_status
from cua_rollout.config import add_config_arguments, config_from_args

__all__ = ["main"]


def _make_tiny_vlm(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="run_model.py make-tiny-vlm",
        description="Write a tiny random Qwen2.5-VL (UI-TARS-1.5's architecture) to DIR, for a "
                    "dry run of the whole path on a CPU (configs/demo_vlm.yaml).")
    parser.add_argument("directory", type=Path, metavar="DIR")
    return cmd_make_tiny_vlm(parser.parse_args(argv).directory)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["make-tiny-vlm"]:  # needs no config
        return _make_tiny_vlm(argv[1:])
    parser = argparse.ArgumentParser(
        prog="run_model.py",
        description="Start and supervise the vLLM pool (default), show its status, roll a "
                    "new checkpoint onto it, or write a tiny random vision-language model.",
    )
    parser.add_argument("command", nargs="?", default="serve",
                        choices=["serve", "status", "reload", "make-tiny-vlm"],
                        help="make-tiny-vlm DIR takes no config")
    add_config_arguments(parser)
    parser.add_argument("--checkpoint", help="reload: the new checkpoint; serve: overrides "
                        "model_pool.checkpoint")
    parser.add_argument("--watch", type=Path, metavar="DIR",
                        help="serve: poll DIR and roll out each newer checkpoint in it")
    parser.add_argument("--json", action="store_true", help="status: print JSON")
    parser.add_argument("--no-wait", action="store_true",
                        help="reload: return once the supervisor accepted the reload")
    parser.add_argument("--batch", type=int, metavar="N",
                        help="reload: replicas reloaded at once this time (default "
                             "model_pool.reload_batch; the number of replicas reloads them all "
                             "at once, and episodes wait for them)")
    args = parser.parse_args(argv)
    if args.command == "reload" and not args.checkpoint:
        parser.error("reload needs --checkpoint PATH")
    if args.batch is not None and (args.command != "reload" or args.batch < 1):
        parser.error("--batch N (N >= 1) goes with reload")
    if args.watch is not None and args.command != "serve":
        parser.error("--watch goes with serve")
    if args.watch is not None and not args.watch.is_dir():
        parser.error(f"--watch {args.watch}: not a directory")
    if args.command == "serve" and args.checkpoint:
        args.overrides.append(f"model_pool.checkpoint={args.checkpoint}")
    cfg = config_from_args(args)
    logging.basicConfig(
        level=cfg.run.log_level, stream=sys.stderr,
        format="%(asctime)s run_model %(levelname)s %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.command == "status":
        return cmd_status(cfg, as_json=args.json)
    if args.command == "reload":
        return cmd_reload(cfg, args.checkpoint, wait=not args.no_wait, batch=args.batch)
    return cmd_serve(cfg, args.watch)


if __name__ == "__main__":
    raise SystemExit(main())
