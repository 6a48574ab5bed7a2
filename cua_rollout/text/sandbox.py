"""The ``py`` text environment's Python tool: each call runs a snippet in a sandbox of its own.

One :class:`PythonSandbox` per episode owns a scratch directory and a uid of its own; each
:meth:`PythonSandbox.run` starts a fresh ``/usr/bin/python3`` (the system's interpreter, standard
library only) inside a bubblewrap sandbox, feeds it the snippet on stdin and returns what it
printed (:class:`SandboxRun`). :class:`PythonTool` is the ``python`` tool the model calls
(``cua_rollout.envs.tools.Tool``); :func:`sandbox_problem` tells at run start whether this machine
can run the sandbox at all.

What a snippet sees and may do
------------------------------

- **Its own namespaces** (``bwrap --unshare-pid --unshare-net --unshare-ipc --unshare-uts
  --unshare-cgroup``): its processes are alone in a pid namespace (``/proc`` shows nothing of
  the host), its network is a loopback of its own (no route anywhere, no DNS: a connection to a
  server on the host's 127.0.0.1 is refused), no System V IPC or hostname of the host's.
- **Only these files**: ``/usr`` read-only (``/usr/local`` hidden under an empty tmpfs) with the
  ``/bin``, ``/lib*`` links of a merged-/usr system, a fresh ``/proc`` and ``/dev`` (null, zero,
  random, tty ...), an in-memory ``/tmp`` and ``/dev/shm`` of ``tmp_mb`` each, and the episode's
  scratch directory at ``/scratch`` (read-write, the working directory and ``HOME``). No
  ``/etc``, ``/root``, ``/home``, ``/work``, ``/sys``, ``/run`` or host ``/tmp``; every mount is
  ``nosuid``. Files written in ``/scratch`` stay for the episode's later calls; everything else
  (variables, ``/tmp``, background processes) ends with the call. The environment is rebuilt
  from scratch (``PATH``, ``HOME``, ``LANG``, ``TMPDIR``): nothing of the runner's, keys
  included, reaches the snippet.
- **An unprivileged uid of its own**: bwrap runs as root (it makes the namespaces and mounts),
  then ``setpriv`` switches the snippet to a uid and gid picked at random for the sandbox in
  [2^30, 2^31) (one no host process uses), with no supplementary groups, every capability
  dropped (bounding set included) and ``no_new_privs``.
- **A system call filter** (seccomp, ``cua_rollout.text.seccomp``, loaded by bwrap before
  ``setpriv``): no new namespaces (a nested user namespace included), mounts, ptrace, kernel
  modules, bpf, io_uring, the key store, ``memfd_create`` or the machine's clocks and names;
  everything a Python program ordinarily does (threads, subprocesses, multiprocessing and its
  shared memory, ctypes callbacks) is allowed.

Limits (``PyToolConfig``, the ``text.py`` section of the config), and how each is enforced
--------------------------------------------------------------------------------------------

- ``timeout_s``: wall clock of the call, watched here; past it the whole sandbox is killed
  (``killed="timeout"``). ``RLIMIT_CPU`` (``timeout_s`` + 1 s of CPU per process, then
  SIGXCPU) backs it up.
- ``memory_mb``: ``RLIMIT_AS`` and ``RLIMIT_DATA`` of every process (an allocation past it
  raises ``MemoryError``), and, where cgroups v1 allow (below), a memory cgroup holding the
  whole sandbox to ``memory_mb`` in total (``/tmp`` included), whose OOM kills are counted.
  Reported as ``killed="memory"`` when the snippet died of ``MemoryError`` or of that OOM killer.
- ``max_processes``: ``RLIMIT_NPROC`` of the snippet's uid, counted per uid by the kernel and
  so per sandbox (threads count too). A run whose process tree reaches the limit (a fork bomb)
  is killed at once (``killed="processes"``) rather than left to spin until its timeout. Where
  there is a pids cgroup, its ``pids.max`` is the limit that refuses first (the rlimit is one
  above, as a backstop) and its count of refusals kills the run as soon as one is seen; without
  it, a refused fork on stderr (Python's ``BlockingIOError``, the shells' ``Cannot fork``)
  also reports ``processes`` after the run.
- ``max_output_bytes``: stdout and stderr are read as they come and the first
  ``max_output_bytes`` of each are kept (``truncated``); a snippet that writes more than
  ``OUTPUT_KILL_FACTOR`` (8) times that on one stream is killed (``killed="output"``), so a
  ``while True: print()`` never fills our memory.
- ``max_file_mb``: ``RLIMIT_FSIZE`` (a larger write fails with ``EFBIG``).
- ``max_scratch_mb`` / ``max_scratch_files``: the scratch directory's size and number of entries,
  looked at every ``SCRATCH_POLL_S`` during a run; past either the run is killed
  (``killed="disk"``), so a snippet cannot fill the runner's disk with many files below
  ``max_file_mb``.
- :data:`MAX_OPEN_FILES`: ``RLIMIT_NOFILE``; ``RLIMIT_CORE`` is 0.

Killing: a killed run's sandbox init (bwrap's pid 1 of the namespace, signalled through a pidfd
so a reused pid is never hit) gets SIGKILL, and the kernel kills every process of the pid
namespace with it, however it was started (``setsid``, double fork); bwrap outside then exits.
If bwrap itself does not, its process group is killed too; ``--die-with-parent`` kills the
sandbox if the runner dies. A run ending normally takes its background processes with it the
same way: bwrap exits as soon as the snippet's main process has, and its init, dying with it,
takes the namespace down a few milliseconds later. Either way :meth:`PythonSandbox.run` returns
only once no process of the sandbox's uid is left (looked up in ``/proc``, in a thread), so
nothing a call started outlives it. A cancelled call (the environment's tool timeout) is killed
synchronously in the same way, without that wait.

Why bubblewrap (measured on the 2-core CI VM under background load, medians of 15 calls of
``pass``): bare ``/usr/bin/python3 -I -c pass`` takes ~10 ms; a whole :meth:`PythonSandbox.run`
(bwrap, setpriv, the bootstrap, teardown) ~26 ms, ~38 ms with the cgroups; ``podman run
--runtime runc --network none --pids-limit --memory --read-only`` of a Debian image ~160-200 ms,
and ``podman exec`` into a running container 130 ms to 1.8 s. With a process per tool call,
podman's cost is the model's wait; bwrap needs no image and gives the same isolation.

Why bwrap runs as root and ``setpriv`` drops to a uid, rather than an unprivileged bwrap: as
root, ``bwrap --unshare-user --uid 65534`` maps the sandbox's uid to host uid 0, and the kernel
never applies ``RLIMIT_NPROC`` to uid 0 (measured: 100 forks under a limit of 32 all succeed);
run as an unprivileged user, bwrap can only bind a scratch directory every ancestor of which
that user may search (``mkdtemp``'s and pytest's directories are 0700) and needs unprivileged
user namespaces. Root bwrap plus a uid of the sandbox's own has neither problem (measured: the
32nd process under a limit of 32 is refused, and two sandboxes at once each get their 32). So
the sandbox needs root (:func:`sandbox_problem` says so otherwise), ``bwrap`` (Debian
``bubblewrap``), ``setpriv`` (``util-linux``), libseccomp (``libseccomp2``) and
``/usr/bin/python3`` (``python3``).

Memory that is not address space: ``memfd_create`` is refused by the filter (a snippet could
otherwise hold :data:`MAX_OPEN_FILES` x ``max_file_mb`` of anonymous files per process, counted by
no rlimit); ``/tmp`` and ``/dev/shm`` (POSIX shared memory, multiprocessing's semaphores) are
tmpfs mounts of ``tmp_mb`` each. Not done: the scratch directory's limits are checked by
polling, so a run may overshoot them by what it writes in ``SCRATCH_POLL_S``.

cgroups (a bonus, never required): where the runner is root and the cgroup v1 ``memory`` and
``pids`` hierarchies are mounted and writable, each run gets a child of the runner's own cgroup
in each (``memory.limit_in_bytes`` = ``memory_mb``, ``pids.max``), joined by a ``sh`` that then
execs bwrap (so nothing escapes before it is in). Without them (cgroups v2 only, no permission)
the rlimits alone apply: the memory of a run is then bounded by ``memory_mb`` per process, that
is ``max_processes`` x ``memory_mb`` in total.

Runs of one sandbox are serialized (a lock): the model's parallel calls run one after the other,
each with its own timeout, and share the scratch directory safely.

One file on purpose: it is a security boundary (namespaces, mounts, limits, cgroup,
clean-up), reviewed as a whole; its system call filter is seccomp.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cua_rollout.config import PyToolConfig
from cua_rollout.core.aio import pipe_reader
from cua_rollout.core.errors import ToolError, ToolUnavailable
from cua_rollout.envs.tools import ToolSpec, check_arguments
from cua_rollout.text.seccomp import filter_fd

__all__ = [
    "KILL_REASONS",
    "MAX_CODE_BYTES",
    "MAX_OPEN_FILES",
    "OUTPUT_KILL_FACTOR",
    "SANDBOX_PYTHON",
    "SCRATCH_POLL_S",
    "PythonSandbox",
    "PythonTool",
    "SandboxRun",
    "format_run",
    "sandbox_problem",
]

log = logging.getLogger(__name__)

SANDBOX_PYTHON = "/usr/bin/python3"
"""The interpreter inside the sandbox: the system's (Debian ``python3``), standard library only."""
OUTPUT_KILL_FACTOR = 8
"""A snippet writing more than this many times ``max_output_bytes`` on a stream is killed."""
SCRATCH_POLL_S = 0.5
"""How often the scratch directory's size is looked at during a run."""
KILL_REASONS = ("timeout", "memory", "output", "processes", "disk")
"""The values of :attr:`SandboxRun.killed` besides ``None``."""
MAX_OPEN_FILES = 256
"""Open file descriptors per process of a snippet (``RLIMIT_NOFILE``)."""
MAX_CODE_BYTES = 100_000
"""Longest snippet :class:`PythonTool` accepts unless told otherwise (UTF-8 bytes)."""

