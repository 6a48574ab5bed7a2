"""``cua_rollout/desktop/`` stands alone: it is what goes into a desktop image (without the rest
of the package), so a copy of it imports without the repository (that it imports nothing else
of the package is an import-linter contract: tests/unit/test_layout.py); its wire protocol
imports nothing but pydantic and the standard library; and every path of
``cua_rollout.desktop.protocol.Paths`` is served by the server, and nothing else is.
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

from cua_rollout.desktop.protocol import Paths
from cua_rollout.desktop.server import create_app
from tests.support import REPO_ROOT

REPO = REPO_ROOT
DESKTOP = REPO / "cua_rollout" / "desktop"
SUBPROCESS_TIMEOUT_S = 120


def _desktop_files() -> list[Path]:
    return sorted(
        p
        for p in DESKTOP.rglob("*.py")
        if "__pycache__" not in p.parts
    )


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


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
        if module.startswith("cua_rollout.desktop")
        for name in names
        if name.startswith("_")
    ]
    assert not private, "\n".join(private)


def test_desktop_alone_imports_without_the_repo(tmp_path: Path) -> None:
    """A copy of cua_rollout/desktop/ alone, as the desktop image holds it (cua_rollout a
    namespace package without its __init__.py), with the installed third-party packages but
    without the repo (its editable install included), imports every module."""
    shutil.copytree(DESKTOP, tmp_path / "cua_rollout" / "desktop",
                    ignore=shutil.ignore_patterns("__pycache__"))
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
        for name in ("cua_rollout.core", "cua_rollout.config", "cua_rollout.envs", "config",
                     "env_k8s", "ui_tars_utils", "tests"):
            try:
                importlib.import_module(name)
            except ImportError:
                report["repo_modules"][name] = "missing"
            else:
                report["repo_modules"][name] = "importable"
        for name in {modules!r}:
            report["files"][name] = importlib.import_module(name).__file__
        from cua_rollout.desktop.server import create_app
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
