"""The ``py`` environment's Python sandbox (cua_rollout/text/sandbox.py), for real: bubblewrap
sandboxes on this machine, real processes watched from the host with psutil, real TCP, UDP and
Unix listeners. Each hostile snippet (endless loop, fork bomb, memory hog, output flood, disk
filler, reads of host files, network) must be stopped or refused, reported, leave no process
behind and leave the calling process (the runner) as it was. Every assertion would fail if the
protection it checks were missing (the host side is checked to be reachable first)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import secrets
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest

from cua_rollout.config import PyToolConfig
from cua_rollout.core.errors import ToolError, ToolUnavailable
from cua_rollout.envs.tools import Tool
from cua_rollout.text.sandbox import (
    PythonSandbox,
    PythonTool,
    SandboxRun,
    format_run,
    sandbox_problem,
)
from tests.support import REPO_ROOT, until

# Generous: a CI run may be using both cores while these run.
LIMITS = PyToolConfig(timeout_s=20.0)
SLACK_S = 8.0  # how late past a limit a killed run may still return on a loaded machine


@pytest.fixture(scope="module", autouse=True)
def _sandbox_runs_here() -> None:
    problem = sandbox_problem()
    if problem is not None:
        pytest.fail(f"the python sandbox cannot run here: {problem}. Run scripts/setup_env.sh "
                    "(it installs the Debian package bubblewrap)")


@contextlib.asynccontextmanager
async def opened(tmp_path: Path, limits: PyToolConfig = LIMITS,
                 ) -> AsyncIterator[PythonSandbox]:
    box = PythonSandbox(limits.model_copy(update={"scratch_root": tmp_path}))
    try:
        yield box
    finally:
        await box.close()


@pytest.fixture
async def box(tmp_path: Path) -> AsyncIterator[PythonSandbox]:
    async with opened(tmp_path) as sandbox:
        yield sandbox


async def printed(box: PythonSandbox, code: str) -> list[str]:
    """The lines ``code`` printed in ``box``, which it ran to a zero exit."""
    run = await box.run(code)
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()


def uid_processes(uid: int) -> list[psutil.Process]:
    """Every process on the host running as ``uid`` (a sandbox's)."""
    out = []
    for proc in psutil.process_iter(["uids"]):
        uids = proc.info["uids"]
        if uids is not None and uid in (uids.real, uids.effective):
            out.append(proc)
    return out


def gone(proc: psutil.Process) -> bool:
    """The process (that very one, not a later one with its pid) no longer exists."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def group_empty(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@contextlib.contextmanager
def runner_unchanged() -> Iterator[None]:
    """The calling process is as it was: same limits, can still start processes, and its
    memory did not take what the snippet wrote or allocated."""
    kinds = (resource.RLIMIT_NPROC, resource.RLIMIT_AS, resource.RLIMIT_NOFILE,
             resource.RLIMIT_CPU, resource.RLIMIT_FSIZE)
    before = [resource.getrlimit(k) for k in kinds]
    rss = psutil.Process().memory_info().rss
    yield
    assert [resource.getrlimit(k) for k in kinds] == before
    assert psutil.Process().memory_info().rss - rss < 64 << 20
    assert subprocess.run(["true"], check=False, timeout=60).returncode == 0


class LoopLag:
    """The event loop's worst lateness while the block runs (a blocked loop shows here)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            start = time.monotonic()
            await asyncio.sleep(0.02)
            self.worst = max(self.worst, time.monotonic() - start - 0.02)

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


# ---------------------------------------------------------------------- ordinary snippets


async def test_ordinary_snippets_run_and_scratch_files_persist(tmp_path: Path):
    async with opened(tmp_path) as box, opened(tmp_path) as other:
        run = await box.run("import math\nprint(2 ** 100)\nprint(math.factorial(20))\n"
                            "print('héllo ✓')")
        assert run.stdout == f"{2 ** 100}\n2432902008176640000\nhéllo ✓\n"
        assert (run.stderr, run.returncode, run.killed, run.truncated) == ("", 0, None, False)

        run = await box.run("import os, sys\nprint(os.getuid(), os.getgid(), os.getgroups(), "
                            "os.getcwd(), os.environ['HOME'])\n"
                            "print(open('/proc/self/status').read())")
        ids, status = run.stdout.split("\n", 1)
        assert ids == f"{box.uid} {box.uid} [] /scratch /scratch"
        assert box.uid != 0
        assert "CapEff:\t0000000000000000" in status and "CapBnd:\t0000000000000000" in status
        assert "NoNewPrivs:\t1" in status

        run = await box.run("def f(x):\n    return 1 / x\n\nf(0)\n")
        assert run.returncode == 1 and run.killed is None
        assert 'File "<snippet>", line 2, in f' in run.stderr
        assert "return 1 / x" in run.stderr and "ZeroDivisionError" in run.stderr
        assert "<string>" not in run.stderr  # none of the bootstrap's frames
        assert (await box.run("import sys; sys.exit(3)")).returncode == 3
        assert "SyntaxError" in (await box.run("def f(:")).stderr
        assert "EOFError" in (await box.run("input()")).stderr  # no stdin

        # Threads, a process pool and subprocesses work within the limits.
        run = await box.run(
            "import concurrent.futures as cf, multiprocessing as mp, subprocess\n"
            "def sq(x):\n    return x * x\n"
            "with cf.ThreadPoolExecutor(4) as ex:\n    print(sum(ex.map(sq, range(10))))\n"
            "with mp.Pool(2) as pool:\n    print(pool.map(sq, [1, 2, 3]))\n"
            "print(subprocess.run(['echo', 'hi'], capture_output=True, text=True).stdout)")
        assert run.stdout.split() == ["285", "[1,", "4,", "9]", "hi"], run.stderr

        # Files written in the scratch directory stay for the next calls (modules too).
        run = await box.run("open('data.txt', 'w').write('kept')\n"
                            "open('helper.py', 'w').write('def twice(x):\\n    return 2 * x\\n')"
                            "\nopen('/tmp/gone.txt', 'w').write('per call')")
        assert run.returncode == 0, run.stderr
        run = await box.run("import helper, os\nprint(open('data.txt').read(), helper.twice(21),"
                            " os.path.exists('/tmp/gone.txt'))")
        assert run.stdout == "kept 42 False\n", run.stderr
        assert (box.scratch / "data.txt").read_text() == "kept"
        assert (box.scratch / "data.txt").stat().st_uid == box.uid
        # ... and only for that sandbox.
        run = await other.run("import os; print(os.listdir('.'))")
        assert run.stdout == "[]\n"
        assert other.uid != box.uid and other.scratch != box.scratch


async def test_the_tool_reports_runs_and_refuses_bad_arguments(tmp_path: Path):
    limits = PyToolConfig(timeout_s=2.0, max_output_bytes=64, scratch_root=tmp_path)
    tool = PythonTool(limits, max_code_bytes=1000)
    try:
        assert isinstance(tool, Tool)
        assert tool.spec.openai()["function"]["name"] == "python"
        assert tool.spec.parameters["required"] == ["code"]
        assert await tool({"code": "print(6 * 7)"}) == "42"
        assert await tool({"code": "x = 1"}) == "(no output)"
        text = await tool({"code": "import sys\nprint('out')\nsys.exit('boom')"})
        assert text == "out\nboom\n[exit code 1]"
        assert await tool({"code": "print('y' * 100)"}) == \
            "y" * 64 + "\n[output truncated at 64 bytes]"
        text = await tool({"code": "import time\nprint('a')\ntime.sleep(60)"})
        assert text == "a\n[killed: time limit of 2 s]"
        # Two calls at once (the model's parallel tool calls) both run, one after the other.
        texts = await asyncio.gather(tool({"code": "print(1)"}), tool({"code": "print(2)"}))
        assert texts == ["1", "2"]

        for bad, message in (({}, "missing required argument"),
                             ({"code": 1}, "must be a string"),
                             ({"code": "1", "timeout": 5}, "unknown argument"),
                             ({"code": "#" * 1001}, "over the limit of 1000"),
                             ("print(1)", "must be a JSON object")):
            with pytest.raises(ToolError, match=message):
                await tool(bad)
    finally:
        await tool.close()
    assert not tool.sandbox.scratch.exists()
    await tool.close()  # idempotent
    with pytest.raises(ToolUnavailable, match="closed"):
        await tool({"code": "print(1)"})


def test_format_run_says_how_a_run_ended():
    limits = PyToolConfig(memory_mb=128)
    run = SandboxRun(stdout="", stderr="MemoryError\n", returncode=None, killed="memory",
                     duration_s=0.1, truncated=False)
    assert format_run(run, limits) == "MemoryError\n[killed: memory limit of 128 MB]"


def test_a_missing_bubblewrap_is_named_with_its_package(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no bwrap on PATH
    with pytest.raises(ToolUnavailable, match=r"bwrap.*bubblewrap"):
        PythonSandbox(LIMITS.model_copy(update={"scratch_root": tmp_path}))
    problem = sandbox_problem()
    assert problem is not None and "bubblewrap" in problem
    assert list(tmp_path.iterdir()) == []  # no scratch directory was left


# ---------------------------------------------------------------------- what it cannot reach


async def test_host_files_are_out_of_reach(box: PythonSandbox, tmp_path: Path, monkeypatch):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    monkeypatch.setenv("CUA_SANDBOX_TEST_SECRET", "s3cr3t")
    me = os.getpid()
    targets = ["/etc/passwd", "/etc/hostname", "/root", "/home", "/var/log", "/run",
               "/sys/kernel", str(REPO_ROOT / "pyproject.toml"), str(Path(__file__)),
               str(REPO_ROOT), str(secret), str(box.scratch), f"/proc/{me}/environ",
               f"/proc/{me}/cmdline", f"/proc/{me}/root/etc/passwd", "/proc/1/environ",
               "/proc/1/root/etc/passwd", "/usr/local/bin"]
    # The host itself reaches every one of them, so a refusal below is the sandbox's doing.
    for target in targets:
        assert target.startswith("/proc/1/") or Path(target).exists(), target
    code = (
        "import os, sys\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        got = os.listdir(path) if os.path.isdir(path) else open(path).read(64)\n"
        "        print('READ', path, repr(got)[:80])\n"
        "    except OSError as exc:\n"
        "        print('refused', path, type(exc).__name__)\n"
        "for path in ('/usr/evil', '/evil', '/proc/sys/kernel/hostname'):\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('WROTE', path)\n"
        "    except OSError as exc:\n"
        "        print('refused', path, type(exc).__name__)\n"
        "print(sorted(os.listdir('/')))\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "print(sorted(os.environ))\n")
    lines = await printed(box, code)
    assert not [line for line in lines if line.startswith(("READ", "WROTE"))], lines
    assert len([line for line in lines if line.startswith("refused")]) == len(targets) + 3
    assert lines[-3] == str(sorted(["bin", "dev", "lib", "lib64", "proc", "sbin", "scratch",
                                    "tmp", "usr"]))
    # Its own pid namespace: the interpreter and bwrap's init, nothing of the host.
    assert max(eval(lines[-2])) < 10
    # A fresh environment: nothing of the runner's (its keys included).
    assert eval(lines[-1]) == ["HOME", "LANG", "LOGNAME", "PATH", "PWD", "TMPDIR", "USER"]
    assert not Path("/usr/evil").exists() and not Path("/evil").exists()


async def test_no_network(box: PythonSandbox):
    tcp = socket.create_server(("127.0.0.1", 0))
    tcp.setblocking(False)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.setblocking(False)
    name = f"\0cua-sandbox-test-{secrets.token_hex(4)}"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(name)
    unix.listen()
    unix.setblocking(False)
    outside = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
               if a.family == socket.AF_INET and not a.address.startswith("127.")]
    wide = socket.create_server((outside[0], 0)) if outside else None
    try:
        tcp_port, udp_port = tcp.getsockname()[1], udp.getsockname()[1]
        code = (
            "import socket\n"
            "def attempt(what, fn):\n"
            "    try:\n"
            "        fn()\n"
            "        print('OK', what)\n"
            "    except OSError as exc:\n"
            "        print('failed', what, type(exc).__name__)\n"
            f"attempt('tcp', lambda: socket.create_connection(('127.0.0.1', {tcp_port}), 3))\n"
            "attempt('dns', lambda: socket.getaddrinfo('pypi.org', 443))\n"
            f"u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"u.sendto(b'query', ('127.0.0.1', {udp_port}))\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            f"attempt('unix', lambda: s.connect({name!r}))\n"
            + (f"attempt('wide', lambda: socket.create_connection(({outside[0]!r}, "
               f"{wide.getsockname()[1]}), 3))\n" if wide else "")
            + "print('interfaces', [n for _, n in socket.if_nameindex()])\n")
        lines = await printed(box, code)
        assert not [line for line in lines if line.startswith("OK")], lines
        assert "failed tcp ConnectionRefusedError" in lines
        assert "failed dns gaierror" in lines
        assert "failed unix ConnectionRefusedError" in lines
        assert lines[-1] == "interfaces ['lo']"
        await asyncio.sleep(0.2)
        for listener in (tcp, unix):
            with pytest.raises(BlockingIOError):  # nothing ever connected
                listener.accept()
        with pytest.raises(BlockingIOError):  # the datagram never arrived
            udp.recvfrom(64)
        # The listeners work: the host reaches them.
        with socket.create_connection(("127.0.0.1", tcp_port), 3):
            pass
        await asyncio.sleep(0.05)
        tcp.accept()[0].close()
    finally:
        for sock in (tcp, udp, unix, wide):
            if sock is not None:
                sock.close()


async def test_the_system_call_filter_refuses_namespaces_and_kernel_reach(box: PythonSandbox):
    """The seccomp filter (cua_rollout.text.seccomp): a nested user namespace (which let a snippet
    mount a tmpfs no limit counts), mounts, ptrace, the key store, bpf and anonymous memory
    files are refused, with the call and the unshare command alike; threads, processes,
    pools, POSIX shared memory and ctypes callbacks still work."""
    code = (
        "import ctypes, errno, multiprocessing, subprocess, threading\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def refused(what, result):\n"
        "    print(what, result, errno.errorcode.get(ctypes.get_errno()))\n"
        "refused('unshare-user', libc.unshare(0x10000000))\n"
        "refused('unshare-mount', libc.unshare(0x00020000))\n"
        "refused('unshare-net', libc.unshare(0x40000000))\n"
        "refused('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))\n"
        "refused('ptrace', libc.ptrace(16, 1, 0, 0))\n"  # PTRACE_ATTACH to the sandbox init
        "refused('keyctl', libc.syscall(250, 0, 0, 0, 0))\n"  # keyctl(GET_KEYRING_ID)
        "refused('bpf', libc.syscall(321, 0, 0, 0))\n"
        "refused('memfd', libc.syscall(319, b'x', 0))\n"  # memfd_create
        "cmp = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int),\n"
        "                       ctypes.POINTER(ctypes.c_int))(lambda a, b: a[0] - b[0])\n"
        "numbers = (ctypes.c_int * 4)(3, 1, 4, 2)\n"
        "libc.qsort(numbers, 4, ctypes.sizeof(ctypes.c_int), cmp)\n"
        "print('callback sorted', list(numbers))\n"
        "from multiprocessing import shared_memory\n"
        "shared = shared_memory.SharedMemory(create=True, size=4096)\n"
        "shared.close(); shared.unlink(); print('shared memory made')\n"
        "done = subprocess.run(['unshare', '-Ur', 'true'], capture_output=True, text=True)\n"
        "print('unshare-command', done.returncode, done.stderr.strip())\n"
        "t = threading.Thread(target=print, args=('thread ran',)); t.start(); t.join()\n"
        "print(subprocess.run(['echo', 'child ran'], capture_output=True, text=True)"
        ".stdout.strip())\n"
        "with multiprocessing.Pool(2) as pool:\n"
        "    print('pool', pool.map(abs, [-1, -2]))\n")
    lines = await printed(box, code)
    for what in ("unshare-user", "unshare-mount", "unshare-net", "mount", "ptrace", "keyctl",
                 "bpf"):
        assert f"{what} -1 EPERM" in lines, lines
    assert "memfd -1 ENOSYS" in lines  # anonymous memory files: no rlimit counts them
    assert {"callback sorted [1, 2, 3, 4]", "shared memory made"} <= set(lines)
    assert "unshare-command 1 unshare: unshare failed: Operation not permitted" in lines
    assert lines[-3:] == ["thread ran", "child ran", "pool [1, 2]"]


# ---------------------------------------------------------------------- runaway snippets


async def test_an_endless_loop_is_killed_at_its_timeout(tmp_path: Path):
    limits = PyToolConfig(timeout_s=2.0)
    async with opened(tmp_path, limits) as box, LoopLag() as lag:
        with runner_unchanged():
            run = await box.run("print('started')\nwhile True:\n    pass\n")
        assert run.killed == "timeout" and run.returncode is None
        assert run.stdout == "started\n"  # what it printed before is kept
        assert 2.0 <= run.duration_s < 2.0 + SLACK_S
        assert uid_processes(box.uid) == []
        assert (await box.run("print('next')")).stdout == "next\n"  # the sandbox goes on
    assert lag.worst < 1.0  # the runner's event loop was never blocked


async def test_a_killed_snippet_leaves_no_process_behind(tmp_path: Path):
    limits = PyToolConfig(timeout_s=4.0)
    code = (
        "import os, signal, subprocess, time\n"
        "subprocess.Popen(['sleep', '1000'])\n"
        "subprocess.Popen(['sh', '-c', 'sleep 1001 & sleep 1002'], start_new_session=True)\n"
        "if os.fork() == 0:\n"  # a daemon: double fork, own session, deaf to TERM and HUP
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "        signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
        "        time.sleep(1000)\n"
        "    os._exit(0)\n"
        "print('ready', flush=True)\n"
        "time.sleep(1000)\n")
    async with opened(tmp_path, limits) as box:
        with runner_unchanged():
            # The suite's background harnesses are children of this process too: only what
            # this run starts (its direct children, new since now, and theirs) is its tree.
            earlier = {proc.pid for proc in psutil.Process().children()}
            task = asyncio.create_task(box.run(code))
            seen: dict[int, psutil.Process] = {}

            def tree_up() -> bool:
                for proc in uid_processes(box.uid):
                    seen.setdefault(proc.pid, proc)
                return len(seen) >= 6  # python, sleep, sh, sleep x2, daemon

            await until(tree_up, timeout_s=limits.timeout_s)
            descendants = [proc for child in psutil.Process().children()
                           if child.pid not in earlier
                           for proc in (child, *child.children(recursive=True))]
            groups = {proc.pid: os.getpgid(proc.pid) for proc in seen.values()}
            assert descendants  # bwrap at least
            run = await task
        assert run.killed == "timeout" and run.stdout == "ready\n"
        # Everything the snippet started, and bwrap itself, is gone the moment run() returns.
        assert [p.pid for p in seen.values() if not gone(p)] == []
        assert [p.pid for p in descendants if not gone(p)] == []
        assert [g for g in set(groups.values()) if not group_empty(g)] == []
        assert uid_processes(box.uid) == []

        # A snippet that ends on its own takes its background processes with it too, by the
        # time run() returns (bwrap reports the exit before the namespace is torn down).
        for _ in range(5):
            run = await box.run("import subprocess\n"
                                "subprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
                                "print('left a sleeper')")
            assert run.returncode == 0 and run.killed is None
            assert uid_processes(box.uid) == []


async def test_a_cancelled_or_closed_call_kills_its_processes(tmp_path: Path):
    code = "import subprocess, time\nsubprocess.Popen(['sleep', '1000'])\ntime.sleep(1000)"
    async with opened(tmp_path) as box:
        task = asyncio.create_task(box.run(code))
        await until(lambda: len(uid_processes(box.uid)) >= 2, timeout_s=SLACK_S)
        task.cancel()  # what a tool timeout of the environment does
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: uid_processes(box.uid) == [], timeout_s=SLACK_S)
        assert (await box.run("print('still usable')")).stdout == "still usable\n"

        task = asyncio.create_task(box.run(code))
        await until(lambda: len(uid_processes(box.uid)) >= 2, timeout_s=SLACK_S)
        await box.close()
        with pytest.raises(ToolUnavailable, match="closed"):
            await task
        assert uid_processes(box.uid) == []
        assert not box.scratch.exists()


# (code, endless): an endless bomb never ends by itself, so only our kill stops it; the naive
# one may also end when its main process dies of the refused fork.
FORK_BOMBS = [
    ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
     "        pass\n", True),
    ("import os\nwhile True:\n    os.fork()\n", False),
    ("import subprocess\nsubprocess.run(['sh', '-c', 'f() { f | f & }; f; sleep 60'])\n",
     True),
]