_POLL_S = 0.1  # how often a running snippet's deadline and process count are looked at
_READ_CHUNK = 65536
_TAIL_BYTES = 2048  # end of each stream kept to tell how the snippet died
_EXIT_WAIT_S = 3.0  # after SIGKILL of the sandbox init: until bwrap is killed too
_PIPE_WAIT_S = 5.0  # after bwrap exited: until its output pipes must be at their end
_UID_BASE = 1 << 30
_UID_SPAN = (1 << 31) - _UID_BASE - 1
_SCRATCH = "/scratch"  # the scratch directory's path inside the sandbox
_SNIPPET = "<snippet>"
# Written first by the bootstrap: its presence on stdout proves the sandbox started.
_MARKER = b"\x00cua-sandbox-started\x00"
# What a refused fork leaves on stderr (Python, dash, bash), where no pids cgroup counts them.
_FORK_REFUSED = (b"BlockingIOError: [Errno 11]", b"Cannot fork", b"fork: retry",
                 b"fork: Resource temporarily unavailable", b"can't start new thread")
_HOST_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
_INSTALL = {"bwrap": "bubblewrap", "setpriv": "util-linux", "python3": "python3"}

# Run by the sandbox's interpreter (any Python 3.6+): the limits, then the snippet read from
# stdin as ``__main__``, its traceback printed without this code's frames. ``-I`` keeps the
# scratch directory off the import path until the limits are set and the bootstrap's own
# imports are done (a ``resource.py`` left there by an earlier call must not run first).
_BOOTSTRAP = r"""
import os, resource, sys
os.write(1, MARKER)
lim = [int(x) for x in sys.argv[1:]]
for res, soft, hard in (
        (resource.RLIMIT_AS, lim[0], lim[0]), (resource.RLIMIT_DATA, lim[0], lim[0]),
        (resource.RLIMIT_CPU, lim[1], lim[1] + 1), (resource.RLIMIT_FSIZE, lim[2], lim[2]),
        (resource.RLIMIT_NPROC, lim[3], lim[3]), (resource.RLIMIT_NOFILE, lim[4], lim[4]),
        (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(res, (soft, hard))
source = sys.stdin.buffer.read()
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
import linecache, traceback, types
text = source.decode("utf-8", "replace")
linecache.cache[NAME] = (len(text), None, text.splitlines(True), NAME)
main = types.ModuleType("__main__")
main.__builtins__ = __builtins__
sys.modules["__main__"] = main
sys.argv = [""]
sys.path.insert(0, "")  # the snippet's imports see its own files (-I left them out)
try:
    exec(compile(source, NAME, "exec"), main.__dict__)
except SystemExit:
    raise
except BaseException as exc:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != NAME:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)
    sys.exit(1)
""".replace("MARKER", repr(_MARKER)).replace("NAME", repr(_SNIPPET))


