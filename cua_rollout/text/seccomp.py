"""The ``py`` sandbox's system call filter: a seccomp-BPF program built with libseccomp, which
bubblewrap loads (``--seccomp FD``) just before it runs the snippet's ``setpriv``.

The filter allows every system call but those a Python snippet never needs and that widen what
a hostile one can reach of the kernel, which are refused with ``EPERM`` (``ENOSYS`` for
``clone3``, so the C library falls back to ``clone``, whose flags a filter can read, and for
``memfd_create`` and ``memfd_secret``, so a library falls back to a file). The list follows
Docker's and Podman's default profiles, and adds anonymous memory files:

- new namespaces and mounts: ``unshare``, ``setns``, ``clone`` with any ``CLONE_NEW*`` flag,
  ``mount`` and the new mount API, ``pivot_root``, ``chroot`` (a nested user namespace, where a
  snippet could otherwise mount a tmpfs of its own that no limit counts);
- other processes' memory and the kernel's: ``ptrace``, ``process_vm_readv``/``writev``,
  ``kcmp``, ``pidfd_getfd``, modules, ``kexec_*``, ``bpf``, ``perf_event_open``,
  ``userfaultfd``, ``io_uring_*``, the key store (``keyctl``, ``add_key``, ``request_key``);
- the machine's settings: clocks, ``reboot``, swap, ``acct``, ``quotactl``, ``syslog``, host
  and domain names, I/O ports, file handles (``open_by_handle_at``), ``fanotify_init``;
- anonymous memory files (``memfd_create``, ``memfd_secret``): no rlimit counts them, so
  without a memory cgroup a snippet could hold ``max_open_files`` x ``max_file_mb`` of them
  per process (POSIX shared memory lives in the sandbox's size-limited ``/dev/shm``).

System calls of another architecture's ABI (32-bit ``int 0x80`` on x86-64) kill the process.
libseccomp is loaded with ctypes (Debian ``libseccomp2``, a dependency of apt itself, so on
every Debian): the six functions used here are its stable C API, and the PyPI bindings are
either unmaintained (pyseccomp, 2021) or need a compiler. The program is built once per process
(~1 ms) and handed to each sandbox through a memfd.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

from cua_rollout.core.errors import ToolUnavailable

__all__ = ["DENIED", "NEW_NAMESPACE_FLAGS", "filter_fd", "filter_program"]

DENIED = (
    # namespaces and mounts
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # other processes and the kernel
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "keyctl", "add_key", "request_key", "lookup_dcookie", "uselib",
    "nfsservctl", "vhangup",
    # the machine's settings
    "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "syslog",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname",
    "setdomainname", "iopl", "ioperm", "open_by_handle_at", "name_to_handle_at",
    "fanotify_init",
)
"""System calls refused with ``EPERM``."""

NEW_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000, "CLONE_NEWTIME": 0x00000080,
}
"""``clone`` flags that make a namespace: a ``clone`` with any of them is refused."""

_ACT_ALLOW = 0x7FFF0000
_ACT_KILL_PROCESS = 0x80000000
_FLTATR_ACT_BADARCH = 2
_CMP_MASKED_EQ = 7


def _act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    """``struct scmp_arg_cmp``."""

    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


@functools.cache
def _library() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise ToolUnavailable("python sandbox: libseccomp is missing: install the Debian "
                              f"package libseccomp2 (apt-get install -y libseccomp2): {exc}"
                              ) from exc
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.restype = None
    return lib


def _check(result: int, what: str) -> None:
    if result < 0:
        raise ToolUnavailable(f"python sandbox: libseccomp could not {what}: "
                              f"{os.strerror(-result)}")


@functools.cache
def filter_program() -> bytes:
    """The filter as a BPF program (what ``bwrap --seccomp`` reads); ``ToolUnavailable`` when
    libseccomp is missing or refuses it."""
    lib = _library()
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise ToolUnavailable("python sandbox: libseccomp could not make a filter")
    try:
        _check(lib.seccomp_attr_set(ctx, _FLTATR_ACT_BADARCH, _ACT_KILL_PROCESS),
               "kill other architectures' calls")

        def deny(name: str, action: int, *conditions: _ArgCmp) -> None:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:  # not a system call of this architecture
                return
            array = (_ArgCmp * max(1, len(conditions)))(*conditions)
            _check(lib.seccomp_rule_add_array(ctx, action, number, len(conditions), array),
                   f"refuse {name}")

        for name in DENIED:
            deny(name, _act_errno(errno.EPERM))
        deny("clone3", _act_errno(errno.ENOSYS))
        for name in ("memfd_create", "memfd_secret"):
            deny(name, _act_errno(errno.ENOSYS))
        for flag in NEW_NAMESPACE_FLAGS.values():
            deny("clone", _act_errno(errno.EPERM), _ArgCmp(0, _CMP_MASKED_EQ, flag, flag))
        fd = os.memfd_create("cua-seccomp", os.MFD_CLOEXEC)
        try:
            _check(lib.seccomp_export_bpf(ctx, fd), "export the filter")
            size = os.lseek(fd, 0, os.SEEK_END)
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


def filter_fd() -> int:
    """A new file descriptor (close-on-exec: pass it with ``pass_fds``) from which the filter
    can be read once, from its start (bwrap reads it to its end); the caller closes it."""
    program = filter_program()
    fd = os.memfd_create("cua-seccomp", os.MFD_CLOEXEC)
    try:
        os.write(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd
