"""A group's training facts from its episodes' result records: rewards, the masked episodes,
the group-relative advantages and the model versions that produced it. Pure functions, no
I/O: the index (``cua_rollout.training.index``) stores what ``group_record`` returns.

A *group* is every rollout of one task in one pass (``pass_index``); its advantages are
GRPO's: each scored episode's reward relative to its group's."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from cua_rollout.core.types import SCORED_STATUSES, Status

__all__ = ["ADVANTAGE_EPS", "fill_defaults", "group_record", "is_scored"]

# Added to the group's standard deviation in the advantage's denominator (GRPO's epsilon).
ADVANTAGE_EPS = 1e-6


def fill_defaults(record: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a results.jsonl record with the group and version fields filled in the way
    records written before they existed are read: ``pass_index`` 0, ``group_id``
    ``"<domain>/<task_id>/pass-<pass_index>"``, ``first_model_version`` = ``model_version``,
    ``model_versions`` = ``[model_version]`` (``[]`` when null), ``mixed_versions`` = more
    than one version, ``group_size`` None (unknown). ValueError names a ``pass_index`` or
    ``group_size`` that is not an integer."""
    out = dict(record)
    out["pass_index"] = _int_or(out, "pass_index", 0)
    if not out.get("group_id"):
        out["group_id"] = f"{out.get('domain')}/{out.get('task_id')}/pass-{out['pass_index']}"
    last = out.get("model_version")
    if "first_model_version" not in out:
        out["first_model_version"] = last
    versions = out.get("model_versions")
    if versions is None:
        versions = [last] if last is not None else []
    out["model_versions"] = [str(v) for v in versions if v is not None]
    if out.get("mixed_versions") is None:
        out["mixed_versions"] = len(out["model_versions"]) > 1
    out["group_size"] = _int_or(out, "group_size", None)
    return out


def _int_or(record: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = record.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{key}: {value!r} is not an integer")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{key}: {value!r} is not an integer") from None


def is_scored(record: Mapping[str, Any]) -> bool:
    """Whether the record's reward is a score of the agent (a scored status with a reward).
    Anything else (infra errors above all) is masked out of training, never scored 0."""
    return record.get("status") in SCORED_STATUSES and record.get("reward") is not None


def _distinct(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def group_record(group_id: str, *, domain: str | None, task_id: str | None, pass_index: int,
                 group_size: int, episodes: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The training record of one group from its episodes' result records.

    ``episode_ids`` and ``rewards`` are in rollout order; ``rewards[i]`` is None for a masked
    episode (a status outside ``SCORED_STATUSES``, or no reward). Over the ``scored`` rewards
    r_1..r_k: ``mean`` = sum(r)/k, ``std`` = sqrt(sum((r - mean)^2)/k) (population, ddof=0),
    and each scored episode's advantage is

        A_i = (r_i - mean) / (std + ADVANTAGE_EPS)          (ADVANTAGE_EPS = 1e-6)

    with A_i = 0.0 for all when every scored reward is equal (std = 0), and None for masked
    episodes; ``mean``/``std`` are None when nothing is scored. ``no_signal``: fewer than two
    scored episodes or all scored rewards equal (the group teaches nothing).

    Versions: over the episodes ordered by ``started_at``, ``first_version`` is the first
    known ``first_model_version``, ``last_version`` the last known ``model_version``;
    ``versions`` the distinct ``model_versions`` in first-seen order; ``mixed_versions`` when
    an episode changed version mid-way or the group holds more than one."""
    eps = [fill_defaults(e) for e in episodes]
    ordered = sorted(eps, key=lambda e: (int(e.get("rollout") or 0), str(e["episode_id"])))
    ids = [str(e["episode_id"]) for e in ordered]
    rewards = [float(e["reward"]) if is_scored(e) else None for e in ordered]
    masked = [i for i, r in zip(ids, rewards, strict=True) if r is None]
    infra = sum(1 for e in ordered if not is_scored(e) and e.get("status") == Status.INFRA_ERROR)
    scored = [r for r in rewards if r is not None]

    mean: float | None = None
    std: float | None = None
    equal = len(set(scored)) <= 1
    if scored:
        if equal:  # exact: no rounding noise divided by 1e-6
            mean, std = scored[0], 0.0
        else:
            mean = math.fsum(scored) / len(scored)
            std = math.sqrt(math.fsum((r - mean) ** 2 for r in scored) / len(scored))
    advantages: dict[str, float | None] = {}
    for episode_id, r in zip(ids, rewards, strict=True):
        if r is None or mean is None or std is None:
            advantages[episode_id] = None
        else:
            advantages[episode_id] = 0.0 if std == 0 else (r - mean) / (std + ADVANTAGE_EPS)

    by_start = sorted(eps, key=lambda e: (float(e.get("started_at") or 0.0),
                                          int(e.get("rollout") or 0)))
    firsts = [e["first_model_version"] for e in by_start if e["first_model_version"]]
    lasts = [e["model_version"] for e in by_start if e.get("model_version")]
    versions = _distinct(v for e in by_start for v in e["model_versions"])
    return {
        "group_id": group_id,
        "domain": domain,
        "task_id": task_id,
        "pass_index": int(pass_index),
        "size": int(group_size),
        "episode_ids": ids,
        "rewards": rewards,
        "scored": len(scored),
        "mean": mean,
        "std": std,
        "advantages": advantages,
        "masked": masked,
        "infra_failures": infra,
        "no_signal": len(scored) < 2 or equal,
        "first_version": str(firsts[0]) if firsts else None,
        "last_version": str(lasts[-1]) if lasts else None,
        "versions": versions,
        "mixed_versions": any(e["mixed_versions"] for e in eps) or len(versions) > 1,
    }