async def test_a_fork_bomb_is_contained(tmp_path: Path):
    limits = PyToolConfig(timeout_s=20.0, max_processes=16)
    async with opened(tmp_path, limits) as box:
        for code, endless in FORK_BOMBS:
            most = 0
            with runner_unchanged():
                task = asyncio.create_task(box.run(code))
                while not task.done():  # the most processes (threads) it had at once
                    with contextlib.suppress(psutil.Error):
                        most = max(most, sum(p.num_threads() for p in uid_processes(box.uid)
                                             if not gone(p)))
                    await asyncio.sleep(0.01)
                run = await task
            assert run.killed == "processes", (run.stderr[-300:], code)
            if endless:
                assert run.returncode is None  # we killed it
            assert run.duration_s < 10.0  # stopped at the limit, not at the 20 s timeout
            assert most <= limits.max_processes
            assert uid_processes(box.uid) == []


async def test_sandboxes_do_not_share_a_process_budget(tmp_path: Path):
    limits = PyToolConfig(timeout_s=20.0, max_processes=8)
    spawn = ("import subprocess, sys, time\n"
             "kids = [subprocess.Popen(['sleep', '30']) for _ in range(6)]\n"
             "print('six', flush=True)\n"
             "time.sleep(float(open('hold').read()))\n")
    async with opened(tmp_path, limits) as a, opened(tmp_path, limits) as b:
        (a.scratch / "hold").write_text("3")
        holding = asyncio.create_task(a.run(spawn))
        await until(lambda: len(uid_processes(a.uid)) >= 7, timeout_s=SLACK_S)
        (b.scratch / "hold").write_text("0")
        run = await b.run(spawn)  # 7 of its 8 while a holds 7 of its own
        assert run.stdout == "six\n" and run.killed is None, run.stderr
        assert not holding.done()
        assert (await holding).stdout == "six\n"


async def test_memory_hogs_are_stopped(tmp_path: Path):
    limits = PyToolConfig(timeout_s=20.0, memory_mb=128)
    async with opened(tmp_path, limits) as box:
        with runner_unchanged():
            run = await box.run("x = bytearray(1 << 30)\n")
            assert run.killed == "memory" and "MemoryError" in run.stderr
            run = await box.run("hog = []\nwhile True:\n    hog.append(bytearray(1 << 20))\n")
            assert run.killed == "memory" and run.duration_s < 10.0
            # One process under the limit is fine.
            run = await box.run("x = bytearray(64 << 20)\nprint(len(x))")
            assert run.stdout == f"{64 << 20}\n" and run.killed is None
        assert uid_processes(box.uid) == []
    if _cgroup_v1_memory():
        # With a memory cgroup the whole sandbox is held: 4 x 64 MB > 128 MB.
        async with opened(tmp_path, limits) as box:
            run = await box.run(
                "import os\n"
                "for _ in range(4):\n"
                "    if os.fork() == 0:\n"
                "        x = bytearray(64 << 20)\n"
                "        for i in range(0, len(x), 4096):\n"
                "            x[i] = 1\n"
                "        import time; time.sleep(2)\n"
                "        os._exit(0)\n"
                "print([os.wait()[1] for _ in range(4)])\n")
            assert run.killed == "memory", (run.stdout, run.stderr)
            assert "9" in run.stdout  # the kernel's OOM killer took a child (SIGKILL)


