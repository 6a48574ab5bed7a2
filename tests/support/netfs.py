"""A real network filesystem between the test hosts (tests.support.hosts): ``sshd`` (Debian's
openssh-server) on one host serves a directory over SFTP, key auth with a throwaway key, and
``sshfs`` (FUSE) mounts it at the same path in the mount namespace of other hosts. No kernel
NFS is needed (this machine's kernel has none); what a client writes crosses the namespace
network with a network filesystem's consistency (close-to-open, no shared locks).

The SFTP server of each session logs what its client does (``sftp-server -l INFO``), one
file per client address: ``writes(address)`` tells which files a host wrote, and how many
bytes. Everything the server runs lives in a temp dir; sshd runs in a mount namespace of its
own with a tmpfs on /run (its privilege separation directory), so nothing of the machine's
/run or /etc/ssh is touched."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from tests.support import unavailable
from tests.support.hosts import Hosts, Processes, sh, wait_for

__all__ = ["SFTP_SERVER", "SSHD", "SftpExport", "require_sshfs"]

SSHD = Path("/usr/sbin/sshd")
SFTP_SERVER = Path("/usr/lib/openssh/sftp-server")
# sftp-server's INFO lines (sftp-server.c) this module reads.
_CLOSE = re.compile(r'^close "(?P<path>.*)" bytes read \d+ written (?P<written>\d+)$')
_OPEN = re.compile(r'^open "(?P<path>.*)" flags \S+ mode \S+$')
_RENAME = re.compile(r'^(?:posix-)?rename old "(?P<old>.*)" new "(?P<new>.*)"$')
_REMOVE = re.compile(r'^remove name "(?P<path>.*)"$')
_MKDIR = re.compile(r'^mkdir name "(?P<path>.*)" mode \S+$')


def require_sshfs() -> None:
    """sshfs, FUSE and Debian's openssh-server; else the test is unavailable."""
    for tool in ("sshfs", "ssh", "ssh-keygen", "fusermount3"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} is not installed (scripts/setup_env.sh --dev: sshfs, "
                        "openssh-server)")
    for path in (SSHD, SFTP_SERVER):
        if not path.exists():
            unavailable(f"{path} is missing (scripts/setup_env.sh --dev: openssh-server)")
    if not Path("/dev/fuse").exists():
        unavailable("/dev/fuse is missing: sshfs needs FUSE")
    if "\tfuse\n" not in Path("/proc/filesystems").read_text():
        unavailable("the kernel has no FUSE (/proc/filesystems lists no fuse)")


