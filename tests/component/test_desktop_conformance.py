"""``check_desktop_env`` itself (it passes a conforming fake and fails each way of breaking
the contract) and the conformance of the simulated desktops the benchmarks use, through the
real OSWorld client and the static provider. Real desktops (local Xvfb, and a real desktop
server given to the static provider) are checked in tests/integration/test_local_desktops.py."""

from __future__ import annotations

import httpx2
import pytest

from benchmarks.sim_world import DesktopSim, Latency, SimWorld
from cua_rollout.config import DesktopsConfig, StaticDesktopsConfig
from cua_rollout.core.errors import DesktopError
from cua_rollout.envs.checker import ConformanceError, check_desktop_env
from cua_rollout.envs.client import RemoteDesktopEnv, close_shared_client
from cua_rollout.envs.providers.static import StaticProvider
from cua_rollout.runtime.pool import DesktopPool
from tests.doubles.fake_desktop import FakeDesktop, solid_png


async def test_a_conforming_fake_passes_and_is_closed():
    env = FakeDesktop(size=(800, 600))
    seen = await check_desktop_env(env, screen_size=(800, 600))
    assert seen["screen_size"] == (800, 600) and seen["step"].ok
    assert env.actions[0] == "pyautogui.position()" and env.actions[1:] == ["WAIT", "DONE",
                                                                           "FAIL"]
    assert env.closed == 2  # close is called twice and must not fail the second time


@pytest.mark.parametrize("env, fragment", [
    (FakeDesktop(observe_func=lambda: b"\xff\xd8\xff\xe0 a JPEG"), "not a PNG"),
    (FakeDesktop(size=(640, 480)), "configured screen is 800x600"),
    (FakeDesktop(size=(800, 600),
                 step_func=lambda code: {"returncode": 1, "error": "NameError"}),
     "failed: returncode 1"),
    (FakeDesktop(size=(800, 600), step_func=lambda code: (_ for _ in ()).throw(
        httpx2.ConnectError("refused"))), "raised ConnectError"),
    (FakeDesktop(size=(800, 600), files={"/nonexistent/conformance-check/missing.txt": b"x"}),
     "missing file returned"),
])
async def test_each_contract_break_is_named(env, fragment):
    with pytest.raises(ConformanceError, match=fragment):
        await check_desktop_env(env, screen_size=(800, 600))
    assert env.closed >= 1


async def test_a_screenshot_size_that_disagrees_with_its_header_is_caught():
    class Lying(FakeDesktop):
        async def observe(self):
            shot = await super().observe()
            shot.__dict__["size"] = (1, 1)  # a cached size that is not the PNG's
            return shot

    with pytest.raises(ConformanceError, match="differs from the PNG header"):
        await check_desktop_env(Lying())


async def test_an_environment_failing_in_the_projects_terms_is_not_a_contract_break():
    def dead(code: str) -> None:
        raise DesktopError("fake: cannot connect")

    with pytest.raises(DesktopError, match="cannot connect"):
        await check_desktop_env(FakeDesktop(step_func=dead))


def test_the_fakes_png_reads_back():
    png = solid_png(3, 2, (1, 2, 3))
    import io

    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        assert image.size == (3, 2) and image.getpixel((2, 1)) == (1, 2, 3)


@pytest.fixture(scope="module")
def sim():
    world = SimWorld(desktops=2, model_servers=1, desktop_workers=1,
                     desktop=DesktopSim(action_latency=Latency(0.0), reset_latency=Latency(0.0),
                                        setup_latency=Latency(0.0), screenshots=2))
    with world:
        yield world


async def test_the_simulated_desktops_conform_through_the_static_provider(sim):
    cfg = DesktopsConfig(provider="static", count=2, screen_width=1920, screen_height=1080,
                         static=StaticDesktopsConfig(urls=sim.desktop_urls,
                                                     reset_command=sim.reset_command),
                         verify={"enabled": False})  # simulated: no real commands
    pool = DesktopPool(cfg, StaticProvider(cfg))
    await pool.start()
    try:
        for _ in range(2):
            lease = await pool.lease("conformance")
            env = RemoteDesktopEnv.for_lease(lease.url, cfg, name=lease.desktop_id)
            await check_desktop_env(env, screen_size=(1920, 1080))
            await pool.release(lease.lease_id)
    finally:
        await pool.stop()
        await close_shared_client()


async def test_a_dead_desktop_fails_in_the_projects_terms_not_the_transports():
    """The OSWorld client translates transport errors: a desktop nobody listens for is a
    DesktopError (retried elsewhere by the coordinator), never an httpx2 exception."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the client connects
    cfg = DesktopsConfig(retries=0, request_timeout_s=2)
    env = RemoteDesktopEnv.for_lease(f"http://127.0.0.1:{port}", cfg, name="dead")
    with pytest.raises(DesktopError, match="dead/screenshot: cannot connect"):
        await check_desktop_env(env)
