"""SandboxFS against an adversarial tree: a tmp dir stands in for the sandbox rootfs.

Every escape test plants canaries *beside* the root (in its parent) and asserts they are
never returned, changed or joined by new files; the snapshot of everything outside the
root is compared before and after. Needs root (for chown to the guest's uid range).
"""

from __future__ import annotations

import ctypes
import errno
import gzip
import io
import os
import socket
import stat
import tarfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

import corral.backends.files as files_mod
from corral.backends.files import SandboxFS
from corral.errors import (
    Conflict,
    CorralError,
    HostError,
    InvalidRequest,
    NotFound,
    PathRefused,
    QuotaExceeded,
    ScratchFull,
    error_from_wire,
)
from corral.host.openat2 import RESOLVE_BENEATH, RESOLVE_IN_ROOT, openat2

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown files")

BASE = 100000
SANDBOX_PASSWD = b"root:x:0:0:sandbox root:/root:/bin/sh\n"
CANARY = b"HOST CANARY - must never be read, changed or written next to\n"


@dataclass
class Env:
    top: Path  # the root's parent: plays the host
    root: Path
    outside: Path
    fs: SandboxFS

    def snapshot(self) -> dict[str, object]:
        """Everything outside the root: names, types and contents."""
        out: dict[str, object] = {}
        for dirpath, dirnames, filenames in os.walk(self.top):
            d = Path(dirpath)
            if d == self.top:
                dirnames[:] = [n for n in dirnames if d / n != self.root]
            for name in dirnames + filenames:
                p = d / name
                st = p.lstat()
                if stat.S_ISREG(st.st_mode):
                    out[str(p)] = p.read_bytes()
                elif stat.S_ISLNK(st.st_mode):
                    out[str(p)] = ("link", os.readlink(p))
                else:
                    out[str(p)] = stat.S_IFMT(st.st_mode)
        return out


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_bytes(SANDBOX_PASSWD)
    (root / "tmp").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary").write_bytes(CANARY)
    # The names a "../" or an absolute link would reach if it were followed on the host.
    (tmp_path / "canary").write_bytes(CANARY)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_bytes(CANARY)
    e = Env(tmp_path, root, outside, SandboxFS(root))
    before = e.snapshot()
    yield e
    assert e.snapshot() == before, "something outside the sandbox root changed"


def no_host_path(err: BaseException, env: Env) -> None:
    assert str(env.top) not in str(err), f"host path leaked: {err}"


