"""The layout's rules, checked on the source (docs/architecture.md): the design card's
top-level files and what each exports, an ``__all__`` in every module, no private name
imported across modules, no import cycle, no ``sys.path`` edits in product code, and the
one-way edges (desktop/ imports nothing of the controller, scripts only the results library
(check_tasks.py and desktops.py also what they check or act on),
benchmarks never tests/)."""

from __future__ import annotations

import ast
import importlib
import subprocess
from pathlib import Path

import pytest

from tests.support import REPO_ROOT, unavailable

ROOT = REPO_ROOT
DESIGN_CARD = ["agent_coordinator", "env_k8s", "model_service_pool", "prompts", "run",
               "run_model", "storage_actor", "task_loader", "trajectory_runner", "ui_tars_utils"]
# What each top-level file exports: its public surface, pinned (a change here is an API change).
EXPORTS = {
    "agent_coordinator": ["AgentCoordinator"],
    "config": ["LEASE_MARGIN_S", "TASK_MODES", "TEXT_MODES", "BenchmarkConfig", "MetricName",
               "PyToolConfig", "RagToolConfig", "TextConfig", "TextMode", "WebToolConfig",
               "Config", "ContainerDesktopsConfig", "CoordinatorConfig",
               "DesktopsConfig", "DynamicRolloutsConfig", "EvaluationConfig",
               "KubernetesDesktopsConfig", "LocalDesktopsConfig", "ModelConfig",
               "ModelPoolConfig", "MonitoringConfig", "RayConfig", "RunConfig", "RunnerConfig",
               "SamplingConfig", "StaticDesktopsConfig", "StorageConfig", "TasksConfig",
               "VerifyConfig",
               "add_config_arguments", "config_from_args", "load_config", "main",
               "secret_from_env"],
    "env_k8s": ["DONE", "FAIL", "PROVIDERS", "SPECIAL_ACTIONS", "WAIT", "ContainerProvider",
                "Desktop", "DesktopEnv", "DesktopPool", "DesktopProbe", "DesktopProvider",
                "KubernetesProvider", "Lease", "LocalProvider",
                "RemoteDesktopEnv", "StaticProvider", "StepResult", "check_desktop_env",
                "close_shared_client", "lease_client", "make_provider", "shared_client"],
    "prompts": ["SYSTEM_PROMPT", "Turn", "build_messages", "build_prompt"],
    "run": ["EXIT_FATAL", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "Actors", "main",
            "print_summary", "run", "start_actors", "stop_actors"],
    "storage_actor": ["PART_BYTES", "EpisodeWriter", "StorageActor", "compact_results",
                      "png_parts"],
    "task_loader": ["DEFAULT_DOMAIN", "EpisodeSpec", "TaskLoader", "TaskProblem", "name_problem",
                    "dynamic_rollout_n", "load_benchmark", "load_tasks", "validate_task"],
    "trajectory_runner": ["Decider", "EnvFactory", "EpisodeError", "TrajectoryRunner",
                          "episode_deadline_s", "episode_error", "open_leased_desktop"],
    "ui_tars_utils": ["ACTION_KINDS", "ACTION_REGEX_CONTENT_CHARS", "ACTION_REGEX_THOUGHT_CHARS",
                      "FAMILIES", "IMAGE_FACTOR", "IMAGE_WRAPPER_TOKENS", "KEY_KINDS",
                      "MAX_PIXELS", "MAX_RATIO", "MIN_PIXELS", "POINTER_KINDS", "RELATIVE_SCALE",
                      "SCROLL_DIRECTIONS", "TERMINAL_KINDS", "Action", "Family",
                      "ParsedResponse", "action_regex", "action_regex_max_chars",
                      "add_box_token", "format_action", "format_response", "image_tokens",
                      "model_to_screen", "normalize_key", "parse_response", "screen_to_model",
                      "smart_resize", "split_terminal", "to_pyautogui"],
}
PRODUCT_PACKAGES = ("rollout", "desktop")


def _project_modules() -> dict[str, Path]:
    """Module name -> file, for the top-level files and every module of the packages."""
    out = {p.stem: p for p in ROOT.glob("*.py")}
    for package in PRODUCT_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _project_modules()


