"""Reading a run's results, for run.py's final table and the tools in scripts/.

    runs.py     a run directory (ours or OSWorld's) as Run / Episode / Problem records
    rates.py    per-task aggregation and the rates: success rate, avg@k, pass@k
    summary.py  the one-run summary: summarize(run) and print_table(summary)
    versions.py model versions: their order in a run (version_order), --min-version and
                --exclude-mixed (select_versions), the per-version and per-pass rows
    timeline.py what each desktop and runner did over time: episode_segments(run) in phases,
                lanes(), desktop_time_split() and activity_series() (plot_run.py draws them);
                imported from cua_rollout.results.timeline
    cli.py      what the scripts share: parser, opening a run, version options, formatting

No Ray, matplotlib or PIL: those are imported, if at all, by the script that draws.
"""

from cua_rollout.results.cli import (
    RUN_DIR_HELP,
    STATUS_ABBREV,
    add_json_flag,
    add_out_dir,
    add_version_filters,
    fail,
    fmt_float,
    fmt_rate,
    make_out_dir,
    open_run,
    report_problems,
    results_parser,
    select_run,
)
from cua_rollout.results.rates import (
    OSWORLD_GROUPS,
    Rates,
    TaskSummary,
    canonical_domain,
    compute_rates,
    flat_rates,
    group_of,
    k_label,
    mean_std,
    summarize_tasks,
)
from cua_rollout.results.runs import (
    LAYOUT_OSWORLD,
    LAYOUT_OURS,
    Episode,
    Layout,
    Problem,
    Run,
    RunDirError,
    Selection,
    load_run,
    read_jsonl,
    read_metrics,
    read_traj,
)
from cua_rollout.results.summary import (
    SUMMARY_SCHEMA,
    print_pass_table,
    print_table,
    print_version_table,
    summarize,
)
from cua_rollout.results.versions import (
    VersionError,
    by_pass,
    by_version,
    describe_selection,
    select_versions,
    selection_json,
    version_order,
)

__all__ = [
    "LAYOUT_OSWORLD",
    "LAYOUT_OURS",
    "OSWORLD_GROUPS",
    "RUN_DIR_HELP",
    "STATUS_ABBREV",
    "SUMMARY_SCHEMA",
    "Episode",
    "Layout",
    "Problem",
    "Rates",
    "Run",
    "RunDirError",
    "Selection",
    "TaskSummary",
    "VersionError",
    "add_json_flag",
    "add_out_dir",
    "add_version_filters",
    "by_pass",
    "by_version",
    "canonical_domain",
    "compute_rates",
    "describe_selection",
    "fail",
    "flat_rates",
    "fmt_float",
    "fmt_rate",
    "group_of",
    "k_label",
    "load_run",
    "make_out_dir",
    "mean_std",
    "open_run",
    "print_pass_table",
    "print_table",
    "print_version_table",
    "read_jsonl",
    "read_metrics",
    "read_traj",
    "report_problems",
    "results_parser",
    "select_run",
    "select_versions",
    "selection_json",
    "summarize",
    "summarize_tasks",
    "version_order",
]