def make_tar(*members: tuple[tarfile.TarInfo, bytes | None], gz: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def member(
    name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode, info.mtime = kind, link, mode, 1_700_000_000
    return info


# ---------------------------------------------------------------- basic operations


def test_write_read_and_ownership(env: Env) -> None:
    env.fs.write("/work/src/a.py", b"print(1)\n", mode=0o640)
    host = env.root / "work" / "src" / "a.py"
    assert host.read_bytes() == b"print(1)\n"
    st = host.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (BASE, BASE, 0o640)
    for d in (env.root / "work", env.root / "work" / "src"):  # parents made as guest root
        dst = d.stat()
        assert (dst.st_uid, dst.st_gid, stat.S_IMODE(dst.st_mode)) == (BASE, BASE, 0o755)
    assert env.fs.read("/work/src/a.py") == b"print(1)\n"
    assert env.fs.read("/work/src/a.py", offset=6) == b"1)\n"
    assert env.fs.read("/work/src/a.py", offset=1, length=4) == b"rint"
    assert env.fs.read("/work/src/a.py", offset=100) == b""
    s = env.fs.stat("/work/src/a.py")
    assert (s.type, s.size, s.mode, s.uid, s.gid, s.name) == ("file", 9, 0o640, 0, 0, "a.py")
    assert s.path == "/work/src/a.py"


def test_write_replaces_atomically_and_appends(env: Env) -> None:
    env.fs.write("/f", b"one")
    env.fs.write("/f", b"two!")
    assert env.fs.read("/f") == b"two!"
    env.fs.write("/f", b"+3", append=True)
    env.fs.write("/new", b"x", append=True, mode=0o600)
    assert env.fs.read("/f") == b"two!+3"
    assert stat.S_IMODE((env.root / "new").stat().st_mode) == 0o600
    assert (env.root / "new").stat().st_uid == BASE
    assert not [n for n in os.listdir(env.root) if n.startswith(".corral-tmp")]


def test_owner_inside_user(env: Env) -> None:
    env.fs.write("/home/u/f", b"x", owner_uid=1000, owner_gid=1001)
    env.fs.mkdir("/home/u/d", owner_uid=1000, owner_gid=1000)
    assert (env.root / "home/u/f").stat().st_uid == BASE + 1000
    assert (env.root / "home/u/f").stat().st_gid == BASE + 1001
    assert (env.root / "home/u").stat().st_uid == BASE  # write's parents: guest root
    assert (env.root / "home/u/d").stat().st_uid == BASE + 1000
    assert env.fs.stat("/home/u/f").uid == 1000
    with pytest.raises(InvalidRequest):
        env.fs.write("/x", b"", owner_uid=70000)


def test_list_and_stat(env: Env) -> None:
    env.fs.write("/d/file", b"abc")
    env.fs.mkdir("/d/sub")
    os.symlink("/etc/passwd", env.root / "d" / "link")
    os.mkfifo(env.root / "d" / "fifo")
    entries = {e.name: e for e in env.fs.list("/d")}
    assert list(entries) == ["fifo", "file", "link", "sub"]
    assert entries["file"].type == "file" and entries["file"].size == 3
    assert entries["sub"].type == "dir" and entries["sub"].uid == 0
    assert entries["link"].type == "symlink" and entries["link"].target == "/etc/passwd"
    assert entries["fifo"].type == "other"
    assert entries["file"].path == "/d/file"
    # Host-root-owned files are outside the guest's id mapping: the overflow id.
    assert env.fs.stat("/etc/passwd").uid == 65534
    assert env.fs.stat("/d/link").type == "symlink"  # lstat semantics
    assert env.fs.stat("/").type == "dir" and env.fs.stat("/").name == "/"
    with pytest.raises(InvalidRequest):
        env.fs.list("/d/file")


def test_mkdir(env: Env) -> None:
    env.fs.mkdir("/a/b/c", mode=0o700)
    assert stat.S_IMODE((env.root / "a/b/c").stat().st_mode) == 0o700
    assert stat.S_IMODE((env.root / "a/b").stat().st_mode) == 0o755
    assert (env.root / "a/b/c").stat().st_uid == BASE
    env.fs.mkdir("/a/b/c")  # -p: exists is fine
    with pytest.raises(Conflict):
        env.fs.mkdir("/a/b/c", parents=False)
    with pytest.raises(NotFound):
        env.fs.mkdir("/x/y", parents=False)
    env.fs.write("/file", b"")
    with pytest.raises(InvalidRequest):
        env.fs.mkdir("/file/sub")


def test_remove(env: Env) -> None:
    env.fs.write("/t/a/b/f", b"x")
    env.fs.write("/t/g", b"x")
    env.fs.remove("/t/g")
    with pytest.raises(InvalidRequest, match="not empty"):
        env.fs.remove("/t")
    env.fs.remove("/t", recursive=True)
    assert not (env.root / "t").exists()
    env.fs.mkdir("/empty")
    env.fs.remove("/empty")
    with pytest.raises(NotFound):
        env.fs.remove("/empty")
    with pytest.raises(InvalidRequest):
        env.fs.remove("/", recursive=True)
    with pytest.raises(InvalidRequest):
        env.fs.remove("/etc/..", recursive=True)
    os.symlink("/etc", env.root / "etclink")
    env.fs.remove("/etclink", recursive=True)  # removes the link, not /etc
    assert (env.root / "etc" / "passwd").exists()


def test_path_validation(env: Env) -> None:
    with pytest.raises(InvalidRequest, match="absolute"):
        env.fs.read("etc/passwd")
    with pytest.raises(PathRefused, match="NUL"):
        env.fs.read("/etc/passwd\0/x")
    with pytest.raises(PathRefused, match="255"):
        env.fs.write("/" + "a" * 256, b"")
    with pytest.raises(PathRefused, match="4096"):
        env.fs.read("/a" * 2049)
    env.fs.write("/" + "n" * 255, b"ok")  # exactly the limit is fine
    with pytest.raises(InvalidRequest, match="directory"):
        env.fs.read("/etc")
    with pytest.raises(InvalidRequest, match="directory"):
        env.fs.write("/etc", b"x")
    with pytest.raises(InvalidRequest):
        env.fs.write("/etc/", b"x")
    with pytest.raises(NotFound) as ei:
        env.fs.read("/nope/missing")
    assert "/nope/missing" in str(ei.value)
    no_host_path(ei.value, env)
    with pytest.raises(NotFound):
        env.fs.write("/nodir/f", b"x", parents=False)
    with pytest.raises(InvalidRequest, match="not a directory"):
        env.fs.write("/etc/passwd/f", b"x")


def test_size_limits(env: Env) -> None:
    fs = SandboxFS(env.root, max_file=100)
    with pytest.raises(InvalidRequest, match="limit"):
        fs.write("/big", b"x" * 101)
    env.fs.write("/big", b"y" * 500)
    with pytest.raises(InvalidRequest, match="ranges"):
        fs.read("/big")
    assert fs.read("/big", offset=450) == b"y" * 50
    assert fs.read("/big", offset=0, length=100) == b"y" * 100
    with pytest.raises(InvalidRequest):
        fs.read("/big", length=101)


def test_special_files_are_refused(env: Env) -> None:
    os.mkfifo(env.root / "fifo")
    os.mknod(env.root / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(env.root / "sock"))
        t0 = time.monotonic()
        for name in ("/fifo", "/null", "/sock"):
            with pytest.raises(PathRefused, match="device, fifo or socket"):
                env.fs.read(name)
            with pytest.raises(PathRefused):
                env.fs.write(name, b"x", append=True)
        # generous: had the fifo been opened, the read would block forever
        assert time.monotonic() - t0 < 30
        os.symlink("/null", env.root / "nulllink")
        with pytest.raises(PathRefused):
            env.fs.read("/nulllink")
        env.fs.write("/null", b"replaced")  # replacing the name is fine, the device untouched
        assert (env.root / "null").read_bytes() == b"replaced"
    finally:
        sock.close()


# ---------------------------------------------------------------- escapes


def test_symlink_to_root_reads_sandbox_files(env: Env) -> None:
    os.symlink("/", env.root / "link")
    os.symlink("../../../../..", env.root / "rel")
    os.symlink(str(env.top / "canary"), env.root / "hostabs")
    os.symlink("../canary", env.root / "hostrel")
    os.symlink("/proc/self/root/etc/passwd", env.root / "magic")
    host_passwd = Path("/etc/passwd").read_bytes()
    for path in (
        "/link/etc/passwd",
        "/rel/etc/passwd",
        "/../../etc/passwd",
        "/link/../link/etc/../etc/passwd",
        "/tmp/../../../etc/passwd",
    ):
        data = env.fs.read(path)
        assert data == SANDBOX_PASSWD and data != host_passwd and data != CANARY
    for path in ("/hostabs", "/hostrel", "/../canary", "/link/../canary", "/magic"):
        with pytest.raises(NotFound) as ei:
            env.fs.read(path)
        no_host_path(ei.value, env)
    assert [e.name for e in env.fs.list("/link")] == [e.name for e in env.fs.list("/")]
    assert {e.name for e in env.fs.list("/..")} == {e.name for e in env.fs.list("/")}


def test_write_through_absolute_symlink_stays_inside(env: Env) -> None:
    os.symlink("/", env.root / "x")
    evil = f"evil-{uuid.uuid4().hex}"
    env.fs.write(f"/x/tmp/{evil}", b"pwn")
    assert (env.root / "tmp" / evil).read_bytes() == b"pwn"
    assert not Path("/tmp", evil).exists()
    # A link to the host path of a directory outside: the write lands inside the root,
    # under the same path, never in the real directory.
    os.symlink(str(env.outside), env.root / "out")
    os.symlink("../outside", env.root / "outrel")
    # Inside the sandbox these links dangle: like `mkdir -p` through a dangling link, the
    # write fails instead of creating the target.
    with pytest.raises(NotFound):
        env.fs.write("/out/evil", b"pwn")
    with pytest.raises(NotFound):
        env.fs.write("/outrel/evil", b"pwn")
    env.fs.mkdir(str(env.outside))  # now the sandbox has its own directory of that name
    env.fs.mkdir("/outside")
    env.fs.write("/out/evil", b"pwn")
    env.fs.write("/outrel/evil", b"pwn")
    env.fs.mkdir("/out/newdir")
    assert (env.root / str(env.outside).lstrip("/") / "evil").read_bytes() == b"pwn"
    assert (env.root / "outside" / "evil").read_bytes() == b"pwn"
    with pytest.raises(NotFound):
        env.fs.remove("/out/canary")
    with pytest.raises(NotFound):
        env.fs.read("/outrel/canary")


def test_dotdot_past_root_is_clamped(env: Env) -> None:
    env.fs.write("/../../../evil", b"x")
    assert (env.root / "evil").exists() and not (env.top / "evil").exists()
    env.fs.mkdir("/../../newdir")
    assert (env.root / "newdir").is_dir()
    assert env.fs.stat("/../..").type == "dir"


def test_symlink_as_final_component_on_write_is_replaced(env: Env) -> None:
    """Decision: write replaces the link by a regular file; append refuses the link.
    Either way the link's target, inside or outside, is never written."""
    os.symlink(str(env.outside / "canary"), env.root / "victim")
    os.symlink("../outside/canary", env.root / "victim2")
    os.symlink("/etc/passwd", env.root / "victim3")
    for name in ("/victim", "/victim2", "/victim3"):
        with pytest.raises(PathRefused, match="symlink"):
            env.fs.write(name, b"appended", append=True)
        env.fs.write(name, b"replaced")
        st = (env.root / name.lstrip("/")).lstat()
        assert stat.S_ISREG(st.st_mode) and st.st_uid == BASE
        assert env.fs.read(name) == b"replaced"
    assert (env.root / "etc" / "passwd").read_bytes() == SANDBOX_PASSWD


def test_recursive_remove_does_not_follow_symlinks(env: Env) -> None:
    (env.root / "tree" / "a" / "b").mkdir(parents=True)
    (env.root / "tree" / "a" / "b" / "f").write_bytes(b"x")
    os.symlink(str(env.outside), env.root / "tree" / "abs")
    os.symlink("../../../outside", env.root / "tree" / "a" / "rel")
    os.symlink(str(env.top), env.root / "tree" / "a" / "b" / "top")
    os.link(env.root / "etc" / "passwd", env.root / "tree" / "hard")
    env.fs.remove("/tree", recursive=True)
    assert not (env.root / "tree").exists()
    assert (env.root / "etc" / "passwd").read_bytes() == SANDBOX_PASSWD
    os.symlink(str(env.outside), env.root / "outlink")
    env.fs.remove("/outlink", recursive=True)
    assert not (env.root / "outlink").is_symlink()


def test_deep_tree_past_path_max(env: Env) -> None:
    """Trees deeper than PATH_MAX (a guest can build them) still walk and remove."""
    name = "d" * 100
    fd = os.open(env.root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(60):  # 60 * 101 bytes > 4096
            os.mkdir(name, dir_fd=fd)
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.symlink(str(env.outside), "escape", dir_fd=fd)
        leaf = os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(leaf, b"deep")
        os.close(leaf)
    finally:
        os.close(fd)
    with tarfile.open(fileobj=io.BytesIO(env.fs.download_tar("/" + name))) as tf:
        names = tf.getnames()
        assert any(n.endswith("/leaf") for n in names) and len(names) == 61
    env.fs.remove("/" + name, recursive=True)
    assert not (env.root / name).exists()


# ---------------------------------------------------------------- archives


def test_download_tree_with_symlinks_and_roundtrip(env: Env) -> None:
    env.fs.write("/src/a.txt", b"A", mode=0o600)
    env.fs.write("/src/sub/b.txt", b"BB")
    os.symlink(str(env.outside / "canary"), env.root / "src" / "abs")
    os.symlink("../../outside", env.root / "src" / "sub" / "rel")
    os.symlink("/", env.root / "src" / "slash")
    os.link(env.root / "src" / "a.txt", env.root / "src" / "sub" / "hard")
    os.mkfifo(env.root / "src" / "fifo")
    os.mknod(env.root / "src" / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    data = env.fs.download_tar("/src")
    assert CANARY not in data and SANDBOX_PASSWD not in data
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        m = {i.name: i for i in tf.getmembers()}
        assert set(m) == {"a.txt", "abs", "slash", "sub", "sub/b.txt", "sub/hard", "sub/rel"}
        assert m["abs"].issym() and m["abs"].linkname == str(env.outside / "canary")
        assert m["sub/rel"].issym() and m["slash"].linkname == "/"
        assert m["sub/hard"].islnk() and m["sub/hard"].linkname == "a.txt"
        assert m["a.txt"].mode == 0o600 and m["a.txt"].uid == 0
    n = env.fs.upload_tar("/copy", data)
    assert n == 7
    assert env.fs.read("/copy/sub/b.txt") == b"BB"
    assert os.readlink(env.root / "copy" / "abs") == str(env.outside / "canary")
    assert (env.root / "copy/a.txt").stat().st_ino == (env.root / "copy/sub/hard").stat().st_ino
    assert stat.S_IMODE((env.root / "copy/a.txt").stat().st_mode) == 0o600
    # A symlink path is archived as the link itself.
    with tarfile.open(fileobj=io.BytesIO(env.fs.download_tar("/src/slash"))) as tf:
        (only,) = tf.getmembers()
        assert only.name == "slash" and only.issym()
    with tarfile.open(fileobj=io.BytesIO(env.fs.download_tar("/src/a.txt"))) as tf:
        f = tf.extractfile("a.txt")
        assert f is not None and f.read() == b"A"
    with pytest.raises(PathRefused):
        env.fs.download_tar("/src/fifo")
    with pytest.raises(InvalidRequest, match="limit"):
        SandboxFS(env.root, max_file=2).download_tar("/src")


def test_upload_tar_basic(env: Env) -> None:
    data = make_tar(
        (member("dir", tarfile.DIRTYPE, mode=0o750), None),
        (member("dir/f.txt", mode=0o755), b"hello"),
        (member("./g.txt"), b"g"),
        (member("deep/er/h"), b"h"),
        gz=True,
    )
    assert env.fs.upload_tar("/dest/x", data) == 4
    assert (env.root / "dest/x/dir/f.txt").read_bytes() == b"hello"
    st = (env.root / "dest/x/dir/f.txt").stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode), int(st.st_mtime)) == (BASE, 0o755, 1_700_000_000)
    assert stat.S_IMODE((env.root / "dest/x/dir").stat().st_mode) == 0o750
    assert (env.root / "dest/x/deep/er").stat().st_uid == BASE
    assert (env.root / "dest/x/g.txt").read_bytes() == b"g"

    class Pipe(io.RawIOBase):  # an unseekable stream, like an HTTP body
        def __init__(self, b: bytes) -> None:
            self._b = io.BytesIO(b)

        def readable(self) -> bool:
            return True

        def readinto(self, buf: bytearray) -> int:  # type: ignore[override]
            chunk = self._b.read(min(len(buf), 1000))
            buf[: len(chunk)] = chunk
            return len(chunk)

    assert env.fs.upload_tar("/streamed", Pipe(data)) == 4  # type: ignore[arg-type]
    assert (env.root / "streamed/deep/er/h").read_bytes() == b"h"
    with pytest.raises(InvalidRequest, match="tar"):
        env.fs.upload_tar("/bad", b"this is not a tar archive at all" * 40)
    with pytest.raises(InvalidRequest, match="tar"):
        env.fs.upload_tar("/bad", gzip.compress(b"junk" * 200))


@pytest.mark.parametrize(
    ("name", "kind", "link", "match"),
    [
        ("../evil", tarfile.REGTYPE, "", r"'\.\.'"),
        ("a/../../evil", tarfile.REGTYPE, "", r"'\.\.'"),
        ("/evil", tarfile.REGTYPE, "", "absolute"),
        ("/tmp/evil", tarfile.SYMTYPE, "/", "absolute"),
        ("hl", tarfile.LNKTYPE, "../outside/canary", r"'\.\.'"),
        ("hl", tarfile.LNKTYPE, "/etc/passwd", "absolute"),
        ("hl", tarfile.LNKTYPE, str(Path("/tmp")), "absolute"),
        ("dev", tarfile.CHRTYPE, "", "device"),
        ("blk", tarfile.BLKTYPE, "", "device"),
        ("fifo", tarfile.FIFOTYPE, "", "fifo"),
        ("x" * 300, tarfile.REGTYPE, "", "255"),
        ("a/" * 2100 + "f", tarfile.REGTYPE, "", "4096"),
    ],
)
def test_upload_tar_refuses(env: Env, name: str, kind: bytes, link: str, match: str) -> None:
    info = member(name, kind, link)
    data = make_tar(
        (member("first.txt"), b"first"), (info, b"x" if kind == tarfile.REGTYPE else None)
    )
    with pytest.raises(PathRefused, match=match) as ei:
        env.fs.upload_tar("/dest", data)
    assert name[:50] in str(ei.value)  # the message names the member
    no_host_path(ei.value, env)
    assert not (env.root / "dest").exists()  # checked before anything was written
    assert not (env.top / "evil").exists() and not (env.root / "evil").exists()


def test_upload_tar_symlink_member_cannot_redirect_to_host(env: Env) -> None:
    evil = f"evil-{uuid.uuid4().hex}"
    env.fs.mkdir(str(env.outside))  # so that the link "o" below does not dangle inside
    data = make_tar(
        (member("l", tarfile.SYMTYPE, "/"), None),
        (member(f"l/tmp/{evil}"), b"through abs link"),
        (member("r", tarfile.SYMTYPE, "../../../../.."), None),
        (member(f"r/{evil}"), b"through rel link"),
        (member("o", tarfile.SYMTYPE, str(env.outside)), None),
        (member("o/canary"), b"overwrite?"),
        (member("h", tarfile.LNKTYPE, "l/etc/passwd"), None),
    )
    assert env.fs.upload_tar("/dest", data) == 7
    # Links are guest content, kept verbatim; what went through them stayed in the root.
    assert os.readlink(env.root / "dest" / "l") == "/"
    assert (env.root / "tmp" / evil).read_bytes() == b"through abs link"
    assert not Path("/tmp", evil).exists()
    assert (env.root / evil).read_bytes() == b"through rel link"
    inside_outside = env.root / str(env.outside).lstrip("/") / "canary"
    assert inside_outside.read_bytes() == b"overwrite?"
    # The hard link through the symlink member is to the *sandbox's* /etc/passwd.
    hard = (env.root / "dest" / "h").stat()
    assert hard.st_ino == (env.root / "etc" / "passwd").stat().st_ino


def test_upload_tar_hardlink_to_symlink_links_the_link(env: Env) -> None:
    data = make_tar(
        (member("s", tarfile.SYMTYPE, str(env.top / "canary")), None),
        (member("h", tarfile.LNKTYPE, "s"), None),
    )
    env.fs.upload_tar("/d", data)
    assert os.readlink(env.root / "d" / "h") == str(env.top / "canary")
    with pytest.raises(NotFound):
        env.fs.read("/d/h")


def test_upload_tar_twice_with_hardlinks_leaves_no_temp_names(env: Env) -> None:
    data = make_tar(
        (member("a"), b"A"),
        (member("h", tarfile.LNKTYPE, "a"), None),
        (member("a2", tarfile.LNKTYPE, "a"), None),
    )
    env.fs.upload_tar("/twice", data)
    env.fs.upload_tar("/twice", data)
    assert sorted(os.listdir(env.root / "twice")) == ["a", "a2", "h"]
    assert (env.root / "twice" / "a").stat().st_nlink == 3


def test_upload_tar_replaces_links_and_limits_size(env: Env) -> None:
    os.symlink(str(env.outside / "canary"), env.root / "victim")
    env.fs.upload_tar("/", make_tar((member("victim"), b"new")))
    assert not (env.root / "victim").is_symlink()
    assert (env.root / "victim").read_bytes() == b"new"
    small = SandboxFS(env.root, max_file=1000)
    data = make_tar((member("a"), b"a" * 600), (member("b"), b"b" * 600))
    with pytest.raises(InvalidRequest, match="limit") as ei:
        small.upload_tar("/sized", data)
    assert "'b'" in str(ei.value)
    assert not (env.root / "sized").exists()
    bomb = make_tar((member("zeros"), b"\0" * 5000), gz=True)
    assert len(bomb) < 1000
    with pytest.raises(InvalidRequest, match="limit"):
        small.upload_tar("/bomb", bomb)


@pytest.mark.parametrize("mode", ["w:bz2", "w:xz"])
def test_upload_tar_other_compressions(env: Env, mode: Literal["w:bz2", "w:xz"]) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tf:
        info = member("z.txt")
        info.size = 3
        tf.addfile(info, io.BytesIO(b"zzz"))
    assert env.fs.upload_tar("/c", buf.getvalue()) == 1
    assert env.fs.read("/c/z.txt") == b"zzz"


def test_upload_tar_caps_header_bytes(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """A giant PAX header (or a gzip bomb of one) counts against the stream cap."""
    from corral.backends import files

    monkeypatch.setattr(files, "_HEADER_ALLOWANCE", 50_000)
    info = member("small")
    info.pax_headers = {"comment": "c" * 200_000}
    data = make_tar((info, b"tiny"), gz=True)
    with pytest.raises(InvalidRequest, match="headers included"):
        SandboxFS(env.root, max_file=1000).upload_tar("/capped", data)
    assert not (env.root / "capped").exists()


def test_download_root(env: Env) -> None:
    os.symlink("/", env.root / "slash")
    with tarfile.open(fileobj=io.BytesIO(env.fs.download_tar("/"))) as tf:
        names = set(tf.getnames())
    assert names == {"etc", "etc/passwd", "tmp", "slash"}
    with tarfile.open(fileobj=io.BytesIO(env.fs.download_tar("/slash/.."))) as tf:
        assert set(tf.getnames()) == names


# ---------------------------------------------------------------- races

_libc = ctypes.CDLL(None, use_errno=True)
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> None:
    if _libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _race(
    env: Env,
    flip_name: str,
    work: Callable[[int], None],
    seconds: float = 1.5,
    until: Callable[[], bool] | None = None,
) -> int:
    """Flip root/<flip_name> between a real directory and symlinks to the outside (atomic
    exchange and unlink/recreate) while ``work`` runs; return how many work calls ran.

    ``until``: keep working past ``seconds`` until it is true (the race the test is about
    was observed), for at most a minute on a loaded machine; the caller asserts it."""
    d = env.root / flip_name
    alt = env.root / (flip_name + "-alt")
    d.mkdir(exist_ok=True)
    stop = threading.Event()
    errors: list[BaseException] = []

    def flipper() -> None:
        targets = [str(env.outside), "../outside", str(env.top), "../", "../../outside"]
        i = 0
        try:
            while not stop.is_set():
                i += 1
                try:
                    if not alt.is_symlink():
                        os.symlink(targets[i % len(targets)], alt)
                    if not d.is_symlink():
                        d.mkdir(exist_ok=True)  # the work may have removed it
                    _exchange(d, alt)  # d is now the link, alt the directory
                    time.sleep(0)
                    _exchange(d, alt)
                    if i % 5 == 0:  # a non-atomic flip too: rmdir, then a link in its place
                        os.rename(d, env.root / f"{flip_name}-{i}")
                        os.symlink(targets[i % len(targets)], d)
                        time.sleep(0)
                        os.unlink(d)
                        os.rename(env.root / f"{flip_name}-{i}", d)
                except OSError:
                    pass  # the work removed or created something meanwhile
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=flipper, daemon=True)
    t.start()
    n = 0
    seen: dict[str, int] = {}
    try:
        deadline = time.monotonic() + seconds
        cap = deadline + 60
        while time.monotonic() < deadline or (
            until is not None and not until() and time.monotonic() < cap
        ):
            try:
                work(n)
            except CorralError as e:  # refusals and "not found" are expected
                no_host_path(e, env)
                seen[type(e).__name__] = seen.get(type(e).__name__, 0) + 1
            n += 1
    finally:
        stop.set()
        t.join(10)
    assert not errors, errors
    print(f"race on {flip_name}: {n} operations, refused/failed: {seen}")
    for p in (d, alt):  # leave the tree without links to the outside
        if p.is_symlink():
            p.unlink()
    return n


def test_symlink_swap_race_never_writes_outside(env: Env) -> None:
    tar = make_tar((member("t/x"), b"tar"), (member("t/l", tarfile.SYMTYPE, "/"), None))

    def work(i: int) -> None:
        op = i % 9
        if op == 0:
            env.fs.write("/d/f", b"race")
        elif op == 1:
            env.fs.write("/d/sub/f", b"race")
        elif op == 2:
            env.fs.write("/d/a", b"race", append=True)
        elif op == 3:
            env.fs.mkdir("/d/m/n")
        elif op == 4:
            assert env.fs.read("/d/f") == b"race"
        elif op == 5:
            env.fs.upload_tar("/d/up", tar)
        elif op == 6:
            env.fs.remove("/d/sub", recursive=True)
        elif op == 7:
            assert CANARY not in env.fs.download_tar("/d")
        else:
            env.fs.remove("/d/f")

    n = _race(env, "d", work)
    assert n > 50
    # The env fixture asserts that nothing outside the root changed or appeared.


def test_recursive_remove_race_never_deletes_outside(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Proof that the race ran: the remove's walk met a symlink where it had seen (or was
    # about to enter) a directory, i.e. an open of a tree entry failed with ELOOP, and
    # other removes went down into a real t/d and deleted the files written there.
    met_link = 0
    emptied = 0
    removing = False
    real_open = env.fs._open_beneath

    def counting_open(top: int, parts: tuple[str, ...], flags: int) -> int:
        nonlocal met_link
        try:
            return real_open(top, parts, flags)
        except OSError as e:
            if removing and e.errno == errno.ELOOP:
                met_link += 1
            raise

    monkeypatch.setattr(env.fs, "_open_beneath", counting_open)

    def work(i: int) -> None:
        nonlocal removing, emptied
        # Built through SandboxFS too: host-side pathlib would itself follow the links.
        wrote = True
        try:
            env.fs.write("/t/d/x/y/f", b"x")
            env.fs.write("/t/d/g", b"g")
        except CorralError:
            wrote = False  # the flipper has t/d as a link right now
        removing = True
        try:
            env.fs.remove("/t", recursive=True)
        finally:
            removing = False
        if wrote and not (env.root / "t").exists():
            emptied += 1

    (env.root / "t").mkdir()
    _race(env, "t/d", work, until=lambda: met_link > 0 and emptied > 0)
    assert met_link > 0, "no remove ever met a swapped-in symlink: the race did not run"
    assert emptied > 0, "no remove ever deleted a real tree under t/d"


def test_openat2_wrapper(env: Env) -> None:
    fd = os.open(env.root, os.O_PATH | os.O_DIRECTORY)
    try:
        os.symlink("/", env.root / "link")
        with pytest.raises(FileNotFoundError) as ei:
            openat2(fd, "nope", os.O_RDONLY, resolve=RESOLVE_IN_ROOT)
        assert ei.value.filename == "nope"
        with pytest.raises(OSError) as ei2:
            openat2(fd, "link/etc", os.O_PATH, resolve=RESOLVE_BENEATH)
        assert ei2.value.errno == 18  # EXDEV: the absolute link would leave dirfd
        f = openat2(fd, "link/etc/passwd", os.O_RDONLY, resolve=RESOLVE_IN_ROOT)
        try:
            assert os.read(f, 100) == SANDBOX_PASSWD
            assert not os.get_inheritable(f)
        finally:
            os.close(f)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("err", "kind", "status", "text"),
    [
        (errno.EDQUOT, QuotaExceeded, 507, "Limits.disk"),
        (errno.ENOSPC, ScratchFull, 503, "scratch filesystem"),
    ],
)
def test_full_disk_is_its_own_error_kind(
    env: Env,
    monkeypatch: pytest.MonkeyPatch,
    err: int,
    kind: type[CorralError],
    status: int,
    text: str,
) -> None:
    """A full quota or scratch fs is no bad request: never a 400 (which the node would log
    as a refused path, a security event), and the half-written temp file goes."""

    def full(fd: int, data: object) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(files_mod, "_write_all", full)
    with pytest.raises(kind, match=text) as ei:
        env.fs.write("/tmp/big", b"x" * 100)
    assert ei.value.status == status and not isinstance(ei.value, InvalidRequest)
    assert "/tmp/big" in ei.value.message
    assert os.listdir(env.root / "tmp") == []
    # the kind crosses the wire and comes back as itself
    back = error_from_wire(ei.value.to_wire(), ei.value.status)
    assert type(back) is kind and back.message == ei.value.message


def test_open_root_callback_is_the_root(tmp_path: Path) -> None:
    """``open_root`` (a launched sandbox: its init's /proc/<pid>/root) replaces the path:
    each operation opens the root anew and closes it; its HostError (the sandbox is gone)
    reaches the caller, and nothing is written to the named path."""
    real = tmp_path / "real"
    real.mkdir()
    named = tmp_path / "named"
    named.mkdir()
    opened: list[int] = []

    def open_root() -> int:
        if not real.exists():
            raise HostError("the sandbox's root filesystem is not available")
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        opened.append(fd)
        return fd

    fs = SandboxFS(named, uid=os.getuid(), gid=os.getgid(), open_root=open_root)
    before = len(os.listdir("/proc/self/fd"))
    fs.write("/a/b.txt", b"hi")
    assert (real / "a" / "b.txt").read_bytes() == b"hi"
    assert fs.read("/a/b.txt") == b"hi"
    assert list(named.iterdir()) == []
    assert len(opened) == 2 and len(os.listdir("/proc/self/fd")) == before  # each closed
    (real / "a" / "b.txt").unlink()
    (real / "a").rmdir()
    real.rmdir()
    with pytest.raises(HostError, match="not available"):
        fs.write("/c", b"x")
    assert list(named.iterdir()) == []