def _imports(path: Path, *, top_level_only: bool) -> list[tuple[str, list[str]]]:
    """(module, imported names) of each import in ``path``; relative imports resolved.
    ``top_level_only``: the imports that run when the module is imported (not inside
    functions, not under ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [alias.name for alias in node.names]))
    return out


def _resolve(name: str) -> str | None:
    """The project module an import names (``a.b`` or a parent package), if any."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def test_the_design_cards_files_are_at_the_top_level():
    assert set(DESIGN_CARD) <= set(MODULES)
    for name in ("configs", "scripts", "tests"):
        assert (ROOT / name).is_dir()
    top = sorted(p.stem for p in ROOT.glob("*.py"))
    assert top == sorted([*DESIGN_CARD, "config"]), "only the design card's files and the " \
        "config schema live at the top level; everything else has a package"


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_the_top_level_exports_are_pinned(name):
    module = importlib.import_module(name)
    assert sorted(module.__all__) == sorted(EXPORTS[name])
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"


def test_every_module_declares_its_public_surface():
    lacking = [name for name, path in MODULES.items()
               if "__all__" not in path.read_text(encoding="utf-8")]
    assert not lacking, f"modules without __all__: {lacking}"


def test_no_private_name_is_imported_across_modules():
    files = [*MODULES.values(), *ROOT.glob("scripts/*.py"), *ROOT.glob("benchmarks/*.py"),
             *ROOT.glob("tests/**/*.py")]
    leaks = []
    for path in files:
        for module, names in _imports(path, top_level_only=False):
            if _resolve(module) is None and not module.startswith(("benchmarks", "tests")):
                continue
            leaks += [f"{path.relative_to(ROOT)}: from {module} import {n}" for n in names
                      if n.startswith("_") and not n.startswith("__")]
    assert not leaks, "\n".join(leaks)


def test_there_is_no_import_cycle():
    graph = {name: {dep for module, _ in _imports(path, top_level_only=True)
                    if (dep := _resolve(module)) and dep != name}
             for name, path in MODULES.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep):], dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_no_sys_path_edits_in_product_code():
    """No module reaches ``sys.path`` (code, not text: the py sandbox's bootstrap, a string
    run by the sandbox's own interpreter, sets the snippet's)."""
    files = [*MODULES.values(), *ROOT.glob("scripts/*.py")]

    def edits_path(path: Path) -> bool:
        return any((isinstance(node, ast.Attribute) and node.attr == "path"
                    and isinstance(node.value, ast.Name) and node.value.id == "sys")
                   or (isinstance(node, ast.ImportFrom) and node.module == "sys"
                       and any(a.name == "path" for a in node.names))
                   for node in ast.walk(ast.parse(path.read_text("utf-8"))))

    edits = [str(p.relative_to(ROOT)) for p in files if edits_path(p)]
    assert not edits, f"sys.path edited in {edits}"


def test_the_one_way_edges():
    controller = {n for n in MODULES if not n.startswith("desktop")}
    for name, path in MODULES.items():
        if name.startswith("desktop"):
            wrong = {_resolve(m) for m, _ in _imports(path, top_level_only=False)} & controller
            assert not wrong, f"{name} (desktop side) imports the controller's {wrong}"
    # The results scripts read run directories only; check_tasks.py checks a task set the
    # way run.py's loader does, so it also uses the config, the loader and the pre-flight.
    allowed = {"check_tasks.py": ("config", "task_loader", "rollout.evaluation.preflight",
                                  "rollout.errors"),
               # The operator's desktop tool: the run's config and its desktops' providers.
               "desktops.py": ("config", "rollout.envs", "rollout.errors", "rollout.files")}
    for path in ROOT.glob("scripts/*.py"):
        used = {_resolve(m) for m, _ in _imports(path, top_level_only=False)} - {None}
        ok = ("rollout.results", "rollout.layout", "rollout.types", *allowed.get(path.name, ()))
        assert all(m.startswith(ok) for m in used), f"{path.name} imports {used}"
    for path in ROOT.glob("benchmarks/*.py"):
        bad = [m for m, _ in _imports(path, top_level_only=False) if m.startswith("tests")]
        assert not bad, f"{path.name} imports from tests/: {bad}"


def test_no_source_file_is_ignored_by_git():
    """A .gitignore rule for run outputs once hid a package (``results/`` matched
    rollout/results/): a fresh clone then lacked it while the working tree passed."""
    files = [str(p.relative_to(ROOT)) for p in [*MODULES.values(), *ROOT.glob("scripts/*"),
                                                  *ROOT.glob("tests/**/*.py")]]
    try:
        done = subprocess.run(["git", "check-ignore", "--no-index", *files], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        unavailable("git is not installed")
    if done.returncode == 128:
        unavailable(f"not a git checkout: {done.stderr.strip()}")
    assert done.stdout.split() == [], f"ignored by .gitignore: {done.stdout.split()}"
