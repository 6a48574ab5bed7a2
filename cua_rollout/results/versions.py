"""The model versions of a run: their order, the selection of episodes by version
(``--min-version``, ``--exclude-mixed``), and the per-version and per-pass figures.

Versions are opaque strings (a checkpoint's name, a served model's name): they are never
parsed. Their order is the order in which they first appear in the run: the episodes sorted
by ``started_at``, each version numbered where it is first used (an episode's versions in
the order it used them). ``version_order`` is the one place that decides it.

An episode belongs to its FIRST version (the version of its first step): that is where
``--min-version`` cuts and the row of the per-version table it counts in. An episode whose
steps came from several versions (a reload mid-episode) is *mixed*; it also counts in the
'mixed' row. Episodes without a version (no step reached a model, or OSWorld's layout)
count in a row of their own and are never at or after a version.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from cua_rollout.results.rates import compute_rates
from cua_rollout.results.runs import Episode, Run, Selection

__all__ = [
    "VersionError",
    "by_pass",
    "by_version",
    "describe_selection",
    "select_versions",
    "selection_json",
    "version_order",
]


class VersionError(ValueError):
    """A version asked for is not one of the run's: ``version``, the run's ``path`` and its
    ``versions`` in order, for the caller's message."""

    def __init__(self, version: str, path: Path, versions: Sequence[str]):
        self.version = version
        self.path = path
        self.versions = tuple(versions)
        listed = ", ".join(self.versions) if self.versions else "none"
        super().__init__(
            f"{version}: not a model version of {path}; its versions in order: {listed}"
        )


def version_order(run: Run) -> list[str]:
    """The run's model versions in the order they first appear: episodes sorted by
    ``started_at`` (episodes without one after the others, in file order), each episode's
    versions in the order it used them. A run narrowed by ``select_versions`` keeps the
    order of the whole run it was taken from."""
    if run.selection is not None:
        return list(run.selection.versions)
    indexed = list(enumerate(run.episodes))
    indexed.sort(key=lambda pair: (pair[1].started_at is None, pair[1].started_at or 0.0,
                                   pair[0]))  # fmt: skip
    order: dict[str, None] = {}
    for _, episode in indexed:
        for version in episode.model_versions:
            order.setdefault(version, None)
    return list(order)


def select_versions(
    run: Run, *, min_version: str | None = None, exclude_mixed: bool = False
) -> Run:
    """The run with only the episodes whose first version is ``min_version`` or a later one
    (in ``version_order``; an episode that started on an older version is left out even if
    it ended on ``min_version``; one without a version is left out too), and, with
    ``exclude_mixed``, none of the mixed ones. Raises VersionError when ``min_version`` is
    not one of the run's versions. Without either option the run is returned as is."""
    if min_version is None and not exclude_mixed:
        return run
    versions = version_order(run)
    keep = [e for e in run.episodes if not (exclude_mixed and e.mixed_versions)]
    if min_version is not None:
        if min_version not in versions:
            raise VersionError(min_version, run.path, versions)
        later = frozenset(versions[versions.index(min_version):])
        keep = [e for e in keep if e.first_model_version in later]
    excluded = len(run.episodes) - len(keep)
    if run.selection is not None:  # narrowed twice: count from the whole run
        excluded += run.selection.excluded
        min_version = min_version or run.selection.min_version
        exclude_mixed = exclude_mixed or run.selection.exclude_mixed
    selection = Selection(min_version, exclude_mixed, tuple(versions), excluded)
    return replace(run, episodes=keep, selection=selection)


def selection_json(run: Run) -> dict[str, Any]:
    """How the run's episodes were narrowed, for the tools' JSON: {"min_version": str | null,
    "exclude_mixed": bool, "excluded_episodes": int} (null, false, 0 when they were not)."""
    if run.selection is None:
        return {"min_version": None, "exclude_mixed": False, "excluded_episodes": 0}
    return run.selection.to_json()


def describe_selection(selection: dict[str, Any]) -> str | None:
    """A ``selection_json`` object in words, None when nothing was narrowed."""
    kept = []
    if selection.get("min_version") is not None:
        kept.append(f"first version {selection['min_version']} or later")
    if selection.get("exclude_mixed"):
        kept.append("no mixed episodes")
    if not kept:
        return None
    return f"{' and '.join(kept)} ({selection.get('excluded_episodes', 0)} episodes left out)"


def by_version(episodes: Iterable[Episode], versions: Sequence[str]) -> dict[str, Any]:
    """The per-version figures (show_result.py --by-version):
      {"rows": [{"version": str | null, **RATES}, ...], "mixed": RATES}
    one row per version of ``versions`` (in that order) with the episodes whose FIRST
    version it is, then, when there are such episodes, a row of version null for those
    without a version; each row's ``mixed_episodes`` counts its mixed ones. "mixed" is the
    RATES of all mixed episodes (each also counted in its first version's row)."""
    episodes = list(episodes)
    grouped: dict[str | None, list[Episode]] = {}
    for e in episodes:
        grouped.setdefault(e.first_model_version, []).append(e)
    rows = [
        {"version": version, **compute_rates(grouped.pop(version, [])).to_json()}
        for version in versions
    ]
    # Without a version, or (a subset of a run handed a shorter list) one not listed.
    rest = [e for group in grouped.values() for e in group]
    if rest:
        rows.append({"version": None, **compute_rates(rest).to_json()})
    mixed = compute_rates(e for e in episodes if e.mixed_versions).to_json()
    return {"rows": rows, "mixed": mixed}


def by_pass(episodes: Iterable[Episode]) -> list[dict[str, Any]]:
    """The per-pass figures (show_result.py --by-pass), one row per ``pass_index`` present,
    in increasing order: [{"pass_index": int, **RATES}, ...]."""
    grouped: dict[int, list[Episode]] = {}
    for e in episodes:
        grouped.setdefault(e.pass_index, []).append(e)
    return [
        {"pass_index": n, **compute_rates(grouped[n]).to_json()} for n in sorted(grouped)
    ]
