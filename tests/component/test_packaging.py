"""The wheel as a trainer's environment receives it: built from this checkout and installed
into a fresh venv next to a project with its own ``config.py`` and ``run.py``. Only the
package (with its data files) and the ``cua-rollout`` command are installed; the user's
modules stay theirs; the command answers ``--help`` without the heavy dependencies."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

pytestmark = pytest.mark.slow

# Module names a checkout has at its top level, which must not leak into site-packages.
CHECKOUT_MODULES = ("config", "run", "run_model", "prompts", "ui_tars_utils", "task_loader",
                    "trajectory_runner", "agent_coordinator", "storage_actor",
                    "model_service_pool", "env_k8s", "rollout", "desktop", "tests")


# A driver that started Ray puts the checkout on PYTHONPATH for its workers (runtime/launch.py);
# the fresh venv must see none of this process's Python settings.
_CLEAN_ENV = {k: v for k, v in os.environ.items()
              if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "VIRTUAL_ENV")}


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=_CLEAN_ENV, capture_output=True, text=True,
                          timeout=300, check=False)


def test_the_wheel_installs_one_package_and_a_command(tmp_path):
    # Built from a copy of what the build reads: setuptools writes build/ next to its source.
    source = tmp_path / "source"
    shutil.copytree(REPO_ROOT / "cua_rollout", source / "cua_rollout",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "--no-index", "-q", "-w", str(wheels), str(source)], cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = wheels.glob("cua_rollout-*.whl")
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    installed = _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                      str(wheel)], cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr[-2000:]

    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                         "['purelib'])"], cwd=tmp_path).stdout.strip())
    ours = sorted(p.name for p in purelib.iterdir()
                  if p.name.startswith("cua_rollout") or p.stem in CHECKOUT_MODULES)
    assert ours == ["cua_rollout", f"{wheel.name.split('-')[0]}-"
                    f"{wheel.name.split('-')[1]}.dist-info"], ours
    assert (purelib / "cua_rollout" / "desktop" / "openbox-rc.xml").is_file()
    assert (purelib / "cua_rollout" / "desktop" / "apps" / "google-chrome").is_file()

    # A trainer's project with modules of the same names as the checkout's.
    project = tmp_path / "trainer"
    project.mkdir()
    (project / "config.py").write_text("OWNER = 'the trainer'\n")
    (project / "run.py").write_text("OWNER = 'the trainer'\n")
    probe = ("import importlib.util, config, run, cua_rollout; "
             "assert config.OWNER == run.OWNER == 'the trainer'; "
             f"print([n for n in {CHECKOUT_MODULES[2:]!r} if importlib.util.find_spec(n)])")
    done = _run([str(python), "-c", probe], cwd=project)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

    command = env / "bin" / "cua-rollout"
    helped = _run([str(command), "--help"], cwd=project)
    assert helped.returncode == 0, helped.stderr
    for name in ("run", "model", "config", "results", "training", "desktops", "check-tasks"):
        assert f"\n  {name} " in helped.stdout, name
    results = _run([str(command), "results", "--help"], cwd=project)
    assert results.returncode == 0 and "\n  show " in results.stdout
    unknown = _run([str(command), "nope"], cwd=project)
    assert unknown.returncode == 2 and "unknown command 'nope'" in unknown.stderr


def test_this_interpreter_runs_the_checkout_not_an_installed_copy():
    """The tests import the checkout (an editable install or the repository on sys.path)."""
    import cua_rollout

    assert Path(cua_rollout.__file__).resolve().is_relative_to(REPO_ROOT)