@dataclass(frozen=True)
class SandboxRun:
    """What one call of a snippet left."""

    stdout: str
    """The first ``max_output_bytes`` of its stdout (decoded as UTF-8, errors replaced)."""
    stderr: str
    """Same, of its stderr (a traceback, if it raised)."""
    returncode: int | None
    """Its exit status (128 + n for a death by signal n); ``None`` when we killed it."""
    killed: str | None
    """``None``, or the limit it ran into, one of :data:`KILL_REASONS`: we killed it there, or
    it died of it (``MemoryError``, CPU time), or some of its processes were refused or killed
    there (a fork bomb that ended by itself, a child taken by the OOM killer)."""
    duration_s: float
    """Wall clock of the call, sandbox start and teardown included."""
    truncated: bool
    """Either stream was longer than ``max_output_bytes``."""


def format_run(run: SandboxRun, limits: PyToolConfig) -> str:
    """A run as the model reads it: stdout, stderr, then a line saying how it ended."""
    parts = [text.rstrip("\n") for text in (run.stdout, run.stderr) if text]
    if not parts:
        parts.append("(no output)")
    if run.truncated:
        parts.append(f"[output truncated at {limits.max_output_bytes} bytes]")
    reasons = {
        "timeout": f"time limit of {limits.timeout_s:g} s",
        "memory": f"memory limit of {limits.memory_mb} MB",
        "output": f"wrote over {OUTPUT_KILL_FACTOR * limits.max_output_bytes} bytes of output",
        "processes": f"process limit of {limits.max_processes}",
        "disk": f"scratch directory over {limits.max_scratch_mb} MB or "
                f"{limits.max_scratch_files} files; delete files to go on",
    }
    if run.killed is not None:
        parts.append(f"[killed: {reasons.get(run.killed, run.killed)}]")
    elif run.returncode:
        parts.append(f"[exit code {run.returncode}]")
    return "\n".join(parts)


# ---------------------------------------------------------------------- the machine


def _binary(name: str) -> str:
    """The path of a host binary the sandbox needs; ``ToolUnavailable`` names its package."""
    path = SANDBOX_PYTHON if name == "python3" else shutil.which(name)
    if path is None or not os.access(path, os.X_OK):
        where = SANDBOX_PYTHON if name == "python3" else f"{name} (not on PATH)"
        raise ToolUnavailable(f"python sandbox: {where} is missing: install the Debian package "
                              f"{_INSTALL[name]} (apt-get install -y {_INSTALL[name]})")
    return path


def _root_links() -> list[str]:
    """bwrap arguments giving ``/bin``, ``/lib``... as on the host: links into ``/usr`` on a
    merged-/usr system, read-only binds otherwise."""
    args: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args


def _command(bwrap: str, setpriv: str, scratch: Path, uid: int, limits: PyToolConfig,
             cgroup_files: list[str], seccomp_fd: int) -> list[str]:
    """The argv of one call: [sh joining the cgroups,] bwrap, setpriv, the interpreter.
    ``seccomp_fd``: the system call filter (``cua_rollout.text.seccomp``), passed to the process."""
    tmp = str(limits.tmp_mb << 20)
    argv = [bwrap,
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr", "--tmpfs", "/usr/local", *_root_links(),
            "--proc", "/proc", "--dev", "/dev",
            "--perms", "1777", "--size", tmp, "--tmpfs", "/tmp",
            "--perms", "1777", "--size", tmp, "--tmpfs", "/dev/shm",
            "--bind", str(scratch), _SCRATCH, "--chdir", _SCRATCH,
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", _SCRATCH,
            "--setenv", "LANG", "C.UTF-8", "--setenv", "TMPDIR", "/tmp",
            "--setenv", "USER", "sandbox", "--setenv", "LOGNAME", "sandbox",
            "--seccomp", str(seccomp_fd),
            "--",
            setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
            SANDBOX_PYTHON, "-I", "-B", "-u", "-X", "utf8", "-c", _BOOTSTRAP,
            str(limits.memory_mb << 20), str(math.ceil(limits.timeout_s) + 1),
            str(limits.max_file_mb << 20),
            # With a pids cgroup, that refuses first (and counts it); the rlimit backs it up.
            str(limits.max_processes + (1 if cgroup_files else 0)),
            str(MAX_OPEN_FILES)]
    if not cgroup_files:
        return argv
    joins = " && ".join(f'echo $$ > "${i + 1}"' for i in range(len(cgroup_files)))
    script = f'{joins} && shift {len(cgroup_files)} && exec "$@"'
    return ["/bin/sh", "-c", script, "sh", *cgroup_files, *argv]


def sandbox_problem() -> str | None:
    """``None`` if the Python sandbox can run on this machine, else a one-line reason. Starts
    one sandbox (tens of milliseconds) to be sure: namespaces, mounts and uid switch work."""
    try:
        bwrap, setpriv = _binary("bwrap"), _binary("setpriv")
        _binary("python3")
    except ToolUnavailable as exc:
        return str(exc)
    if os.geteuid() != 0:
        return (f"the python sandbox starts bubblewrap as root (it then runs the snippet as an "
                f"unprivileged uid of its own); this process runs as uid {os.geteuid()}")
    if not Path(setpriv).resolve().is_relative_to("/usr"):
        return f"setpriv is at {setpriv}, outside /usr, which is all the sandbox sees"
    try:
        seccomp_fd = filter_fd()
    except (ToolUnavailable, OSError) as exc:
        return str(exc)
    with tempfile.TemporaryDirectory(prefix="cua-py-check-") as scratch:
        uid = _UID_BASE + secrets.randbelow(_UID_SPAN)
        os.chown(scratch, uid, uid)
        argv = _command(bwrap, setpriv, Path(scratch), uid, PyToolConfig(), [], seccomp_fd)
        try:
            done = subprocess.run(argv, input=b"print(6 * 7)", capture_output=True,
                                  timeout=60, env=_HOST_ENV, check=False,
                                  pass_fds=(seccomp_fd,))
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"a trial sandbox did not run: {exc}"
        finally:
            os.close(seccomp_fd)
    if done.stdout != _MARKER + b"42\n":
        err = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return (f"a trial sandbox failed (exit {done.returncode}): "
                f"{err[0] if err else 'no error message'}")
    return None