class SftpExport:
    """``directory`` on ``host`` served by an sshd of the test's own (config, host key, client
    key and logs in ``workdir``), listening on the host's address only; ``mount`` it on other
    hosts (each with a mount namespace of its own) at the same path. ``close`` unmounts and
    stops everything it started, also after a failure halfway."""

    def __init__(self, hosts: Hosts, procs: Processes, host: str, directory: Path,
                 workdir: Path, port: int = 2222) -> None:
        self.hosts = hosts
        self.procs = procs
        self.host = host
        self.directory = directory.resolve()
        self.workdir = workdir
        self.port = port
        self.logs = workdir / "sftp-logs"
        self.mounted: list[str] = []  # client hosts, in mount order

    def start(self) -> SftpExport:
        w = self.workdir
        w.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir()
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", w / "host_key")
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", w / "client_key")
        shutil.copy(w / "client_key.pub", w / "authorized_keys")
        host_key = (w / "host_key.pub").read_text().split()[:2]
        ip = self.hosts.ip[self.host]
        (w / "known_hosts").write_text(f"[{ip}]:{self.port} {' '.join(host_key)}\n")
        # The session's SFTP server, its log kept per client address ($SSH_CONNECTION's first
        # word): a shell wrapper, as sshd runs a subsystem through the user's shell.
        wrapper = w / "sftp-logged"
        log = f'"{self.logs}/${{SSH_CONNECTION%% *}}.log"'
        wrapper.write_text(f"#!/bin/sh\nexec {SFTP_SERVER} -l INFO -e 2>>{log}\n")
        wrapper.chmod(0o755)
        (w / "sshd_config").write_text("\n".join([
            f"ListenAddress {ip}:{self.port}",
            f"HostKey {w / 'host_key'}",
            f"AuthorizedKeysFile {w / 'authorized_keys'}",
            f"PidFile {w / 'sshd.pid'}",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",  # the keys live in a temp dir of the test
            "X11Forwarding no",
            "AllowTcpForwarding no",
            f"Subsystem sftp {wrapper}",
            "",
        ]))
        # sshd insists on its privilege separation directory, /run/sshd: in a mount namespace
        # of its own, on a tmpfs over /run, so the machine's /run is left alone.
        config = w / "sshd_config"
        script = (f"mount -t tmpfs -o mode=0755 cua-sshd /run && mkdir -m 0755 /run/sshd && "
                  f"{SSHD} -t -f {config} && exec {SSHD} -D -e -f {config}")
        self.procs.start(f"sshd-{self.host}", self.hosts.argv(
            self.host, "unshare", "--mount", "--propagation", "private", "sh", "-c", script),
            self._env())
        wait_for("sshd listening", lambda: "Server listening" in self.procs.log(
            f"sshd-{self.host}"), 30, self.procs, [f"sshd-{self.host}"], poll_s=0.1)
        return self

    def mount(self, client: str) -> None:
        """The directory at the same path on ``client`` (which has its own mount namespace),
        served over the network; returns once a file written here is read there."""
        if client not in self.hosts.mount_ns:
            raise ValueError(f"host {client} has no mount namespace of its own: a mount there "
                             "would be every host's")
        w = self.workdir
        options = ",".join([
            f"IdentityFile={w / 'client_key'}", f"UserKnownHostsFile={w / 'known_hosts'}",
            "StrictHostKeyChecking=yes", "BatchMode=yes", f"port={self.port}",
            "ServerAliveInterval=5"])
        self.procs.start(f"sshfs-{client}", self.hosts.argv(
            client, "sshfs", "-f", "-o", options,
            f"root@{self.hosts.ip[self.host]}:{self.directory}", self.directory),
            self._env())
        self.mounted.append(client)
        # The client sees this machine's files at the same path, so a read there proves the
        # mount only once the mount is there: wait for it first (sshfs is slow under load).
        wait_for(f"the sshfs mount on {client}",
                 lambda: self._fstype_on(client) == "fuse.sshfs", 30, self.procs,
                 [f"sshfs-{client}"], poll_s=0.2)
        canary = self.directory / f".mounted-{client}"
        canary.write_text(client)
        try:
            wait_for(f"a file read over the sshfs mount on {client}",
                     lambda: self._read_on(client, canary) == client, 30, self.procs,
                     [f"sshfs-{client}"], poll_s=0.2)
        finally:
            canary.unlink()

    def _fstype_on(self, client: str) -> str | None:
        done = subprocess.run(self.hosts.argv(client, "findmnt", "-n", "-o", "FSTYPE", "-M",
                                              self.directory),
                              capture_output=True, text=True, timeout=30, check=False)
        return done.stdout.strip() if done.returncode == 0 else None

    def _env(self) -> dict[str, str]:
        return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(self.workdir)}

    def _read_on(self, client: str, path: Path) -> str | None:
        done = subprocess.run(self.hosts.argv(client, "cat", path), capture_output=True,
                              text=True, timeout=30, check=False)
        return done.stdout if done.returncode == 0 else None

    def writes(self, client: str) -> dict[str, int]:
        """The files the SFTP sessions of ``client`` wrote, where they are now by what it
        renamed (a file written under a temporary name, then renamed: its final path) ->
        bytes it wrote into each (appends summed), from the server's log. The server logs a
        handle's close under the name it was opened by, and FUSE releases a file after
        ``close()`` returns: the close of a file renamed at once comes after the rename."""
        written: dict[str, int] = {}
        opened: dict[str, int] = {}  # path -> its handles not closed yet
        moved: dict[str, str] = {}   # a path with open handles -> where it was renamed
        for line in self.log_lines(client):
            if m := _OPEN.match(line):
                opened[m["path"]] = opened.get(m["path"], 0) + 1
            elif m := _CLOSE.match(line):
                path = m["path"]
                target = moved.get(path, path)
                if int(m["written"]):
                    written[target] = written.get(target, 0) + int(m["written"])
                opened[path] = opened.get(path, 1) - 1
                if not opened[path]:
                    del opened[path]
                    moved.pop(path, None)
            elif m := _RENAME.match(line):
                old, new = m["old"], m["new"]
                if old in written:
                    written[new] = written.pop(old)
                for path, target in moved.items():
                    if target == old:
                        moved[path] = new
                if opened.get(old):
                    moved[old] = new
            elif m := _REMOVE.match(line):
                written.pop(m["path"], None)
        return written

    def made_dirs(self, client: str) -> set[str]:
        """The directories the SFTP sessions of ``client`` made."""
        return {m["path"] for line in self.log_lines(client) if (m := _MKDIR.match(line))}

    def log_lines(self, client: str) -> list[str]:
        log = self.logs / f"{self.hosts.ip[client]}.log"
        if not log.exists():
            return []
        return [x.strip() for x in log.read_text(errors="replace").splitlines()]

    def close(self) -> None:
        """Unmount on every client (lazily when busy), stop sshfs and sshd."""
        for client in reversed(self.mounted):
            for flags in (["-u"], ["-u", "-z"]):
                done = subprocess.run(self.hosts.argv(client, "fusermount3", *flags,
                                                      self.directory),
                                      capture_output=True, timeout=30, check=False)
                if done.returncode == 0:
                    break
            self.procs.stop(f"sshfs-{client}", grace_s=10)
        self.mounted.clear()
        self.procs.stop(f"sshd-{self.host}", grace_s=10)
