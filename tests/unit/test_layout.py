"""The layout's rules (docs/architecture.md). The layers of ``cua_rollout`` and the
independence of its desktop server and of its VM machine layer are import-linter contracts
(pyproject.toml ``[tool.importlinter]``), checked here together with what the library cannot
express: no import cycle between subpackages (function-level imports included), an ``__all__``
in every module, no private name imported across modules, no ``sys.path`` edits in product
code, the top-level files and scripts as entry points only, benchmarks that use
``tests.doubles`` and nothing else of tests/."""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from tests.support import REPO_ROOT, unavailable

ROOT = REPO_ROOT
PACKAGE = "cua_rollout"
# The design card's top-level files: a checkout's entry points, each a re-export or command.
TOP_LEVEL = ["agent_coordinator", "config", "env_k8s", "model_service_pool", "prompts", "run",
             "run_model", "storage_actor", "task_loader", "trajectory_runner", "ui_tars_utils"]
TOP_LEVEL_MAX_LINES = 30


def _package_files() -> dict[str, Path]:
    """Module name -> file, for every module of the package."""
    out = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _package_files()


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every absolute import in ``path``, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [alias.name for alias in node.names]))
    return out


def _lint_imports(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    tool = Path(sys.executable).with_name("lint-imports")
    if not tool.exists():
        unavailable("import-linter is not installed (pip install -e '.[dev]')")
    return subprocess.run([str(tool), "--no-cache"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def test_the_import_contracts_hold():
    done = _lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "BROKEN" not in done.stdout and done.stdout.count("KEPT") == 5, done.stdout


@pytest.mark.parametrize(("importer", "imported"), [
    ("core/errors.py", "cua_rollout.runtime.runner"),      # vocabulary on top of the runtime
    ("config.py", "cua_rollout.agents.uitars"),            # the schema on top of an agent
    ("desktop/server.py", "cua_rollout.core.errors"),      # the desktop server not standalone
    ("vm/machine.py", "cua_rollout.core.errors"),          # the VM layer not standalone
    ("vm/spec.py", "cua_rollout.desktop.protocol"),        # nor beside the desktop server
    ("agents/uitars/parser.py", "cua_rollout.envs.client"),  # an agent on a desktop client
])
def test_the_contracts_catch_an_import_against_them(tmp_path, importer, imported):
    """The same contracts over a copy of the package with one forbidden import added."""
    shutil.copytree(ROOT / PACKAGE, tmp_path / PACKAGE,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / PACKAGE / importer
    target.write_text(target.read_text(encoding="utf-8") + f"\nimport {imported}  # noqa\n",
                      encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = _lint_imports(tmp_path, env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "BROKEN" in done.stdout and imported in done.stdout, done.stdout


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(edges.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_there_is_no_import_cycle_between_modules_or_subpackages():
    """Function-level imports included (grimp sees them): a lazy import may save start-up
    time, never hide a cycle."""
    graph = grimp.build_graph(PACKAGE)
    modules = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _cycles(modules) == []

    def subpackage(module: str) -> str:
        return ".".join(module.split(".")[:2])

    packages: dict[str, set[str]] = {}
    for module, deps in modules.items():
        packages.setdefault(subpackage(module), set()).update(
            subpackage(d) for d in deps if subpackage(d) != subpackage(module))
    assert _cycles(packages) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_declares_its_public_surface():
    def declares(path: Path) -> bool:
        return any(isinstance(node, ast.Assign | ast.AnnAssign)
                   and "__all__" in {t.id for t in (node.targets if isinstance(node, ast.Assign)
                                                     else [node.target])
                                     if isinstance(t, ast.Name)}
                   for node in ast.parse(path.read_text(encoding="utf-8")).body)

    lacking = [name for name, path in MODULES.items()
               if not declares(path) and not name.endswith(("__main__", "sitecustomize"))]
    assert not lacking, f"modules without an __all__ assignment: {lacking}"


def test_no_private_name_is_imported_across_modules():
    files = [*MODULES.values(), *ROOT.glob("*.py"), *ROOT.glob("scripts/*.py"),
             *ROOT.glob("benchmarks/*.py"), *ROOT.glob("tests/**/*.py")]
    leaks = []
    for path in files:
        for module, names in _imports(path):
            if not module.startswith((PACKAGE, "benchmarks", "tests")):
                continue
            leaks += [f"{path.relative_to(ROOT)}: from {module} import {n}" for n in names
                      if n.startswith("_") and not n.startswith("__")]
    assert not leaks, "\n".join(leaks)


def test_no_sys_path_edits_in_product_code():
    """No module reaches ``sys.path`` (code, not text: the py sandbox's bootstrap, a string
    run by the sandbox's own interpreter, sets the snippet's)."""
    files = [*MODULES.values(), *ROOT.glob("*.py"), *ROOT.glob("scripts/*.py")]

    def edits_path(path: Path) -> bool:
        return any((isinstance(node, ast.Attribute) and node.attr == "path"
                    and isinstance(node.value, ast.Name) and node.value.id == "sys")
                   or (isinstance(node, ast.ImportFrom) and node.module == "sys"
                       and any(a.name == "path" for a in node.names))
                   for node in ast.walk(ast.parse(path.read_text("utf-8"))))

    edits = [str(p.relative_to(ROOT)) for p in files if edits_path(p)]
    assert not edits, f"sys.path edited in {edits}"


def test_the_top_level_files_are_the_design_cards_entry_points():
    """Each is short, imports only the package, and re-exports the package's own objects."""
    assert sorted(p.stem for p in ROOT.glob("*.py")) == sorted(TOP_LEVEL)
    for name in TOP_LEVEL:
        path = ROOT / f"{name}.py"
        lines = path.read_text(encoding="utf-8").splitlines()
        assert len(lines) <= TOP_LEVEL_MAX_LINES, f"{name}.py: {len(lines)} lines"
        sources = {m for m, _ in _imports(path)}
        assert sources and all(m.startswith(f"{PACKAGE}.") for m in sources), (name, sources)
        module = importlib.import_module(name)
        assert module.__all__, name
        for export in module.__all__:
            owner = next(importlib.import_module(m) for m, names in _imports(path)
                         if export in names)
            assert getattr(module, export) is getattr(owner, export), (name, export)


def test_the_scripts_are_entry_points_of_the_cli():
    for path in ROOT.glob("scripts/*.py"):
        sources = {m for m, _ in _imports(path)}
        assert len(sources) == 1 and next(iter(sources)).startswith(f"{PACKAGE}.cli."), \
            f"{path.name} imports {sources}"
        assert len(path.read_text(encoding="utf-8").splitlines()) <= 20, path.name


# Besides the doubles, the simulated hosts (network namespaces on a bridge) the chaos run puts
# its world on (network_cut, node_lost): machinery, not assertions.
_BENCHMARKS_MAY_USE = ("tests.doubles", "tests.support.hosts")


def test_benchmarks_use_the_test_doubles_and_nothing_else_of_tests():
    for path in ROOT.glob("benchmarks/*.py"):
        bad = [m for m, _ in _imports(path)
               if m.split(".")[0] == "tests" and not m.startswith(_BENCHMARKS_MAY_USE)]
        assert not bad, f"{path.name} imports from tests/: {bad}"


def test_no_source_file_is_ignored_by_git():
    """A .gitignore rule for run outputs once hid a package (``results/`` matched the
    results package): a fresh clone then lacked it while the working tree passed."""
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