# ---------------------------------------------------------------------- cgroups (a bonus)


@functools.cache
def _cgroup_bases() -> dict[str, Path]:
    """The runner's own cgroup directory in each v1 hierarchy of ``memory`` and ``pids``."""
    own: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(","):
                if controller in ("memory", "pids"):
                    own[controller] = path
    bases: dict[str, Path] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            sep = fields.index("-")
            fstype, options = fields[sep + 1], fields[sep + 3].split(",")
            root, mountpoint = fields[3], fields[4]
            for controller in own:
                if fstype == "cgroup" and controller in options and controller not in bases:
                    relative = os.path.relpath(own[controller], root)
                    if not relative.startswith(".."):
                        bases[controller] = Path(mountpoint, relative).resolve()
    return bases


_cgroup_names = itertools.count()


@functools.cache
def _warn_no_cgroup(reason: str) -> None:
    log.warning("python sandbox: no cgroup for its calls (%s): memory is limited per process "
                "only (address space, file size)", reason)


class _Cgroup:
    """A memory and a pids cgroup (v1) of one call, children of the runner's own."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs

    @classmethod
    def create(cls, limits: PyToolConfig) -> _Cgroup | None:
        """The call's cgroups, or ``None`` where they cannot be made (not root, v2 only)."""
        bases = _cgroup_bases()
        if os.geteuid() != 0 or set(bases) != {"memory", "pids"}:
            _warn_no_cgroup("no cgroup v1 memory and pids hierarchies")
            return None
        name = f"cua-sandbox-{os.getpid()}-{next(_cgroup_names)}"
        made = cls({})
        try:
            for controller, base in bases.items():
                path = base / name
                path.mkdir()
                made.dirs[controller] = path
            memory = str(limits.memory_mb << 20)
            (made.dirs["memory"] / "memory.limit_in_bytes").write_text(memory)
            with contextlib.suppress(OSError):  # no swap accounting: nothing to limit
                (made.dirs["memory"] / "memory.memsw.limit_in_bytes").write_text(memory)
            # bwrap outside and the namespace's init are not the snippet's.
            (made.dirs["pids"] / "pids.max").write_text(str(limits.max_processes + 2))
            (made.dirs["pids"] / "pids.events").read_text()  # a kernel that counts refusals
        except OSError as exc:
            _warn_no_cgroup(str(exc))
            made.remove()
            return None
        return made

    def procs_files(self) -> list[str]:
        return [str(path / "cgroup.procs") for path in self.dirs.values()]

    def _counter(self, controller: str, filename: str, key: str) -> int:
        with contextlib.suppress(OSError, ValueError):
            for line in (self.dirs[controller] / filename).read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
        return 0

    def oom_kills(self) -> int:
        return self._counter("memory", "memory.oom_control", "oom_kill")

    def pids_refused(self) -> int:
        return self._counter("pids", "pids.events", "max")

    def remove(self) -> bool:
        """Remove the (empty) cgroups; ``False`` if one still has a process."""
        for controller, path in list(self.dirs.items()):
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                continue
            del self.dirs[controller]
        return not self.dirs


# ---------------------------------------------------------------------- processes


