"""Compile an OCI seccomp profile to a classic BPF program with libseccomp (ctypes).

corral's own launcher (:mod:`corral.host.launch`) loads the filter itself instead of having
an OCI runtime compile it per container. The translation is the one crun and runc make
(libseccomp, same rules in the same order): one ``seccomp_rule_add_array`` per syscall
name and entry, all of an entry's argument conditions in one rule, or one rule per
condition when an entry compares the same argument twice (runc/crun do the same, as
libseccomp refuses such a rule). Names this libseccomp does not know are skipped, as both
runtimes do. The test suite checks the output against crun's for corral's profiles
(tests/integration/test_launch.py).

Example::

    bpf = compile_profile(shared_profile("x86_64"))   # bytes, 8 per instruction
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from typing import Any

from corral.errors import HostError

__all__ = ["FILTER_FLAGS", "compile_profile", "filter_flags"]

_ACT_KILL_THREAD = 0x00000000
_ACT_KILL_PROCESS = 0x80000000
_ACT_TRAP = 0x00030000
_ACT_ERRNO = 0x00050000
_ACT_TRACE = 0x7FF00000
_ACT_LOG = 0x7FFC0000
_ACT_ALLOW = 0x7FFF0000
_ACT_NOTIFY = 0x7FC00000

_OPS = {
    "SCMP_CMP_NE": 1,
    "SCMP_CMP_LT": 2,
    "SCMP_CMP_LE": 3,
    "SCMP_CMP_EQ": 4,
    "SCMP_CMP_GE": 5,
    "SCMP_CMP_GT": 6,
    "SCMP_CMP_MASKED_EQ": 7,
}

FILTER_FLAGS = {
    "SECCOMP_FILTER_FLAG_TSYNC": 1,
    "SECCOMP_FILTER_FLAG_LOG": 2,
    "SECCOMP_FILTER_FLAG_SPEC_ALLOW": 4,
    "SECCOMP_FILTER_FLAG_NEW_LISTENER": 8,
}
"""OCI ``linux.seccomp.flags`` names -> the kernel's seccomp(2) filter flags."""


class _Arg(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


_lib: ctypes.CDLL | None = None


def _libseccomp() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as e:
            raise HostError(
                f"seccomp: cannot load libseccomp ({name}): {e}; install the Debian "
                "package libseccomp2"
            ) from None
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_release.argtypes = [ctypes.c_void_p]
        lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
        lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
        lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_rule_add_array.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint32,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.POINTER(_Arg),
        ]
        lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
        _lib = lib
    return _lib


def _action(name: str, errno_ret: int | None, default_errno: int) -> int:
    if name == "SCMP_ACT_ERRNO":
        return _ACT_ERRNO | ((default_errno if errno_ret is None else errno_ret) & 0xFFFF)
    if name == "SCMP_ACT_TRACE":
        return _ACT_TRACE | ((default_errno if errno_ret is None else errno_ret) & 0xFFFF)
    table = {
        "SCMP_ACT_KILL": _ACT_KILL_THREAD,
        "SCMP_ACT_KILL_THREAD": _ACT_KILL_THREAD,
        "SCMP_ACT_KILL_PROCESS": _ACT_KILL_PROCESS,
        "SCMP_ACT_TRAP": _ACT_TRAP,
        "SCMP_ACT_LOG": _ACT_LOG,
        "SCMP_ACT_ALLOW": _ACT_ALLOW,
        "SCMP_ACT_NOTIFY": _ACT_NOTIFY,
    }
    if name not in table:
        raise HostError(f"seccomp: unknown action {name!r} in the profile")
    return table[name]


def filter_flags(profile: dict[str, Any]) -> int:
    """The seccomp(2) flags the profile asks for (with NEW_LISTENER when it names a
    ``listenerPath``)."""
    out = 0
    for f in profile.get("flags") or []:
        if f not in FILTER_FLAGS:
            raise HostError(f"seccomp: unknown filter flag {f!r} in the profile")
        out |= FILTER_FLAGS[f]
    if profile.get("listenerPath"):
        out |= FILTER_FLAGS["SECCOMP_FILTER_FLAG_NEW_LISTENER"]
    return out


def compile_profile(profile: dict[str, Any]) -> bytes:
    """The BPF program of an OCI ``linux.seccomp`` object (native byte order)."""
    lib = _libseccomp()
    default_errno = int(profile.get("defaultErrnoRet", errno.EPERM))
    ctx = lib.seccomp_init(_action(profile["defaultAction"], None, default_errno))
    if not ctx:
        raise HostError("seccomp: seccomp_init failed (bad default action?)")
    try:
        for arch in profile.get("architectures") or []:
            a = lib.seccomp_arch_resolve_name(arch.removeprefix("SCMP_ARCH_").lower().encode())
            if a == 0:
                raise HostError(f"seccomp: unknown architecture {arch!r}")
            rc = lib.seccomp_arch_add(ctx, a)
            if rc not in (0, -errno.EEXIST):
                raise HostError(f"seccomp: adding architecture {arch}: {os.strerror(-rc)}")
        for entry in profile.get("syscalls") or []:
            action = _action(entry["action"], entry.get("errnoRet"), default_errno)
            args = entry.get("args") or []
            indices = [a["index"] for a in args]
            groups = [args] if len(set(indices)) == len(indices) else [[a] for a in args]
            for name in entry["names"]:
                nr = lib.seccomp_syscall_resolve_name(name.encode())
                if nr == -1:  # __NR_SCMP_ERROR: unknown to this libseccomp, skipped
                    continue
                for group in groups:
                    arr = (_Arg * max(1, len(group)))()
                    for i, a in enumerate(group):
                        arr[i] = _Arg(
                            a["index"], _OPS[a["op"]], a.get("value", 0), a.get("valueTwo", 0)
                        )
                    rc = lib.seccomp_rule_add_array(ctx, action, nr, len(group), arr)
                    if rc == -errno.EACCES:
                        continue  # the default action already: libseccomp refuses, runc skips
                    if rc < 0:
                        raise HostError(
                            f"seccomp: rule {entry['action']} for {name}: {os.strerror(-rc)}"
                        )
        fd = os.memfd_create("seccomp-bpf", os.MFD_CLOEXEC)  # a pipe could fill up
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc < 0:
                raise HostError(f"seccomp: seccomp_export_bpf: {os.strerror(-rc)}")
            out = os.pread(fd, os.fstat(fd).st_size, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)
    if not out or len(out) % 8:
        raise HostError(f"seccomp: libseccomp exported {len(out)} bytes, not a BPF program")
    return bytes(out)