def _cgroup_v1_memory() -> bool:
    """This machine has the cgroup v1 memory and pids hierarchies (CI's VM does)."""
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    kinds = {opt for line in mounts if line.split()[2] == "cgroup"
             for opt in line.split()[3].split(",")}
    return os.geteuid() == 0 and {"memory", "pids"} <= kinds


async def test_huge_output_is_cut_and_a_flood_is_killed(tmp_path: Path):
    limits = PyToolConfig(timeout_s=20.0, max_output_bytes=4096)
    async with opened(tmp_path, limits) as box:
        with runner_unchanged():
            run = await box.run("print('x' * 10000)")  # over the cap, under the kill line
            assert run.returncode == 0 and run.killed is None and run.truncated
            assert run.stdout == "x" * 4096
            for stream in ("stdout", "stderr"):
                run = await box.run(f"import sys\nwhile True:\n    sys.{stream}.write('z' * 999)")
                assert run.killed == "output" and run.truncated and run.returncode is None
                assert getattr(run, stream) == "z" * 4096
                assert run.duration_s < 10.0
            # 300 MB in one write: read in chunks and dropped, never held by the runner.
            run = await box.run("import sys\nsys.stdout.buffer.write(b'w' * (300 << 20))",)
            assert run.killed == "output" and len(run.stdout) == 4096
        assert uid_processes(box.uid) == []