def _children(pid: int) -> list[int]:
    """The children of every thread of ``pid`` (empty if it is gone)."""
    out: list[int] = []
    with contextlib.suppress(OSError, ValueError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    return out


def _tasks(pid: int) -> int:
    """Threads of ``pid`` (0 if it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])


def _uid_of(pid: int) -> int | None:
    """The real uid of process ``pid`` (``None`` if it is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _uid_pids(uid: int) -> list[int]:
    """Every process of the host running as ``uid`` (~20 us a process: run in a thread).
    (Listing /proc once failed now and then with ENOTDIR: the signature of another thread
    closing this listing's descriptor and a file taking its number, which uvloop's pipe
    transports did (``core.aio.pipe_reader``); it is not retried any more.)"""
    return [int(name) for name in os.listdir("/proc")
            if name.isdigit() and _uid_of(int(name)) == uid]


def _kill_uid_pids(pids: list[int], uid: int) -> None:
    """SIGKILL those of ``pids`` that still run as ``uid``, through pidfds (never a reused
    pid: the uid is checked again once the pidfd holds the process)."""
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if _uid_of(pid) == uid:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pidfd)


def _scratch_over(path: Path, max_bytes: int, max_entries: int) -> bool:
    """Whether the directory tree holds more than ``max_bytes`` (allocated) or
    ``max_entries`` entries. Symlinks are not followed; stops as soon as it knows."""
    used, entries = 0, 0
    stack = [str(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    entries += 1
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    used += st.st_blocks * 512
                    if used > max_bytes or entries > max_entries:
                        return True
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except OSError:
            continue
    return False


class _Capture:
    """The head (up to ``limit`` bytes) and tail of one output stream, and its length."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.head = bytearray()
        self.tail = b""
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if len(self.head) < self.limit:
            self.head += chunk[: self.limit - len(self.head)]
        self.tail = (self.tail + chunk)[-_TAIL_BYTES:]

    def text(self) -> str:
        return self.head.decode("utf-8", "replace")

    def last_line(self) -> str:
        lines = self.tail.decode("utf-8", "replace").strip().splitlines()
        return lines[-1] if lines else ""


class _Call:
    """One running call: feeds the snippet, reads its output, watches its limits, kills it."""

    def __init__(self, proc: asyncio.subprocess.Process, limits: PyToolConfig,
                 scratch: Path, uid: int, cgroup: _Cgroup | None, started: float) -> None:
        self.proc = proc
        self.uid = uid
        self.limits = limits
        self.scratch = scratch
        self.cgroup = cgroup
        self.started = started
        self.stdout = _Capture(limits.max_output_bytes)
        self.stderr = _Capture(limits.max_output_bytes)
        self.bootstrapped = False
        self.killed: str | None = None
        self.init_pidfd: int | None = None
        self.init_pid: int | None = None

    # -- the namespace's init, the handle that kills everything

    def _find_init(self) -> int | None:
        """The sandbox's init (bwrap's only child, pid 1 of the namespace), once it exists."""
        if self.init_pid is not None or self.proc.returncode is not None:
            return self.init_pid
        for pid in _children(self.proc.pid):
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            # bwrap is our child and not reaped: its pid is its own, so a process whose parent
            # it is, is the init (the pidfd now pins that process, whatever happens to pids).
            if _parent(pid) == self.proc.pid:
                self.init_pid, self.init_pidfd = pid, pidfd
                break
            os.close(pidfd)
        return self.init_pid

    def kill(self, reason: str) -> None:
        """Stop the whole sandbox now (synchronous: also usable from a cancelled task)."""
        if self.killed is None:
            self.killed = reason
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # Process.wait() also waits for this pipe to close
        if self.proc.returncode is not None:
            return
        self._find_init()
        if self.init_pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.init_pidfd, signal.SIGKILL)
        else:  # not cloned yet: bwrap itself (its child, if any, dies with it)
            self._kill_bwrap()

    def _kill_bwrap(self) -> None:
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session and group

    def close(self) -> None:
        if self.init_pidfd is not None:
            os.close(self.init_pidfd)
            self.init_pidfd = None

    # -- watching

    def _process_count(self) -> int:
        """Processes and threads under the namespace's init (the snippet's, all of them)."""
        init = self._find_init()
        if init is None:
            return 0
        count, stack, seen = 0, _children(init), set()
        while stack:
            pid = stack.pop()
            if pid in seen:
                continue
            seen.add(pid)
            count += _tasks(pid)
            stack += _children(pid)
        return count

    async def _feed(self, source: bytes) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            stdin.write(source)
            await stdin.drain()
        stdin.close()

    async def _pump(self, stream: asyncio.StreamReader, capture: _Capture,
                    marked: bool) -> None:
        if marked:
            try:
                first = await stream.readexactly(len(_MARKER))
            except asyncio.IncompleteReadError as exc:
                capture.add(exc.partial)
                return
            if first != _MARKER:
                capture.add(first)
                return
            self.bootstrapped = True
        while chunk := await stream.read(_READ_CHUNK):
            capture.add(chunk)
            if capture.total > OUTPUT_KILL_FACTOR * capture.limit:
                self.kill("output")

    async def supervise(self, source: bytes, out_fd: int, err_fd: int) -> SandboxRun:
        """Feed, read and watch the call until it ends or is killed; ``out_fd`` and ``err_fd``
        are the read ends of its stdout and stderr pipes (closed here). Our own pipes rather
        than asyncio's: ``Process.wait()`` waits for asyncio's pipes to close, and we never
        wait on pipes something else might hold; read by ``core.aio.pipe_reader``, never
        ``connect_read_pipe``, which closes them twice under uvloop (the EBADF a rag or web
        tool of the same runner process saw)."""
        closers: list[Callable[[], None]] = []
        tasks: list[asyncio.Task[Any]] = []
        try:
            readers = []
            for fd in (out_fd, err_fd):
                reader, close = pipe_reader(fd)
                closers.append(close)
                readers.append(reader)
            feed = asyncio.create_task(self._feed(source))
            pumps = {asyncio.create_task(self._pump(readers[0], self.stdout, True)),
                     asyncio.create_task(self._pump(readers[1], self.stderr, False))}
            exited = asyncio.create_task(self.proc.wait())
            tasks += [feed, exited, *pumps]
            await self._watch(exited, tasks)
            await self._all_gone()
            # Everything that held the pipes died with the namespace: they end at once.
            await asyncio.wait(pumps, timeout=_PIPE_WAIT_S)
        finally:
            for task in tasks:
                task.cancel()
            for close in closers:
                close()
            for fd in (out_fd, err_fd)[len(closers):]:  # a pipe_reader that did not start
                os.close(fd)
        return self._result()

    async def _all_gone(self) -> None:
        """Until no process of the sandbox's uid is left. bwrap exits as soon as the snippet's
        main process has (its init reports that first), and the namespace is torn down just
        after, when the init dies with bwrap (``--die-with-parent``): a few milliseconds in
        which background processes still run. Killed here if they outlast ``_EXIT_WAIT_S``."""
        deadline = time.monotonic() + _EXIT_WAIT_S
        killed = False
        while pids := await asyncio.to_thread(_uid_pids, self.uid):
            if time.monotonic() > deadline:
                if killed:
                    log.warning("python sandbox: processes %s of uid %d outlived their "
                                "sandbox", pids, self.uid)
                    return
                _kill_uid_pids(pids, self.uid)
                killed, deadline = True, time.monotonic() + _EXIT_WAIT_S
            await asyncio.sleep(0.005)

    async def _watch(self, exited: asyncio.Task[int], tasks: list[asyncio.Task[Any]]) -> None:
        """Until bwrap has exited: the deadline, the process count, the scratch directory."""
        limits = self.limits
        deadline = self.started + limits.timeout_s
        next_disk = self.started + SCRATCH_POLL_S
        disk: asyncio.Task[bool] | None = None
        while not exited.done() and self.killed is None:
            now = time.monotonic()
            await asyncio.wait({exited}, timeout=max(0.0, min(_POLL_S, deadline - now)))
            if exited.done() or self.killed is not None:
                break
            now = time.monotonic()
            if now >= deadline:
                self.kill("timeout")
            elif self._process_count() >= limits.max_processes or (
                    self.cgroup is not None and self.cgroup.pids_refused()):
                self.kill("processes")
            elif disk is not None and disk.done():
                if disk.result():
                    self.kill("disk")
                disk = None
            elif disk is None and now >= next_disk:
                next_disk = now + SCRATCH_POLL_S
                disk = asyncio.create_task(asyncio.to_thread(
                    _scratch_over, self.scratch, limits.max_scratch_mb << 20,
                    limits.max_scratch_files))
                tasks.append(disk)
        if not exited.done():  # killed: the init is dying, and bwrap exits after it
            await asyncio.wait({exited}, timeout=_EXIT_WAIT_S)
            if not exited.done():
                log.warning("python sandbox: bwrap %d did not exit after its init was "
                            "killed; killing its group", self.proc.pid)
                self._kill_bwrap()
                await exited

    def _result(self) -> SandboxRun:
        returncode = self.proc.returncode
        killed = self.killed
        if not self.bootstrapped and killed is None:
            err = self.stderr.text().strip() or f"exit status {returncode}"
            raise ToolUnavailable(f"python sandbox did not start: {err[-500:]}")
        if killed is None:
            last = self.stderr.last_line()
            if (self.cgroup is not None and self.cgroup.oom_kills()) or (
                    returncode and last.startswith("MemoryError")):
                killed = "memory"  # died of MemoryError, or the OOM killer took a process
            elif (self.cgroup is not None and self.cgroup.pids_refused()) or any(
                    sign in self.stderr.tail for sign in _FORK_REFUSED):
                killed = "processes"  # forks were refused at the limit (and not caught)
            elif returncode == 128 + signal.SIGXCPU:
                killed = "timeout"  # CPU time limit
        truncated = (self.stdout.total > self.stdout.limit
                     or self.stderr.total > self.stderr.limit)
        return SandboxRun(stdout=self.stdout.text(), stderr=self.stderr.text(),
                          returncode=None if self.killed else returncode, killed=killed,
                          duration_s=time.monotonic() - self.started, truncated=truncated)


# ---------------------------------------------------------------------- the sandbox


class PythonSandbox:
    """The sandbox of one episode: a scratch directory kept across calls and a uid of its own.
    ``run`` may be called concurrently (calls run one at a time); ``close`` kills what runs
    and removes the scratch directory. ``limits``: the config's ``text.py`` (the scratch
    directory is made under its ``scratch_root``); ``cgroup``: also hold each call in a memory
    and a pids cgroup where the machine allows it."""

    def __init__(self, limits: PyToolConfig, *, cgroup: bool = True) -> None:
        self.limits = limits
        self.cgroup = cgroup
        self._bwrap = _binary("bwrap")
        self._setpriv = _binary("setpriv")
        _binary("python3")
        if os.geteuid() != 0:
            raise ToolUnavailable("python sandbox: needs root to start bubblewrap (the "
                                  f"snippet runs as a uid of its own); running as uid "
                                  f"{os.geteuid()}")
        self.uid = _UID_BASE + secrets.randbelow(_UID_SPAN)
        root = Path(limits.scratch_root or tempfile.gettempdir())
        try:
            root.mkdir(parents=True, exist_ok=True)
            self.scratch = Path(tempfile.mkdtemp(prefix="cua-py-", dir=root))
            os.chown(self.scratch, self.uid, self.uid)
        except OSError as exc:
            raise ToolUnavailable(f"python sandbox: cannot make a scratch directory in "
                                  f"{root}: {exc}") from exc
        self._lock = asyncio.Lock()
        self._call: _Call | None = None
        self._leftover_cgroups: list[_Cgroup] = []
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def run(self, code: str) -> SandboxRun:
        """Run ``code`` as ``__main__`` in a fresh sandbox; a snippet that hits a limit is
        killed and reported in the result, never raised. ``ToolUnavailable`` if the sandbox
        cannot start (or is closed)."""
        source = code.encode("utf-8", "replace")
        async with self._lock:
            if self._closed:
                raise ToolUnavailable("python sandbox: closed")
            return await self._run(source)

    async def _run(self, source: bytes) -> SandboxRun:
        # Those of cancelled calls, whose processes were still dying when they ended.
        self._leftover_cgroups = [c for c in self._leftover_cgroups if not c.remove()]
        try:
            seccomp_fd = filter_fd()
        except OSError as exc:  # libseccomp's absence is a ToolUnavailable already
            raise ToolUnavailable(f"python sandbox: no system call filter: {exc}") from exc
        cgroup = _Cgroup.create(self.limits) if self.cgroup else None
        argv = _command(self._bwrap, self._setpriv, self.scratch, self.uid, self.limits,
                        cgroup.procs_files() if cgroup else [], seccomp_fd)
        started = time.monotonic()
        out_fd, out_w = os.pipe()
        err_fd, err_w = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=out_w, stderr=err_w,
                start_new_session=True, env=_HOST_ENV, cwd="/", pass_fds=(seccomp_fd,))
        except OSError as exc:
            for fd in (out_fd, err_fd):
                os.close(fd)
            if cgroup is not None:
                cgroup.remove()
            raise ToolUnavailable(f"python sandbox: cannot start {argv[0]}: {exc}") from exc
        finally:
            os.close(out_w)
            os.close(err_w)
            os.close(seccomp_fd)
        call = self._call = _Call(proc, self.limits, self.scratch, self.uid, cgroup, started)
        try:
            result = await call.supervise(source, out_fd, err_fd)
        finally:
            self._call = None
            if proc.returncode is None:  # cancelled, or an error of ours: nothing may stay
                call.kill("cancelled")
            call.close()
            if cgroup is not None and not cgroup.remove():
                self._leftover_cgroups.append(cgroup)
        if self._closed:
            raise ToolUnavailable("python sandbox: closed while a snippet ran")
        return result

    async def close(self) -> None:
        """Kill a running call, remove the scratch directory. Idempotent."""
        if not self._closed:
            self._closed = True
            if self._call is not None:
                self._call.kill("closed")
        async with self._lock:  # the killed call finishes its teardown first
            pass
        for _ in range(20):
            self._leftover_cgroups = [c for c in self._leftover_cgroups if not c.remove()]
            if not self._leftover_cgroups:
                break
            await asyncio.sleep(0.1)
        if self.scratch.exists():
            await asyncio.to_thread(shutil.rmtree, self.scratch, True)


# ---------------------------------------------------------------------- the tool


class PythonTool:
    """The ``python`` tool: runs the model's snippet in the episode's sandbox and returns its
    output, with a last line saying how it ended. A snippet over ``max_code_bytes`` (UTF-8)
    is refused."""

    def __init__(self, limits: PyToolConfig, *, max_code_bytes: int = MAX_CODE_BYTES) -> None:
        self.limits = limits
        self.max_code_bytes = max_code_bytes
        self.spec = ToolSpec(
            name="python",
            description=(
                "Run a Python 3 program (standard library only) and get what it prints. Each "
                "call is a fresh process: variables and imports do not carry over, but files "
                "written in the current directory do. No network, no input. Limits per call: "
                f"{limits.timeout_s:g} s, {limits.memory_mb} MB of memory, "
                f"{limits.max_output_bytes} bytes of output kept per stream."),
            parameters={"type": "object", "properties": {"code": {
                "type": "string",
                "description": "The program; print() what you want to see."}},
                "required": ["code"]})
        self.sandbox = PythonSandbox(limits)

    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        args = check_arguments(self.spec, arguments)
        code: str = args["code"]
        size = len(code.encode("utf-8", "replace"))
        if size > self.max_code_bytes:
            raise ToolError(f"python: the code is {size} bytes, over the limit of "
                            f"{self.max_code_bytes}")
        return format_run(await self.sandbox.run(code), self.limits)

    async def close(self) -> None:
        await self.sandbox.close()
