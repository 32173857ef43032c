"""A writable build root over an image's layers, for ``build_run`` and ``build_pip``.

Each layer's EROFS file is mounted read-only in a temporary directory, overlayfs puts an
empty upper directory over them, and commands run chrooted in the merged tree. What they
change lands in the upper directory, deletions as overlay whiteouts, which is exactly a
layer to stack on the base.

Isolation: commands run as host root, chrooted, in new PID, UTS, IPC (and, unless
``network``, network) namespaces, with a capability bounding set like Docker's default
minus CAP_SYS_CHROOT (so no chroot escape, no mount, no ptrace of host processes through
the bound /proc). They are build steps of the operator, not guest code: building over an
untrusted imported image should still happen in a sandbox backend instead.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from corral.errors import BuildError, HostError
from corral.host import mounts
from corral.images._proc import run_tool
from corral.images._progress import Step
from corral.images._tarx import OPAQUE_XATTR

if TYPE_CHECKING:
    from corral.images.store import LayerStore

__all__ = ["BuildRoot", "DEFAULT_ENV", "strip_overlay_xattrs"]

DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "DEBIAN_FRONTEND": "noninteractive",
}

# The build overlay must write a plain upper: no redirects (a renamed lower directory is
# copied up whole), no metacopy-only files, no index, so the upper is a self-contained
# layer. Production hosts may enable these by default, hence explicit.
_OVERLAY_OPTIONS = ("redirect_dir=off", "index=off", "metacopy=off")

# overlayfs bookkeeping that means nothing once the upper is a layer of its own; only
# the opaque marker (and xattr whiteouts) carry meaning to a later overlay.
_KEEP_OVERLAY_XATTRS = {OPAQUE_XATTR, "trusted.overlay.whiteout"}

# Docker's default capability set minus CAP_SYS_CHROOT (numbers: linux/capability.h).
_KEEP_CAPS = (
    0,  # chown
    1,  # dac_override
    3,  # fowner
    4,  # fsetid
    5,  # kill
    6,  # setgid
    7,  # setuid
    8,  # setpcap (needed to drop the others; the bounding set only shrinks)
    10,  # net_bind_service
    13,  # net_raw
    27,  # mknod
    29,  # audit_write
    31,  # setfcap
)

# Runs under `unshare`, in the host's Python (loaded before the chroot, so the image needs
# no helper of ours): chroot, shrink the capability bounding set, exec the command.
_ENTER = r"""
import ctypes, os, sys, warnings  # warnings: os.execvp imports it lazily, after chroot
root, keep = sys.argv[1], {int(c) for c in sys.argv[2].split(",")}
last = int(open("/proc/sys/kernel/cap_last_cap").read())
libc = ctypes.CDLL(None, use_errno=True)
os.chroot(root)
os.chdir("/")
for cap in range(last + 1):
    if cap not in keep and libc.prctl(24, cap, 0, 0, 0) != 0:
        sys.exit("corral: cannot drop capability %d: %s" % (cap, os.strerror(ctypes.get_errno())))
libc.prctl(47, 4, 0, 0, 0)
try:
    os.execvp(sys.argv[3], sys.argv[3:])
except OSError as e:
    sys.exit("corral: cannot run %r in the build root: %s" % (sys.argv[3], e.strerror))
"""

_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_STAGE = ".corral-build"
"""Top-level directory of the build root where host files are bound; removed afterwards."""


def strip_overlay_xattrs(upper: Path) -> None:
    """Remove overlayfs bookkeeping xattrs (origin, impure, ...) from an upper tree."""
    for dirpath, dirnames, filenames in os.walk(upper):
        for name in [".", *dirnames, *filenames]:
            p = os.path.join(dirpath, name)
            try:
                attrs = os.listxattr(p, follow_symlinks=False)
            except OSError:
                continue
            for a in attrs:
                if a.startswith("trusted.overlay.") and a not in _KEEP_OVERLAY_XATTRS:
                    os.removexattr(p, a, follow_symlinks=False)


def _check_inside(root: Path, rel: str) -> Path:
    """``root/rel`` after checking no component is a symlink: a mount there must not be
    redirected by an image's symlink (e.g. ``/proc -> /etc``) to a host path."""
    cur = root
    for part in Path(rel).parts:
        if part in ("/", ".", ".."):
            raise BuildError(f"build root path {rel!r} must be relative without '..'")
        cur = cur / part
        if cur.is_symlink():
            raise BuildError(
                f"the image's /{rel} goes through a symlink (/{cur.relative_to(root)});"
                " refusing to mount there"
            )
    return cur