async def test_file_size_tmp_and_scratch_limits(tmp_path: Path):
    limits = PyToolConfig(timeout_s=20.0, max_file_mb=4, tmp_mb=8, max_scratch_mb=32,
                           max_scratch_files=200)
    async with opened(tmp_path, limits) as box:
        run = await box.run("open('big', 'wb').write(b'b' * (8 << 20))")
        assert "File too large" in run.stderr and run.returncode == 1
        assert (box.scratch / "big").stat().st_size <= 4 << 20
        run = await box.run("for i in range(4):\n"
                            "    open(f'/tmp/t{i}', 'wb').write(b't' * (3 << 20))\n")
        assert "No space left on device" in run.stderr  # /tmp holds 8 MB
        (box.scratch / "big").unlink()

        # Many files each under the size limit: the scratch directory's limit stops them.
        run = await box.run("i = 0\nwhile True:\n"
                            "    open(f'f{i}', 'wb').write(b'f' * (3 << 20))\n    i += 1\n")
        assert run.killed == "disk" and run.duration_s < 10.0
        used = sum(p.stat().st_size for p in box.scratch.iterdir())
        assert used < 2 << 30  # bounded by the check's period, not by the 20 s timeout
        for path in box.scratch.iterdir():
            path.unlink()
        run = await box.run("i = 0\nwhile True:\n    open(f'e{i}', 'w').close()\n    i += 1\n")
        assert run.killed == "disk" and run.duration_s < 10.0


