"""``desktop/`` stands alone: it is what goes into a desktop image, so it imports nothing of the
controller; its wire protocol imports nothing but pydantic and the standard library; and every
path of ``desktop.protocol.Paths`` is served by the server, and nothing else is.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from desktop.protocol import Paths
from desktop.server import create_app
from tests.support import REPO_ROOT

REPO = REPO_ROOT
DESKTOP = REPO / "desktop"
# Launches a desktop from the controller's side; it is on its way out of desktop/.
CONTROLLER_SIDE = {"session.py"}
SUBPROCESS_TIMEOUT_S = 120


def _desktop_files() -> list[Path]:
    return sorted(
        p
        for p in DESKTOP.rglob("*.py")
        if p.name not in CONTROLLER_SIDE and "__pycache__" not in p.parts
    )


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _repo_top_level_names() -> set[str]:
    """The names the repo's own top-level modules and packages import as: its *.py files and
    every directory holding Python code, except desktop itself."""
    names = {p.stem for p in REPO.glob("*.py")}
    for d in REPO.iterdir():
        if d.is_dir() and d.name.isidentifier() and d.name != "desktop" and any(d.glob("*.py")):
            names.add(d.name)
    return names


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every import in ``path``; relative imports
    are resolved against the file's package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((node.lineno, module, [alias.name for alias in node.names]))
    return found


def test_the_repo_has_the_controller_modules_this_test_guards_against() -> None:
    names = _repo_top_level_names()
    assert {"rollout", "config", "env_k8s", "ui_tars_utils", "tests"} <= names
    assert "desktop" not in names


@pytest.mark.parametrize("path", _desktop_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_desktop_imports_nothing_of_the_controller(path: Path) -> None:
    forbidden = _repo_top_level_names()
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for line, module, _ in _imports(path)
        if module.split(".")[0] in forbidden
    ]
    assert not bad, "\n".join(bad)


def test_protocol_imports_only_pydantic_and_the_standard_library() -> None:
    allowed = set(sys.stdlib_module_names) | {"__future__", "pydantic"}
    modules = {module.split(".")[0] for _, module, _ in _imports(DESKTOP / "protocol.py")}
    assert modules <= allowed, modules - allowed


@pytest.mark.parametrize("path", _desktop_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_modules_say_what_they_own_and_export_no_privates(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    assert ast.get_docstring(tree), f"{path.name} has no module docstring"
    exported = [
        node
        for node in tree.body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        and any(
            isinstance(t, ast.Name) and t.id == "__all__"
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
    ]
    assert exported, f"{path.name} has no __all__"
    private = [
        f"{path.relative_to(REPO)}:{line} imports {name} from {module}"
        for line, module, names in _imports(path)
        if module.split(".")[0] == "desktop"
        for name in names
        if name.startswith("_")
    ]
    assert not private, "\n".join(private)


def test_desktop_alone_imports_without_the_repo(tmp_path: Path) -> None:
    """A copy of desktop/ alone, with the installed third-party packages but without the
    repo (its editable install included), imports every module."""
    shutil.copytree(DESKTOP, tmp_path / "desktop", ignore=shutil.ignore_patterns("__pycache__"))
    for name in CONTROLLER_SIDE:
        (tmp_path / "desktop" / name).unlink(missing_ok=True)
    modules = [_module_name(p) for p in _desktop_files()]
    site_dirs = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    script = textwrap.dedent(
        f"""
        import importlib, json, sys
        # -I -S: no cwd, no PYTHONPATH, no site (so no .pth and no editable-install finder);
        # the third-party packages are put back by directory, the copy of desktop/ first.
        sys.path[:0] = [{str(tmp_path)!r}]
        sys.path += {site_dirs!r}
        report = {{"path": sys.path, "repo_modules": {{}}, "files": {{}}}}
        for name in ("rollout", "errors", "config", "env_k8s", "ui_tars_utils", "tests"):
            try:
                importlib.import_module(name)
            except ImportError:
                report["repo_modules"][name] = "missing"
            else:
                report["repo_modules"][name] = "importable"
        for name in {modules!r}:
            report["files"][name] = importlib.import_module(name).__file__
        from desktop.server import create_app
        report["routes"] = sorted(r.path for r in create_app().routes)
        print(json.dumps(report))
        """
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert str(REPO) not in report["path"]
    assert set(report["repo_modules"].values()) == {"missing"}, report["repo_modules"]
    assert set(report["files"]) == set(modules)
    for name, file in report["files"].items():
        assert Path(file).is_relative_to(tmp_path), f"{name} came from {file}"
    assert len(report["routes"]) == len(_paths())


def _paths() -> set[str]:
    return {value for name, value in vars(Paths).items() if name.isupper()}


def test_the_server_serves_exactly_the_protocols_paths() -> None:
    app = create_app()  # its lifespan (which needs a display) does not run
    served = {getattr(route, "path", None) for route in app.routes}
    assert served == _paths()