class BuildRoot:
    """Context manager: a chroot-able overlay of ``layers`` (bottom first) with an empty upper.

    Example::

        root = BuildRoot(store, image.layers)
        try:
            with root:
                root.run(["/bin/sh", "-c", "apt-get install -y git"])
            layer = store.add_dir(root.upper, kind="run")
        finally:
            root.cleanup()
    """

    def __init__(
        self,
        store: LayerStore,
        layers: Sequence[str],
        *,
        network: bool = False,
        env: Mapping[str, str] | None = None,
        binds: Mapping[str, Path] | None = None,
        progress_step: Step | None = None,
    ) -> None:
        """``binds``: name -> host path, bound read-only at ``/.corral-build/NAME``."""
        if not layers:
            raise BuildError("a build root needs at least one layer")
        self.store = store
        self.layers = list(layers)
        self.network = network
        self.env = {**DEFAULT_ENV, **(env or {})}
        self.binds = dict(binds or {})
        self._step = progress_step
        self.dir = Path(tempfile.mkdtemp(prefix="corral-build-"))
        self.upper = self.dir / "upper"
        self.root = self.dir / "root"
        self._mounted: list[Path] = []
        self._created: list[str] = []  # mountpoints we made in the merged tree
        self._unshare = shutil.which("unshare") or "/usr/bin/unshare"

    # ------------------------------------------------------------------ setup

    def __enter__(self) -> BuildRoot:
        try:
            self._setup()
        except BaseException:
            self._teardown()
            raise
        return self

    def _mount(self, fn: object, *args: object, target: Path, **kw: object) -> None:
        fn(*args, **kw)  # type: ignore[operator]
        self._mounted.append(target)

    def _mkpoint(self, rel: str, *, is_dir: bool) -> Path:
        path = _check_inside(self.root, rel)
        if not os.path.lexists(path):
            if is_dir:
                path.mkdir(mode=0o755)
            else:
                path.touch(mode=0o644)
            self._created.append(rel)
        elif is_dir != (path.is_dir() and not path.is_symlink()):
            raise BuildError(f"the image's /{rel} is not a {'directory' if is_dir else 'file'}")
        return path

    def _setup(self) -> None:
        lowers = []
        for i, digest in enumerate(reversed(self.layers)):  # overlay wants the top first
            self.store.verify(digest)
            mp = self.dir / "lower" / str(i)
            mp.mkdir(parents=True)
            self._mount(mounts.mount_erofs, self.store.path_of(digest), mp, target=mp)
            lowers.append(mp)
        work = self.dir / "work"
        for d in (self.upper, work, self.root):
            d.mkdir()
        # The merged root takes the upper's owner and mode: give it the image's, not
        # mkdtemp's 0700 (which would also be captured into the layer).
        top = os.stat(lowers[0])
        os.chown(self.upper, top.st_uid, top.st_gid)
        os.chmod(self.upper, stat.S_IMODE(top.st_mode))
        self._mount(
            mounts.mount_overlay,
            lowers,
            self.upper,
            work,
            self.root,
            options=_OVERLAY_OPTIONS,
            target=self.root,
        )

        for name in ("proc", "sys"):
            p = self._mkpoint(name, is_dir=True)
            self._mount(mounts.mount_bind, Path("/") / name, p, readonly=True, target=p)
        dev = self._mkpoint("dev", is_dir=True)
        self._mount(mounts.mount_tmpfs, dev, 64 << 20, 0o755, target=dev)
        for name in _DEVICES:
            node = dev / name
            node.touch(mode=0o666)
            # A bind keeps the flags of the host's /dev mount, so the node works although
            # the tmpfs under it is nodev.
            self._mount(mounts.mount_bind, Path("/dev") / name, node, readonly=False, target=node)
        for name, target in (
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
            ("ptmx", "pts/ptmx"),
        ):
            os.symlink(target, dev / name)
        (dev / "pts").mkdir()
        (dev / "shm").mkdir(mode=0o1777)
        os.chmod(dev / "shm", 0o1777)

        if self.network:
            conf = self._mkpoint("etc/resolv.conf", is_dir=False)
            self._mount(
                mounts.mount_bind, Path("/etc/resolv.conf"), conf, readonly=True, target=conf
            )
        if self.binds:
            self._mkpoint(_STAGE, is_dir=True)
            for name, src in self.binds.items():
                src = Path(src)
                p = self._mkpoint(f"{_STAGE}/{name}", is_dir=src.is_dir())
                self._mount(mounts.mount_bind, src, p, readonly=True, target=p)

    # ------------------------------------------------------------------ use

    def staged(self, name: str) -> str:
        """Path inside the build root of the bind called ``name``."""
        return f"/{_STAGE}/{name}"

    def run(
        self,
        argv: Sequence[str],
        *,
        what: str,
        timeout: float | None = None,
        step: Step | None = None,
    ) -> str:
        """Run ``argv`` (resolved inside the root) and return its output tail.

        BuildError (with the tail of the output) if it exits non-zero.
        """
        ns = ["--pid", "--fork", "--kill-child", "--uts", "--ipc"]
        if not self.network:
            ns.append("--net")
        full = [
            self._unshare,
            *ns,
            "--",
            sys.executable,
            "-I",
            "-S",
            "-c",
            _ENTER,
            str(self.root),
            ",".join(map(str, _KEEP_CAPS)),
            *argv,
        ]
        return run_tool(full, what=what, step=step or self._step, env=self.env, timeout=timeout)

    # ------------------------------------------------------------------ teardown

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._teardown()

    def _teardown(self) -> None:
        failed: list[str] = []
        for target in reversed(self._mounted):
            self._umount(target, failed)
        self._mounted.clear()
        for target in mounts.mounts_under(self.dir):  # anything a build step left
            self._umount(target, failed)
        if failed:
            raise HostError(f"could not unmount {', '.join(failed)} of build root {self.dir}")
        for rel in reversed(self._created):
            p = self.upper / rel
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif os.path.lexists(p):
                p.unlink()
        self._created.clear()
        if self.upper.is_dir():
            strip_overlay_xattrs(self.upper)

    @staticmethod
    def _umount(target: Path, failed: list[str]) -> None:
        try:
            mounts.umount(target)
        except HostError:
            try:
                mounts.umount(target, detach=True)
            except HostError:
                failed.append(str(target))

    def cleanup(self) -> None:
        """Remove the temporary directory (refused while anything is mounted below it)."""
        if not self.dir.exists():
            return
        left = mounts.mounts_under(self.dir)
        if left:
            raise HostError(f"not removing {self.dir}: still mounted: {', '.join(map(str, left))}")
        shutil.rmtree(self.dir)
