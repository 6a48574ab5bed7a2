"""A trainer following a rollout run: claim groups as they become final, turn each into
training rows (token ids, logprobs, GRPO advantages), "train" on them, ack them.

    .venv/bin/python docs/examples/trainer_loop.py --run-dir results/demo --consumer t0

Several of these can follow one run (or one PostgreSQL index, ``--db URL``) at once: each
group goes to exactly one of them. A trainer that dies holds its groups only until its
lease runs out; then another one gets them. It stops when the run has ended and no group is
left (``--follow`` keeps waiting for more, as for a service run).

Replace ``train_on`` with your optimiser step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from cua_rollout.core.layout import INDEX_FILE, RUN_FILE
from cua_rollout.training import ClaimedGroup, TrainingIndex, default_url


def train_on(batch: list[dict[str, Any]]) -> None:
    """Your optimiser step. Here: what a policy-gradient step would read."""
    tokens = sum(len(row["token_ids"] or ()) for row in batch)
    print(f"  train: {len(batch)} steps, {tokens} completion tokens", file=sys.stderr)


def rows_of(group: ClaimedGroup) -> list[dict[str, Any]]:
    """One row per step of the group's scored episodes: the model's own tokens and logprobs
    with its episode's advantage (masked episodes, infra failures, are left out)."""
    advantages = group.group["advantages"]
    rows = []
    for episode in group.episodes:
        advantage = advantages.get(episode["episode_id"])
        if advantage is None:
            continue
        for step in episode["steps"]:
            rows.append({"prompt_token_ids": step.get("prompt_token_ids"),
                         "token_ids": step.get("token_ids"), "logprobs": step.get("logprobs"),
                         "model_version": step.get("model_version"), "advantage": advantage})
    return rows


def run_ended(run_dir: Path | None) -> bool:
    if run_dir is None:
        return False
    try:
        return json.loads((run_dir / RUN_FILE).read_text()).get("status") != "running"
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", type=Path, help="a run directory (its SQLite index)")
    where.add_argument("--db", help="an index URL (postgresql+psycopg://user@host/db)")
    parser.add_argument("--consumer", default="trainer", help="this trainer's name")
    parser.add_argument("--batch", type=int, default=4, help="groups per claim")
    parser.add_argument("--lease-s", type=float, default=300.0)
    parser.add_argument("--max-staleness", type=int, default=None,
                        help="skip groups more than this many versions behind the newest")
    parser.add_argument("--follow", action="store_true", help="never stop waiting")
    parser.add_argument("--claimed", type=Path, help="append each claimed group id here")
    args = parser.parse_args(argv)

    url = args.db or default_url(args.run_dir)
    while args.run_dir is not None and not (args.run_dir / INDEX_FILE).exists():
        time.sleep(0.2)  # the run creates its index when it starts
    with TrainingIndex(url) as index:
        while True:
            ended = run_ended(args.run_dir)  # read first: nothing final comes after "ended"
            claims = index.claim_groups(args.batch, args.consumer, lease_s=args.lease_s,
                                        max_staleness=args.max_staleness, load_steps=True)
            for group in claims:
                g = group.group
                print(f"{args.consumer}: {group.group_id} rewards {g['rewards']} "
                      f"mean {g['mean']} versions {g['versions']}"
                      + (" (no signal)" if g["no_signal"] else ""), file=sys.stderr)
                train_on(rows_of(group))
                if args.claimed is not None:
                    with open(args.claimed, "a") as f:
                        f.write(f"{group.run}\t{group.group_id}\n")
            failed = index.ack(claims)
            if failed:
                print(f"{args.consumer}: lease lost before ack: {failed}", file=sys.stderr)
            if not claims:
                if ended and not args.follow:
                    return 0
                time.sleep(0.5)


if __name__ == "__main__":
    raise SystemExit(main())