def test_snippets_run_under_uvloop_as_ray_runs_them_and_close_each_pipe_once(tmp_path: Path):
    """Ray's actors run on uvloop: snippets there read their output through
    ``core.aio.pipe_reader`` (uvloop's connect_read_pipe closed each pipe twice, and a rag
    corpus opened by another thread meanwhile lost its descriptor: EBADF). A file another
    thread keeps reading while snippets run is never disturbed, and no descriptor leaks."""
    import threading

    import uvloop

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("passage\n" * 10_000)
    stop = threading.Event()
    errors: list[OSError] = []

    def reads() -> None:  # as the rag tool's thread reads its corpus
        while not stop.is_set():
            try:
                assert corpus.read_text().count("passage") == 10_000
            except OSError as exc:
                errors.append(exc)

    def descriptors() -> int:  # but the corpus the other thread may have open now
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                count += os.readlink(f"/proc/self/fd/{fd}") != str(corpus)
        return count

    async def main() -> list[str]:
        async with opened(tmp_path / "box") as box:
            # The first snippet starts what the loop keeps (uvloop's signal handling).
            lines = await printed(box, "print(0)")
            before = descriptors()
            for n in range(1, 7):
                lines += await printed(box, f"print({n} * 7)")
            assert descriptors() == before, "a descriptor leaked"
            return lines

    (tmp_path / "box").mkdir()
    reader = threading.Thread(target=reads)
    reader.start()
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            lines = runner.run(main())
    finally:
        stop.set()
        reader.join()
    assert lines == ["0", *(str(n * 7) for n in range(1, 7))]
    assert errors == []
