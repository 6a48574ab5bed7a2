"""Which apps a run's desktops have (cua_rollout.envs.apps) and the pre-flight's verdict on a
task's related_apps: declared, found on this machine for local desktops, or unknown."""

import stat
from pathlib import Path

from cua_rollout.config import load_config
from cua_rollout.envs.apps import app_name, apps_of_packages, desktop_apps, main
from cua_rollout.evaluation.preflight import TaskChecker

TASK = {"id": "t", "instruction": "x", "config": [], "evaluator": {"func": "infeasible"}}


def _command(folder: Path, name: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_local_desktops_have_the_apps_whose_commands_are_installed(tmp_path, monkeypatch):
    _command(tmp_path, "localc")
    _command(tmp_path, "mousepad")
    monkeypatch.setenv("PATH", str(tmp_path))
    apps = desktop_apps(load_config(None, ["desktops.provider=local"]).desktops)
    assert apps.lacks(["os", "libreoffice_calc", "mousepad", "vs_code", "chrome"]) == [
        "vs_code", "chrome"]
    assert "installed on this machine" in apps.source


def test_declared_apps_win_and_unknown_desktops_have_every_app():
    declared = load_config(None, ["desktops.provider=static",
                                  'desktops.static.urls=["http://h:5000"]',
                                  'desktops.apps=["chrome","vs_code"]']).desktops
    assert desktop_apps(declared).lacks(["os", "vs_code", "gimp"]) == ["gimp"]
    unknown = load_config(None, ["desktops.provider=static",
                                 'desktops.static.urls=["http://h:5000"]']).desktops
    assert desktop_apps(unknown).lacks(["vs_code", "gimp"]) == []


def test_the_pre_flight_names_the_missing_app_and_where_the_list_came_from():
    cfg = load_config(None, ['desktops.apps=["mousepad"]'])
    problems = TaskChecker(cfg)({**TASK, "related_apps": ["os", "mousepad", "vs_code"]})
    assert [(p.key, p.message) for p in problems] == [
        ("app:vs_code", "related_apps: the desktops have no vs_code (by desktops.apps)")]
    assert TaskChecker(cfg)({**TASK, "related_apps": "not a list"}) == []


def test_the_image_label_comes_from_the_package_lists(tmp_path, capsys):
    listing = tmp_path / "apt.txt"
    listing.write_text("# a comment\nxvfb\nchromium  # the browser\nlibreoffice-calc\n\n")
    assert apps_of_packages(listing.read_text().splitlines()) == [
        "chrome", "libreoffice", "libreoffice_calc", "pdf"]
    assert main([str(listing)]) == 0
    assert capsys.readouterr().out == "chrome,libreoffice,libreoffice_calc,pdf\n"
    assert main([]) == 2


def test_os_is_always_there(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert desktop_apps(load_config(None).desktops).lacks(["os"]) == []


def test_check_tasks_reads_a_task_sets_files_as_run_py_does(tmp_path, capsys):
    """A task set's own folder is one its tasks may upload files from (run.py adds it), so
    check_tasks.py does not call such a task unrunnable."""
    import json

    from cua_rollout.cli.check_tasks import main as check_tasks

    (tmp_path / "examples" / "os").mkdir(parents=True)
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "in.txt").write_text("x\n")
    task = {**TASK, "id": "up", "config": [{"type": "upload_file", "parameters": {"files": [
        {"local_path": str(tmp_path / "files" / "in.txt"), "path": "/home/user/in.txt"}]}}]}
    (tmp_path / "examples" / "os" / "up.json").write_text(json.dumps(task))
    (tmp_path / "test_all.json").write_text(json.dumps({"os": ["up"]}))
    assert check_tasks([str(tmp_path / "test_all.json"), "--json"]) == 0, capsys.readouterr()
    assert json.loads(capsys.readouterr().out)["runnable"] == 1


def test_osworlds_spellings_of_an_app_are_that_app(tmp_path, monkeypatch):
    """OSWorld's task files spell apps 23 ways (``vscode`` in 28 tasks, ``libreoffice calc``
    in 18, ``Chrome``, ``OS``, ``calc`` ...): each means the app, never a missing one."""
    assert [app_name(a) for a in ("vscode", "libreoffice calc", "Chrome", "OS", "calc",
                                  "Writer", "browser", " LibreOffice  Impress ")] == [
        "vs_code", "libreoffice_calc", "chrome", "os", "libreoffice_calc",
        "libreoffice_writer", "chrome", "libreoffice_impress"]
    declared = desktop_apps(load_config(None, ['desktops.apps=["libreoffice_calc","chrome",'
                                               '"gnome-terminal"]']).desktops)
    assert declared.lacks(["libreoffice calc", "calc", "OS", "Chrome", "terminal",
                           "vscode", "vs_code"]) == ["vs_code"]
    _command(tmp_path, "localc")
    _command(tmp_path, "evince")
    monkeypatch.setenv("PATH", str(tmp_path))
    here = desktop_apps(load_config(None, ["desktops.provider=local"]).desktops)
    assert here.lacks(["libreoffice calc", "pdf", "image", "picard"]) == ["image", "picard"]
