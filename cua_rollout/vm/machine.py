"""One virtual machine = one QEMU process: its per-VM directory (a copy-on-write overlay of the
base image, its own UEFI variables, the QMP socket, the serial log, an owner marker), its
start (fresh, or from a ready state), the saving of a ready state, reset and stop; and the
sweep of VMs whose owner died.

Control is QMP through ``qemu.qmp`` (the QEMU project's asyncio client); processes are only
ever signalled by the pid this process started, or by a pid recorded in an owner marker
whose owner is gone and whose command line still carries the run label.

Ready states (``readystate.py``) hold RAM + devices (``ram``, a migration stream), the disk
as it was at the save (``disk.qcow2``: a copy of the overlay, backed by the base) and, under
UEFI, the variables file. A VM started from a state runs on a fresh overlay of that saved
disk. Reset is a fresh QEMU process restored from the state: it discards everything the
episode did (RAM, disk, devices, QEMU's own state) and costs little more than a restore.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient, QMPError

from cua_rollout.vm.errors import VMError
from cua_rollout.vm.readystate import DISK_FILE, RAM_FILE, VARS_FILE, ReadyState
from cua_rollout.vm.spec import MachineSpec

__all__ = ["MARKER_FILE", "RUN_LABEL", "Machine", "sweep"]

RUN_LABEL = "cua-vm"           # in every QEMU's -name and in each VM directory's marker
MARKER_FILE = "owner.json"
OVERLAY_FILE = "overlay.qcow2"
QMP_SOCKET = "qmp.sock"
SERIAL_LOG = "serial.log"
QEMU_LOG = "qemu.log"
# sun_path holds 108 bytes; a VM directory's QMP socket must fit.
MAX_SOCKET_PATH_BYTES = 107
# Migration is rate-limited to 32 MiB/s by default (meant for live migration over a network);
# saving a stopped VM to a local file wants no limit.
UNLIMITED_BANDWIDTH_BYTES_S = 1 << 40
POLL_S = 0.01
STDERR_TAIL_BYTES = 2000

# Host ports handed out by this process to machines still alive, so two machines started
# at once never get the same free port.
_reserved_ports: set[int] = set()


class Machine:
    """A QEMU virtual machine in ``root_dir/<name>``. Not started by the constructor."""

    def __init__(self, spec: MachineSpec, root_dir: Path, *, name: str | None = None,
                 start_timeout_s: float = 30.0, stop_timeout_s: float = 10.0,
                 migrate_timeout_s: float = 600.0, qmp_timeout_s: float = 10.0) -> None:
        self.spec = spec
        self.name = name or f"vm-{uuid.uuid4().hex[:10]}"
        self.root_dir = Path(root_dir)
        self.directory = self.root_dir / self.name
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.migrate_timeout_s = migrate_timeout_s
        self.qmp_timeout_s = qmp_timeout_s
        self.label = f"{RUN_LABEL}.{os.getpid()}.{self.name}"
        # guest port -> host port, settled at the first start and kept across resets
        self.ports: dict[int, int] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._qmp: QMPClient | None = None
        sock = self.directory / QMP_SOCKET
        if len(os.fsencode(sock)) > MAX_SOCKET_PATH_BYTES:
            raise VMError(f"VM directory {self.directory} is too deep for a UNIX socket "
                          f"({len(os.fsencode(sock))} > {MAX_SOCKET_PATH_BYTES} bytes): "
                          "choose a shorter root directory", permanent=True)

    # --- state -----------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        """Whether the QEMU process runs (a dead one is reaped here)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def serial_log(self) -> Path:
        return self.directory / SERIAL_LOG

    # --- lifecycle -----------------------------------------------------------------------

    async def start_fresh(self) -> None:
        """Boot the image on a new overlay of the base image (the guest boots; waiting for
        what it serves is the caller's)."""
        self._prepare_directory(self.spec.image, self.spec.image_format,
                                vars_source=self.spec.ovmf_vars)
        await self._launch(incoming=False)

    async def start_from(self, state: ReadyState) -> None:
        """A fresh QEMU process on a new overlay of the state's disk, with RAM and devices
        restored from the state; running when this returns."""
        self._prepare_directory(state.disk, "qcow2", vars_source=state.vars)
        await self._launch(incoming=True)
        try:
            await self._incoming(state.ram)
        except BaseException:
            await self._kill()
            raise

    async def restore(self, state: ReadyState) -> None:
        """Reset: the running process is killed (its RAM and overlay are thrown away, so
        there is nothing to shut down gracefully) and a fresh one restored from ``state``."""
        await self._kill()
        await self.start_from(state)

    async def save_state(self, dest_dir: Path, *, resume: bool = False) -> None:
        """Write the VM's state into ``dest_dir`` (``ram``, ``disk.qcow2``, ``vars.fd``).

        The VM is paused first, so RAM and disk are of the same instant: once the migration
        completes QEMU has flushed and released the overlay, which is then copied. With
        ``resume`` the VM runs on afterwards (on its own overlay, unaffected by the copy).
        """
        dest_dir = Path(dest_dir)
        dest_dir.mkdir(parents=True, exist_ok=True)
        await self._execute("stop")
        await self._execute("migrate-set-parameters",
                            {"max-bandwidth": UNLIMITED_BANDWIDTH_BYTES_S})
        # An fd, not "exec:cat > file": QEMU SIGTERMs an exec child on close, which can cut
        # off what the child has not yet written.
        fd = os.open(dest_dir / RAM_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            await self._pass_fd(fd, "state-out")
            await self._execute("migrate", {"uri": "fd:state-out"})
            await self._wait_migration(self.migrate_timeout_s, "saving the state")
            os.fsync(fd)
        finally:
            os.close(fd)
        _copy_sparse(self.directory / OVERLAY_FILE, dest_dir / DISK_FILE)
        if self.spec.firmware == "uefi":
            _copy_sparse(self.directory / VARS_FILE, dest_dir / VARS_FILE)
        if resume:
            await self._execute("cont")

    async def stop(self) -> None:
        """QMP ``quit``, then SIGTERM, then SIGKILL, each with a deadline; the VM directory
        (overlay, variables, socket, logs) is removed. Safe to call more than once."""
        try:
            if self.alive():
                with contextlib.suppress(VMError):
                    await self._execute("quit", timeout_s=min(2.0, self.stop_timeout_s))
                if not await self._wait_exit(self.stop_timeout_s / 2):
                    self._signal(signal.SIGTERM)
                    if not await self._wait_exit(self.stop_timeout_s / 2):
                        await self._kill()
            await self._kill()
        finally:
            _reserved_ports.difference_update(self.ports.values())
            shutil.rmtree(self.directory, ignore_errors=True)

    async def wait_serial(self, text: str, timeout_s: float) -> None:
        """Until ``text`` appears on the guest's serial port (the log of this process)."""
        deadline = time.monotonic() + timeout_s
        needle = text.encode()
        while True:
            with contextlib.suppress(FileNotFoundError):
                if needle in self.serial_log.read_bytes():
                    return
            if not self.alive():
                raise VMError(f"{self.name}: QEMU exited before '{text}' on the serial port"
                              f"{self._stderr_tail()}")
            if time.monotonic() > deadline:
                raise VMError(f"{self.name}: no '{text}' on the serial port in {timeout_s:g} s")
            await asyncio.sleep(0.05)

    async def health(self) -> str | None:
        """None while the VM runs; else what is wrong with it, named for the caller's
        quarantine: QEMU gone, QMP silent, the disk full (QEMU pauses a VM whose overlay
        hits ENOSPC rather than fail its writes), or paused otherwise. Whether the guest's
        own server answers is the caller's check."""
        if not self.alive():
            code = self._proc.returncode if self._proc is not None else None
            return f"QEMU exited (code {code}){self._stderr_tail()}"
        try:
            status = await self.query_status()
            if status == "running":
                return None
            if status == "io-error":
                for device in await self._execute("query-block") or []:
                    if device.get("io-status") == "nospace":
                        return (f"disk full: the overlay in {self.directory} has no space left "
                                "(the VM is paused)")
                return "disk I/O error (the VM is paused)"
            return f"the VM is {status}, not running"
        except VMError as exc:
            return f"QMP does not answer: {exc}"

    async def query_status(self) -> str:
        """QEMU's run state (``running``, ``paused``, ``inmigrate`` ...)."""
        return str((await self._execute("query-status"))["status"])

    # --- internals -----------------------------------------------------------------------

    def _prepare_directory(self, backing: Path, backing_format: str,
                           vars_source: Path | None) -> None:
        """A clean VM directory with its owner marker, overlay and variables."""
        if not self.ports:
            self.ports = {guest: host or _free_port() for guest, host in
                          self.spec.forwards.items()}
            _reserved_ports.update(self.ports.values())
        shutil.rmtree(self.directory, ignore_errors=True)
        self.root_dir.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed, so a directory under root_dir always
        # has its marker (sweep() leaves directories without one alone).
        staging = self.root_dir / f".{self.name}.{uuid.uuid4().hex[:6]}"
        staging.mkdir()
        _write_marker(staging, self.label, qemu_pid=None, qemu_start=None)
        _run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", backing_format,
              "-b", str(Path(backing).resolve()), str(staging / OVERLAY_FILE)])
        if self.spec.firmware == "uefi":
            if vars_source is None:
                raise VMError("a UEFI state without its variables file", permanent=True)
            shutil.copyfile(vars_source, staging / VARS_FILE)
        staging.rename(self.directory)

    def _command(self, incoming: bool) -> list[str]:
        spec, d = self.spec, self.directory
        cmd = [
            spec.qemu_binary, "-name", f"guest={self.label},process={RUN_LABEL}",
            "-machine", "q35", "-accel", spec.accel, "-m", str(spec.memory_mb),
            "-smp", str(spec.cpus), "-nodefaults", "-no-user-config", "-display", "none",
            "-serial", f"file:{d / SERIAL_LOG}",
            "-chardev", f"socket,id=qmp,path={d / QMP_SOCKET},server=on,wait=off",
            "-mon", "chardev=qmp,mode=control",
            "-drive", f"file={d / OVERLAY_FILE},if=none,id=disk0,format=qcow2,discard=unmap",
            "-device", "virtio-blk-pci,drive=disk0,bootindex=1",
            "-netdev", "user,id=net0,restrict=on," + ",".join(
                f"hostfwd=tcp:127.0.0.1:{host}-:{guest}" for guest, host in self.ports.items()),
            # romfile= (none): no iPXE option ROM, the VM never boots from the network.
            "-device", "virtio-net-pci,netdev=net0,romfile=",
            "-device", f"VGA,edid=on,xres={spec.screen_width},yres={spec.screen_height}",
            # The screen size for the guest's desktop (the test image's unit reads it; an
            # image that does not look keeps its own).
            "-fw_cfg", f"name=opt/cua/screen,string={spec.screen_width}x{spec.screen_height}",
        ]
        cpu = spec.cpu_model or ("host" if spec.accel == "kvm" else None)
        if cpu:
            cmd += ["-cpu", cpu]
        if spec.firmware == "uefi":
            cmd += ["-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={spec.ovmf_code}",
                    "-drive", f"if=pflash,format=raw,unit=1,file={d / VARS_FILE}"]
        if spec.kernel is not None:
            cmd += ["-kernel", str(spec.kernel)]
            if spec.initrd is not None:
                cmd += ["-initrd", str(spec.initrd)]
            if spec.append:
                cmd += ["-append", spec.append]
        if incoming:
            cmd += ["-incoming", "defer"]
        return cmd

    async def _launch(self, incoming: bool) -> None:
        with open(self.directory / QEMU_LOG, "wb") as log:
            try:
                # A session of its own: a Ctrl-C at the terminal reaches the owner, which
                # stops its VMs, and not QEMU behind its back.
                self._proc = subprocess.Popen(self._command(incoming), stdin=subprocess.DEVNULL,
                                              stdout=log, stderr=log, start_new_session=True)
            except FileNotFoundError as exc:
                raise VMError(f"QEMU binary {self.spec.qemu_binary!r} not found",
                              permanent=True) from exc
        _write_marker(self.directory, self.label, qemu_pid=self._proc.pid,
                      qemu_start=_start_time(self._proc.pid))
        try:
            await self._connect()
        except BaseException:
            await self._kill()
            raise

    async def _connect(self) -> None:
        sock = str(self.directory / QMP_SOCKET)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if not self.alive():
                raise VMError(f"{self.name}: QEMU exited at start{self._stderr_tail()}")
            if os.path.exists(sock):
                qmp = QMPClient(self.name)
                try:
                    await asyncio.wait_for(qmp.connect(sock), self.qmp_timeout_s)
                except (QMPError, OSError, TimeoutError):
                    with contextlib.suppress(QMPError, OSError):
                        await qmp.disconnect()
                else:
                    self._qmp = qmp
                    return
            if time.monotonic() > deadline:
                raise VMError(f"{self.name}: no QMP connection in {self.start_timeout_s:g} s")
            await asyncio.sleep(POLL_S)

    async def _incoming(self, ram: Path) -> None:
        fd = os.open(ram, os.O_RDONLY)
        try:
            await self._pass_fd(fd, "state-in")
            await self._execute("migrate-incoming", {"uri": "fd:state-in"})
            # The state was saved from a stopped VM, so QEMU leaves the restored one paused
            # (it takes the run state the stream recorded) until "cont".
            deadline = time.monotonic() + self.migrate_timeout_s
            while (status := await self.query_status()) == "inmigrate":
                if time.monotonic() > deadline:
                    raise VMError(f"{self.name}: restore not done in "
                                  f"{self.migrate_timeout_s:g} s")
                await asyncio.sleep(POLL_S)
            if status != "running":
                await self._execute("cont")
            if (status := await self.query_status()) != "running":
                raise VMError(f"{self.name}: restored VM is {status!r}, not running")
        except VMError as exc:
            if not self.alive():
                raise VMError(f"{self.name}: QEMU exited while restoring the state"
                              f"{self._stderr_tail()}") from exc
            raise
        finally:
            os.close(fd)

    async def _pass_fd(self, fd: int, fdname: str) -> None:
        if self._qmp is None:
            raise VMError(f"{self.name}: not running")
        try:
            _send_fd(self._qmp, fd)
        except (QMPError, OSError) as exc:
            raise VMError(f"{self.name}: passing a file to QEMU failed: {exc}") from exc
        await self._execute("getfd", {"fdname": fdname})

    async def _wait_migration(self, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            info = await self._execute("query-migrate")
            status = info.get("status")
            if status == "completed":
                return
            if status in {"failed", "cancelled"}:
                raise VMError(f"{self.name}: {what} failed: {info.get('error-desc', status)}")
            if time.monotonic() > deadline:
                with contextlib.suppress(VMError):
                    await self._execute("migrate_cancel")
                raise VMError(f"{self.name}: {what} not done in {timeout_s:g} s")
            await asyncio.sleep(POLL_S)

    async def _execute(self, command: str, arguments: dict[str, object] | None = None, *,
                       timeout_s: float | None = None) -> Any:
        if self._qmp is None or not self.alive():
            raise VMError(f"{self.name}: QEMU is not running{self._stderr_tail()}")
        try:
            result = await asyncio.wait_for(self._qmp.execute(command, arguments),
                                            timeout_s or self.qmp_timeout_s)
        except TimeoutError as exc:
            raise VMError(f"{self.name}: QMP {command} did not answer in "
                          f"{timeout_s or self.qmp_timeout_s:g} s") from exc
        except (QMPError, OSError, EOFError) as exc:
            raise VMError(f"{self.name}: QMP {command} failed: {exc}") from exc
        return result

    def _signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(sig)  # type: ignore[union-attr]

    async def _wait_exit(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.alive():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True

    async def _kill(self) -> None:
        """SIGKILL the process (if it runs), reap it, drop the QMP connection."""
        self._signal(signal.SIGKILL)
        if self._proc is not None:
            await self._wait_exit(self.stop_timeout_s)
        if self._qmp is not None:
            qmp, self._qmp = self._qmp, None
            with contextlib.suppress(QMPError, OSError, EOFError):
                await asyncio.wait_for(qmp.disconnect(), self.qmp_timeout_s)

    def _stderr_tail(self) -> str:
        try:
            with open(self.directory / QEMU_LOG, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - STDERR_TAIL_BYTES))
                tail = log.read().decode(errors="replace").strip()
        except OSError:
            return ""
        return f": {tail}" if tail else ""


def sweep(root_dir: Path) -> list[str]:
    """Remove the VMs under ``root_dir`` whose owner process is gone (SIGKILLed, crashed):
    their QEMU process (only if its pid still runs the same process, started when recorded,
    with the run label on its command line), then their directory. Returns their names.
    VMs of a live owner, and directories without a marker, are left alone."""
    root_dir = Path(root_dir)
    swept: list[str] = []
    if not root_dir.is_dir():
        return swept
    for directory in sorted(root_dir.iterdir()):
        try:
            marker = json.loads((directory / MARKER_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if _same_process(marker.get("owner_pid"), marker.get("owner_start")):
            continue
        qemu_pid = marker.get("qemu_pid")
        if _same_process(qemu_pid, marker.get("qemu_start")) and marker.get("label", "\0") in \
                _cmdline(qemu_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(qemu_pid, signal.SIGKILL)
            _wait_gone(qemu_pid, marker.get("qemu_start"))
        shutil.rmtree(directory, ignore_errors=True)
        swept.append(directory.name)
    return swept


def _write_marker(directory: Path, label: str, *, qemu_pid: int | None,
                  qemu_start: int | None) -> None:
    me = os.getpid()
    tmp = directory / f".{MARKER_FILE}.tmp"
    tmp.write_text(json.dumps({"label": label, "owner_pid": me, "owner_start": _start_time(me),
                               "qemu_pid": qemu_pid, "qemu_start": qemu_start}),
                   encoding="utf-8")
    tmp.replace(directory / MARKER_FILE)


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat):
    with the pid, it names one process even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":  # a zombie has finished
        return None
    return int(fields[19])


def _same_process(pid: object, start: object) -> bool:
    return isinstance(pid, int) and start is not None and _start_time(pid) == start


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def _wait_gone(pid: int, start: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _same_process(pid, start) and time.monotonic() < deadline:
        time.sleep(POLL_S)


def _send_fd(qmp: QMPClient, fd: int) -> None:
    """Pass ``fd`` to QEMU over the QMP connection (SCM_RIGHTS on one space, which QMP's
    parser skips), as ``QMPClient.send_fd_scm`` does, but through a duplicate of the socket's
    descriptor: under uvloop (Ray's actors) the transport's socket is a stand-in without the
    ``_sock`` that ``send_fd_scm`` reaches into."""
    writer = qmp._writer  # the connection's transport: the client has no public accessor
    if writer is None:
        raise QMPError("not connected")
    transport_socket = writer.transport.get_extra_info("socket")
    with socket.socket(fileno=os.dup(transport_socket.fileno())) as sock:
        if sock.family != socket.AF_UNIX:
            raise QMPError("sending a file descriptor needs a UNIX socket")
        sock.sendmsg([b" "], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("@i", fd))])


def _free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _reserved_ports:
            return port


def _copy_sparse(src: Path, dst: Path) -> None:
    _run(["cp", "--sparse=always", "--reflink=auto", str(src), str(dst)])


def _run(cmd: list[str], timeout_s: float = 120.0) -> None:
    try:
        subprocess.run(cmd, capture_output=True, check=True, timeout=timeout_s)
    except FileNotFoundError as exc:
        raise VMError(f"{cmd[0]} not found (apt-get install qemu-utils)", permanent=True) from exc
    except subprocess.CalledProcessError as exc:
        raise VMError(f"{' '.join(cmd)} failed: "
                      f"{exc.stderr.decode(errors='replace').strip()}") from exc
    except subprocess.TimeoutExpired as exc:
        raise VMError(f"{' '.join(cmd)} did not finish in {timeout_s:g} s") from exc
