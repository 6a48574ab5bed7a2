"""OSWorld's chrome tasks on local desktops, which share one host's network: each desktop's
`google-chrome --remote-debugging-port=1337` (the command the tasks launch) gets a DevTools
port of its own, the desktop reports it, and the chrome setup steps and OSWorld's evaluator
address reach that desktop's browser, not a neighbour's; its UI is in the accessibility tree
as Chrome's; `pkill chrome` ends only that desktop's."""

from __future__ import annotations

import asyncio
import re
import shutil

import pytest

from cua_rollout.envs import chrome
from tests.support import release_and_check, side_by_side, unavailable

pytestmark = pytest.mark.integration


async def test_two_desktops_run_osworlds_chrome_launch_line_side_by_side(tmp):
    if shutil.which("Xvfb") is None or shutil.which("chromium") is None:
        unavailable("Xvfb and chromium are needed")
    async with side_by_side(tmp) as (pool, leases, envs):
        for i, env in enumerate(envs):
            # A chrome task's own first steps (OSWorld's launch line), then its tabs step.
            await env.reset({"id": f"t{i}", "config": [
                {"type": "launch", "parameters": {
                    "command": ["google-chrome", "--remote-debugging-port=1337"]}},
                {"type": "chrome_open_tabs", "parameters": {
                    "urls_to_open": [f"data:text/html,<title>desk{i}</title>"]}},
            ]})
        ports = {env.chromium_port for env in envs}
        assert len(ports) == 2 and 9222 not in ports and 1337 not in ports
        for i, env in enumerate(envs):
            assert env.address().chromium_port == env.chromium_port
            async with chrome.DevTools(env.devtools_url, timeout_s=10) as devtools:
                titles = [t.title for t in await devtools.tabs()]
            assert f"desk{i}" in titles and f"desk{1 - i}" not in titles, titles
            # The browser's UI is in the accessibility tree, named as the Chrome it stands in
            # for, where OSWorld's getters read the active tab's URL.
            tree = await env.accessibility_tree()
            assert re.search(r'<application name="Google Chrome"', tree), tree[:300]
            assert 'name="Address and search bar"' in tree
            # The profile is where OSWorld's getters read Chrome's files.
            out = await env.execute(["sh", "-c", "test -d ~/.config/google-chrome/Default "
                                     "&& echo yes"])
            assert out["output"].strip() == "yes"
        # OSWorld's postconfig `pkill chrome` (Chromium stands in for Chrome) ends this
        # desktop's browser only; its relaunch comes back on the same port.
        assert (await envs[0].execute("pkill chrome", shell=True))["returncode"] == 0
        for _ in range(100):
            try:
                async with chrome.DevTools(envs[0].devtools_url, timeout_s=2) as devtools:
                    await devtools.version()
            except Exception:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("pkill chrome left the desktop's browser running")
        async with chrome.DevTools(envs[1].devtools_url, timeout_s=10) as devtools:
            assert "desk1" in [t.title for t in await devtools.tabs()]
        await release_and_check(pool, leases)  # the resets end the apps
