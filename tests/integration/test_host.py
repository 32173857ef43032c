"""corral.host and corral.images.mounts against the real kernel (root only).

Run with ``-s`` to see the timings printed by the tests (mount_erofs, idmapped clone,
overlay mount, create_subvol+quota, runc run_detached).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.errors import HostError, InvalidRequest, LayerCorrupt
from corral.host import _sys, loop, mounts, pagecache
from corral.host.btrfs import Scratch, qgroup_limit
from corral.host.cgroups import Cgroups, detect_mode
from corral.host.runtime import OCIRuntime
from corral.host.userns import UserNamespace
from corral.images.mounts import LayerMounts
from tests.integration.conftest import mount_options

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

SANDBOX_UID = 100000


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _report(what: str, ms: float) -> None:
    print(f"\n[timing] {what}: {ms:.2f} ms", file=sys.stderr)


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """A tmp dir for mounts; after the test nothing may be mounted below it."""
    try:
        yield tmp_path
    finally:
        left = mounts.mounts_under(tmp_path)
        for p in left:
            mounts.umount(p, detach=True)
        assert left == [], f"test left mounts behind: {left}"
        assert loop.backed_by(tmp_path) == {}, "test left loop devices behind"


@pytest.fixture
def xroot() -> Iterator[Path]:
    """Like ``root``, but searchable by every uid: runc in a user namespace bind-mounts
    the rootfs as the mapped uid, which must be able to walk the path to it (pytest's
    own tmp dirs are 0700)."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="corral-test-host-", dir="/tmp"))
    d.chmod(0o711)
    try:
        yield d
    finally:
        left = mounts.mounts_under(d)
        for p in left:
            mounts.umount(p, detach=True)
        shutil.rmtree(d, ignore_errors=True)
        assert left == [], f"test left mounts behind: {left}"


@pytest.fixture(scope="module")
def userns() -> Iterator[UserNamespace]:
    ns = UserNamespace.create(host_uid=SANDBOX_UID, size=65536)
    try:
        yield ns
    finally:
        ns.close()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scratch]:
    base = tmp_path_factory.mktemp("scratch")
    s = Scratch(base / "scratch.img", base / "mnt", 1 << 30)
    s.setup()
    try:
        yield s
    finally:
        for name in s.subvols():
            s.delete_subvol(name)
        s.teardown(delete_image=True)
        assert not mounts.is_mountpoint(base / "mnt")
        assert loop.backed_by(base) == {}, "scratch loop device not freed by autoclear"


@pytest.fixture
def cgroups() -> Iterator[Cgroups]:
    cg = Cgroups(subtree=f"corral-test-{uuid.uuid4().hex[:8]}")
    try:
        yield cg
    finally:
        for name in cg.list():
            for pid in cg.procs(name) if cg.exists(name) else []:
                os.kill(pid, 9)
            cg.remove(name)
        cg.remove_subtree_if_empty()
        assert not any((r / cg.subtree).exists() for r in cg.all_roots), "subtree left"


def make_erofs(src: Path, out: Path) -> Path:
    """EROFS image of ``src`` (files keep their owners: root, as the test runs as root)."""
    subprocess.run(["mkfs.erofs", "--quiet", "-zlz4", str(out), str(src)], check=True)
    return out


def make_layer(base: Path, name: str, files: dict[str, str]) -> Path:
    src = base / f"{name}-src"
    (src / "etc").mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    img = make_erofs(src, base / f"{name}.erofs")
    shutil.rmtree(src)
    return img


def busybox_layer(base: Path) -> Path:
    src = base / "busybox-src"
    for d in ("bin", "etc", "tmp", "proc", "sys", "dev", "root"):
        (src / d).mkdir(parents=True)
    shutil.copy("/bin/busybox", src / "bin" / "busybox")
    for applet in ("sh", "sleep", "stat", "touch", "echo", "cat", "id"):
        os.symlink("busybox", src / "bin" / applet)
    (src / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    img = make_erofs(src, base / "busybox.erofs")
    shutil.rmtree(src)
    return img


# -- mounts ---------------------------------------------------------------------------


def test_erofs_and_idmapped_clone(root: Path, userns: UserNamespace) -> None:
    img = make_layer(root, "l", {"etc/hello": "hi\n"})
    raw, idm = root / "raw", root / "idm"
    raw.mkdir()
    idm.mkdir()
    t0 = time.perf_counter()
    mounts.mount_erofs(img, raw)
    _report("mount_erofs", _ms(t0))
    try:
        assert mounts.is_mountpoint(raw)
        assert os.stat(raw / "etc").st_uid == 0
        t0 = time.perf_counter()
        mounts.mount_idmapped(raw, idm, userns.fd)
        _report("idmapped clone", _ms(t0))
        try:
            st = os.stat(idm / "etc" / "hello")
            assert (st.st_uid, st.st_gid) == (SANDBOX_UID, SANDBOX_UID)
            assert os.stat(idm / "etc").st_uid == SANDBOX_UID
            assert (idm / "etc" / "hello").read_text() == "hi\n"
            with pytest.raises(OSError) as e:
                (idm / "etc" / "new").write_text("x")
            assert e.value.errno == errno.EROFS
        finally:
            mounts.umount(idm)
        assert not mounts.is_mountpoint(idm)
    finally:
        mounts.umount(raw)
    assert mounts.mounts_under(root) == []


def test_erofs_loop_fallback(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels without file-backed EROFS answer ENOTBLK: a loop device with autoclear."""
    img = make_layer(root, "l", {"etc/hello": "hi\n"})
    target = root / "with space"  # mountinfo escapes it as \040
    target.mkdir()
    real_mount = mounts._sys.mount

    def no_file_backed(source, tgt, fstype, flags, data=None):  # type: ignore[no-untyped-def]
        if fstype == "erofs" and str(source) == str(img):
            raise OSError(errno.ENOTBLK, "Block device required")
        return real_mount(source, tgt, fstype, flags, data)

    monkeypatch.setattr(mounts._sys, "mount", no_file_backed)
    mounts.mount_erofs(img, target)
    try:
        assert (target / "etc" / "hello").read_text() == "hi\n"
        assert list(loop.backed_by(root).values()) == [img]
        assert mounts.mounts_under(root) == [target]
    finally:
        mounts.umount(target)
    assert loop.backed_by(root) == {}  # autoclear freed it with the unmount


def test_erofs_direct_io_falls_back_to_buffered(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel whose EROFS refuses ``directio`` (EINVAL) gets a buffered mount."""
    img = make_layer(root, "l", {"etc/hello": "hi\n"})
    target = root / "m"
    target.mkdir()
    real_mount = mounts._sys.mount
    refused: list[str] = []

    def no_directio(source, tgt, fstype, flags, data=None):  # type: ignore[no-untyped-def]
        if fstype == "erofs" and data and "directio" in data:
            refused.append(data)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_mount(source, tgt, fstype, flags, data)

    monkeypatch.setattr(mounts._sys, "mount", no_directio)
    mounts.mount_erofs(img, target, direct=True)
    try:
        assert refused == ["directio"]
        assert (target / "etc" / "hello").read_text() == "hi\n"
        assert "directio" not in mount_options(target)
    finally:
        mounts.umount(target)


def test_erofs_with_a_data_blob(root: Path) -> None:
    """``mount_erofs(devices=...)``: a metadata image whose data is in a blob file
    (``mkfs.erofs --blobdev``), the blob a plain file; a blob path with a comma (the mount
    options' separator) is refused before anything is mounted."""
    src = root / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "hello").write_text("hi\n")
    big = os.urandom(200_000)
    (src / "etc" / "big").write_bytes(big)
    meta, blob = root / "meta.erofs", root / "data.blob"
    subprocess.run(
        ["mkfs.erofs", "--quiet", f"--blobdev={blob}", "--chunksize=4096", str(meta), str(src)],
        check=True,
    )
    assert meta.stat().st_size < blob.stat().st_size  # the data is in the blob
    target = root / "m"
    target.mkdir()
    mounts.mount_erofs(meta, target, devices=[blob])
    try:
        assert (target / "etc" / "hello").read_text() == "hi\n"
        assert (target / "etc" / "big").read_bytes() == big
    finally:
        mounts.umount(target)
    odd = root / "a,b.blob"
    blob.rename(odd)
    with pytest.raises(HostError, match="comma"):
        mounts.mount_erofs(meta, target, devices=[odd])
    assert not mounts.is_mountpoint(target)


def test_overlay_fd_is_a_detached_mount(root: Path, scratch: Scratch) -> None:
    """mounts.overlay_fd: the overlay works through its fd, appears in no mount table of
    ours, and is gone (its upper's subvolume deletable) once the fd is closed."""
    img = make_layer(root, "one", {"etc/os": "one\n"})
    img2 = make_layer(root, "two", {"etc/two": "2\n"})
    lowers = []
    for name, im in (("one", img), ("two", img2)):
        raw = root / "raw" / name
        raw.mkdir(parents=True)
        mounts.mount_erofs(im, raw)
        lowers.append(raw)
    sub = scratch.create_subvol("ovl-fd", quota=None)
    try:
        (sub / "upper").mkdir()
        (sub / "work").mkdir()
        before = Path("/proc/self/mountinfo").read_text().count(" - overlay ")
        fd = mounts.overlay_fd(lowers, sub / "upper", sub / "work")
        try:
            assert Path("/proc/self/mountinfo").read_text().count(" - overlay ") == before
            etc = os.open("etc", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            try:
                assert sorted(os.listdir(etc)) == ["os", "two"]
                w = os.open("new", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=etc)
                os.write(w, b"x")
                os.close(w)
            finally:
                os.close(etc)
            assert (sub / "upper" / "etc" / "new").read_bytes() == b"x"
        finally:
            os.close(fd)
    finally:
        for p in mounts.mounts_under(root):
            mounts.umount(p)
        scratch.delete_subvol("ovl-fd")
    assert "ovl-fd" not in scratch.subvols()


def test_overlay_two_idmapped_lowers_upper_in_subvol(
    root: Path, userns: UserNamespace, scratch: Scratch
) -> None:
    base = make_layer(root, "base", {"etc/os": "base\n", "etc/only_base": "b\n"})
    top = make_layer(root, "top", {"etc/os": "top\n", "etc/only_top": "t\n"})
    lowers = []
    for name, img in (("top", top), ("base", base)):
        raw, idm = root / "raw" / name, root / "idm" / name
        raw.mkdir(parents=True)
        idm.mkdir(parents=True)
        mounts.mount_erofs(img, raw)
        mounts.mount_idmapped(raw, idm, userns.fd)
        lowers.append(idm)
    sub = scratch.create_subvol("ovl-test", quota=64 << 20)
    target = root / "rootfs"
    target.mkdir()
    try:
        for d in ("upper", "work"):
            (sub / d).mkdir()
            os.chown(sub / d, SANDBOX_UID, SANDBOX_UID)
        t0 = time.perf_counter()
        mounts.mount_overlay(lowers, sub / "upper", sub / "work", target)
        _report("overlay mount (2 idmapped lowers)", _ms(t0))
        try:
            assert (target / "etc" / "os").read_text() == "top\n"
            assert (target / "etc" / "only_base").read_text() == "b\n"
            assert (target / "etc" / "only_top").read_text() == "t\n"
            assert os.stat(target / "etc").st_uid == SANDBOX_UID
            (target / "etc" / "os").write_text("changed\n")  # copy-up into the subvol
            assert (sub / "upper" / "etc" / "os").read_text() == "changed\n"
            assert (lowers[0] / "etc" / "os").read_text() == "top\n"
        finally:
            mounts.umount(target)
        # read-only overlay of the same lowers
        mounts.mount_overlay(lowers, None, None, target)
        try:
            assert (target / "etc" / "os").read_text() == "top\n"
            with pytest.raises(OSError):
                (target / "etc" / "x").write_text("x")
        finally:
            mounts.umount(target)
    finally:
        for p in mounts.mounts_under(root):
            mounts.umount(p)
        scratch.delete_subvol("ovl-test")


def test_overlay_many_layers_long_paths(root: Path) -> None:
    n = 40
    deep = root / ("d" * 100) / ("e" * 100)  # ~200+ byte paths: 40 of them > one page
    imgs = [make_layer(root, f"l{i}", {f"etc/l{i}": str(i), "etc/who": str(i)}) for i in range(n)]
    lowers = []
    for i, img in enumerate(imgs):
        d = deep / f"layer-{i:03d}"
        d.mkdir(parents=True)
        mounts.mount_erofs(img, d)
        lowers.append(d)
    assert len(":".join(map(str, lowers))) > 4096
    target = root / "t"
    target.mkdir()
    try:
        t0 = time.perf_counter()
        mounts.mount_overlay(list(reversed(lowers)), None, None, target)  # top = l39
        _report(f"overlay mount ({n} lowers)", _ms(t0))
        assert (target / "etc" / "who").read_text() == str(n - 1)
        assert all((target / "etc" / f"l{i}").read_text() == str(i) for i in range(n))
        mounts.umount(target)
        # the fallback for kernels without lowerdir+: mount(2) with /proc/self/fd paths
        mounts._mount_overlay_legacy(lowers, None, None, target, ())
        assert (target / "etc" / "who").read_text() == "0"
        mounts.umount(target)
    finally:
        for p in mounts.mounts_under(root):
            mounts.umount(p)


def test_bind_tmpfs_umount_and_mountinfo(root: Path) -> None:
    src, dst, tmp = root / "src", root / "dst", root / "tmp"
    for d in (src, dst, tmp):
        d.mkdir()
    (src / "f").write_text("x")
    mounts.mount_bind(src, dst, readonly=True)
    try:
        assert mounts.is_mountpoint(dst)  # same filesystem: st_dev would not tell
        assert (dst / "f").read_text() == "x"
        with pytest.raises(OSError) as e:
            (dst / "g").write_text("y")
        assert e.value.errno == errno.EROFS
        mounts.mount_tmpfs(tmp, size=1 << 20, mode=0o700, uid=SANDBOX_UID, gid=SANDBOX_UID)
        nested = tmp / "n"
        nested.mkdir()
        mounts.mount_tmpfs(nested, size=1 << 20)
        st = os.stat(tmp)
        assert (st.st_uid, st.st_mode & 0o777) == (SANDBOX_UID, 0o700)
        with pytest.raises(OSError) as e:
            (nested / "big").write_bytes(b"x" * (2 << 20))
        assert e.value.errno == errno.ENOSPC
        assert mounts.mounts_under(root) == [nested, tmp, dst]  # deepest first
        with pytest.raises(HostError, match="EBUSY"):
            mounts.umount(tmp)  # a mount below it
    finally:
        for p in mounts.mounts_under(root):
            mounts.umount(p)
    # recursive read-only bind: the submount is read-only too
    mounts.mount_tmpfs(src, size=1 << 20)
    (src / "sub").mkdir()
    mounts.mount_tmpfs(src / "sub", size=1 << 20)
    mounts.mount_bind(src, dst, readonly=True, recursive=True)
    try:
        with pytest.raises(OSError) as e:
            (dst / "sub" / "g").write_text("y")
        assert e.value.errno == errno.EROFS
        (src / "sub" / "g").write_text("y")  # the source stays writable
    finally:
        for p in mounts.mounts_under(root):
            mounts.umount(p)
    mounts.umount(dst)  # not mounted: no error
    mounts.umount(root / "missing")
    assert not mounts.is_mountpoint(dst)
    with pytest.raises(HostError, match="ENOENT"):
        mounts.mount_bind(root / "missing", dst)


# -- btrfs quotas ---------------------------------------------------------------------


def test_cleaner_queue_is_counted_and_waited_for(scratch: Scratch) -> None:
    """Deleted subvolumes are dropped by the cleaner later; the scratch counts its queue
    and waits until it is empty (the benches' settle), and the space comes back."""
    assert scratch.pending_cleanup() is not None  # this kernel has the ioctl (6.13+)
    for i in range(20):
        sub = scratch.create_subvol(f"c{i}", quota=None)
        (sub / "f").write_bytes(os.urandom(1 << 20))
    scratch.sync()
    for i in range(20):
        scratch.delete_subvol(f"c{i}")
    assert scratch.wait_cleaned(60)
    assert scratch.pending_cleanup() == 0
    assert scratch.subvols() == []


def test_quota_stops_writes_through_overlay(root: Path, scratch: Scratch) -> None:
    times = []
    for i in range(20):
        t0 = time.perf_counter()
        scratch.create_subvol(f"q{i}", quota=10 << 20)
        times.append(_ms(t0))
    for i in range(1, 20):
        scratch.delete_subvol(f"q{i}")
    times.sort()
    _report(f"create_subvol+quota median of 20 (max {times[-1]:.2f})", times[10])
    lower_img = make_layer(root, "low", {"etc/a": "a"})
    lower, target = root / "lower", root / "rootfs"
    lower.mkdir()
    target.mkdir()
    sub = scratch.mountpoint / "q0"
    (sub / "upper").mkdir()
    (sub / "work").mkdir()
    mounts.mount_erofs(lower_img, lower)
    try:
        mounts.mount_overlay([lower], sub / "upper", sub / "work", target)
        written = 0
        chunk = os.urandom(1 << 20)
        limit = qgroup_limit(10 << 20)  # the quota plus its metadata allowance
        with pytest.raises(OSError) as e:
            with open(target / "fill", "wb") as f:
                for _ in range((limit >> 20) + 20):
                    f.write(chunk)
                    f.flush()
                    os.fsync(f.fileno())
                    written += len(chunk)
        assert e.value.errno in (errno.EDQUOT, errno.ENOSPC)
        assert limit - (2 << 20) <= written <= limit, written
        (target / "fill").unlink()
        scratch.sync()
        (target / "again").write_bytes(chunk)  # freed space is usable again
        mounts.umount(target)
    finally:
        for p in mounts.mounts_under(root):
            mounts.umount(p)
    scratch.sync()
    assert scratch.usage("q0") < 2 << 20
    # the scratch filesystem is healthy: other subvolumes still write freely
    other = scratch.create_subvol("other", quota=None)
    (other / "f").write_bytes(os.urandom(20 << 20))
    scratch.sync()  # time the snapshot, not the writeback of 20 MiB it would force
    t0 = time.perf_counter()
    snap = scratch.snapshot("other", "other-snap", quota=40 << 20)
    _report("btrfs snapshot of a 20 MiB subvol", _ms(t0))
    assert (snap / "f").stat().st_size == 20 << 20
    assert sorted(scratch.subvols()) == ["other", "other-snap", "q0"]
    for name in ("q0", "other", "other-snap"):
        scratch.delete_subvol(name)
    scratch.delete_subvol("q0")  # already gone: no error
    assert scratch.subvols() == []
    scratch.remove_stale_qgroups()
    assert shutil.disk_usage("/").free > 1 << 30


# -- cgroups --------------------------------------------------------------------------


def test_cgroups_limits_oom_freeze(cgroups: Cgroups) -> None:
    assert cgroups.mode == detect_mode()
    name = "sb-oom"
    assert cgroups.oci_path(name) == f"/{cgroups.subtree}/{name}"
    cgroups.create(name, cpus=0.5, memory=32 << 20, pids=64, swap=0)
    assert cgroups.exists(name) and cgroups.list() == [name]
    assert cgroups.oom_kills(name) == 0
    # the hog waits on stdin until it is in the cgroup, then allocates 200 MiB
    hog = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; sys.stdin.readline(); b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096])",
        ],  # noqa: E501
        stdin=subprocess.PIPE,
    )
    try:
        cgroups.add_pid(name, hog.pid)
        assert cgroups.procs(name) == [hog.pid]
        assert cgroups.pids_current(name) >= 1
        cgroups.freeze(name)
        cgroups.thaw(name)
        assert hog.stdin is not None
        hog.stdin.write(b"go\n")
        hog.stdin.close()
        rc = hog.wait(timeout=30)
    finally:
        if hog.poll() is None:
            hog.kill()
            hog.wait()
    assert rc == -9
    assert cgroups.oom_kills(name) >= 1
    cgroups.remove(name)
    assert not cgroups.exists(name) and cgroups.list() == []
    cgroups.remove(name)  # missing: no error


def test_cgroups_pids_limit(cgroups: Cgroups) -> None:
    cgroups.create("sb-pids", cpus=0, memory=64 << 20, pids=3, swap=None)
    sh = subprocess.Popen(
        ["/bin/sh", "-c", "read x; for i in 1 2 3 4 5; do sleep 5 & done; wait"],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        cgroups.add_pid("sb-pids", sh.pid)
        assert sh.stdin is not None
        sh.stdin.write(b"go\n")
        sh.stdin.close()
        deadline = time.monotonic() + 30
        while cgroups.pids_current("sb-pids") < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # until the forks fill the limit (the shell + 2 sleeps)
        assert cgroups.pids_current("sb-pids") <= 3
        assert cgroups.memory_current("sb-pids") > 0  # the forks were charged here
    finally:
        for pid in cgroups.procs("sb-pids"):
            os.kill(pid, 9)
        sh.wait()
    assert b"fork" in (sh.stderr.read() if sh.stderr else b"").lower()


# -- layer mounts ---------------------------------------------------------------------


def test_layer_mounts_with_hot_blocks_count_like_without(root: Path) -> None:
    """Hot blocks only watch: refcounts, unmounts and a failed create's release
    (``record=False``) behave as without them; the first release records once."""
    from corral.images.hotblocks import HotBlocks

    digest = "sha256:" + "e" * 64
    image = make_layer(root, "e", {"etc/e": "e"})
    saved: list[str] = []

    class Store:
        def hot_profile(self, d: str) -> bytes | None:
            return None

        def save_hot_profile(self, d: str, data: bytes, *, replace: bool = False) -> None:
            saved.append(d)

    hot = HotBlocks(Store())
    recorded: list[str] = []
    real_record = hot.record
    hot.record = lambda d, p: (recorded.append(d), real_record(d, p))  # type: ignore[method-assign]
    lm = LayerMounts(root / "hot", lambda d: image, lambda d: None, None, hot=hot)
    try:
        p = lm.acquire(digest)
        lm.acquire(digest)
        lm.acquire(digest)
        lm.release(digest, record=False)
        assert recorded == [] and lm.mounted() == {digest: 2}
        lm.release(digest)
        assert recorded == [digest] and lm.mounted() == {digest: 1}
        assert mounts.is_mountpoint(p)
        lm.release(digest)
        assert lm.mounted() == {} and not mounts.is_mountpoint(p)
        assert hot.drain(30)
    finally:
        for m in mounts.mounts_under(root):
            mounts.umount(m)


def test_layer_mounts_with_direct_io_cache_a_layer_once(root: Path) -> None:
    """``direct_io``: a layer mounted with direct I/O reads its files' data past the layer
    file's page cache (reading them leaves only the metadata of the file cached; the same
    reads through a buffered mount cache the data a second time), gets no hot-block profile, and ``auto`` picks
    direct I/O for a file on a local disk filesystem and buffered reads on tmpfs."""
    from corral.images.hotblocks import HotBlocks, resident_bytes
    from corral.images.mounts import LOCAL_DISK_FS

    body = os.urandom(1 << 19).hex()  # 1 MiB of text: several MiB-sized reads' worth
    image = make_layer(root, "d", {"etc/big": body})
    with open(image, "rb") as f:
        os.fsync(f.fileno())  # as a store's layer file is: clean, so it can be evicted
    digest = "sha256:" + "d" * 64
    recorded: list[str] = []

    class Store:
        def hot_profile(self, d: str) -> bytes | None:
            return None

        def save_hot_profile(self, d: str, data: bytes, *, replace: bool = False) -> None:
            pass

    def layers(name: str, mode: str, file: Path) -> LayerMounts:
        hot = HotBlocks(Store())
        real_record = hot.record
        hot.record = lambda d, p: (recorded.append(d), real_record(d, p))  # type: ignore[method-assign]
        return LayerMounts(
            root / name, lambda d: file, lambda d: None, None, hot=hot, direct_io=mode
        )

    tmpfs = root / "tmpfs"
    tmpfs.mkdir()
    mounts.mount_tmpfs(tmpfs, 16 << 20)
    try:
        assert _sys.fs_type(image) in LOCAL_DISK_FS, "the test's tmp dir is on a local disk"
        for mode, direct in (("on", True), ("off", False), ("auto", True)):
            lm = layers(mode, mode, image)
            pagecache.evict(image)
            p = lm.acquire(digest)
            assert ("directio" in mount_options(root / mode / "raw" / ("d" * 64))) is direct, mode
            assert (p / "etc" / "big").read_text() == body
            # Direct: only metadata goes through the file's page cache (here the first
            # page: superblock, inodes, the directory), the data does not.
            cached, size = resident_bytes(image), image.stat().st_size
            assert cached <= 16 << 10 if direct else cached >= size // 2, (mode, cached, size)
            lm.release(digest)
            assert recorded == ([] if direct else [digest]), mode
            recorded.clear()
            assert lm.mounted() == {} and not mounts.is_mountpoint(p)
        on_tmpfs = tmpfs / "d.erofs"
        shutil.copyfile(image, on_tmpfs)
        lm = layers("auto-tmpfs", "auto", on_tmpfs)
        lm.acquire(digest)
        assert "directio" not in mount_options(root / "auto-tmpfs" / "raw" / ("d" * 64))
        lm.release(digest, record=False)
        with pytest.raises(InvalidRequest, match="direct_io 'yes'"):
            LayerMounts(root / "bad", lambda d: image, lambda d: None, None, direct_io="yes")
    finally:
        for m in reversed(mounts.mounts_under(root)):
            mounts.umount(m)


def test_layer_mounts_take_the_lease_beside_the_verification_and_before_the_mount(
    root: Path,
) -> None:
    """The lease is taken in a thread of its own while the layer is verified (both are
    store round trips), and is on the store before the EROFS mount; a layer that fails
    its verification leaves no lease, and a lease that cannot be taken leaves no mount."""
    from corral.errors import StoreUnavailable

    good, bad, gone = ("sha256:" + c * 64 for c in "789")
    image = make_layer(root, "f", {"etc/f": "f"})
    mroot = root / "leased"
    events: list[tuple[str, str]] = []
    in_verify = threading.Event()
    lease_started = threading.Event()

    class Leases:
        def take(self, d: str) -> None:
            lease_started.set()
            assert in_verify.wait(30)  # taken while the layer is being verified
            events.append(("take", d))
            assert not mounts.is_mountpoint(mroot / "raw" / d.split(":")[1])
            if d == gone:
                raise StoreUnavailable("the layer store is unavailable (test)")

        def drop(self, d: str) -> None:
            events.append(("drop", d))

    def verify(d: str) -> None:
        in_verify.set()
        assert lease_started.wait(30)  # both under way at once
        if d == bad:
            raise LayerCorrupt(f"layer {d} does not match its digest")

    lm = LayerMounts(mroot, lambda d: image, verify, None, leases=Leases())  # type: ignore[arg-type]
    try:
        p = lm.acquire(good)
        assert events == [("take", good)] and mounts.is_mountpoint(p)
        for digest, error in ((bad, LayerCorrupt), (gone, StoreUnavailable)):
            in_verify.clear()
            lease_started.clear()
            events.clear()
            with pytest.raises(error):
                lm.acquire(digest)
            assert events == ([("take", bad), ("drop", bad)] if digest == bad else [("take", gone)])
        assert list(lm.mounted()) == [good]
        lm.release(good)
        assert lm.mounted() == {} and not mounts.is_mountpoint(p)
    finally:
        for m in mounts.mounts_under(root):
            mounts.umount(m)


def test_layer_mounts_linger_after_the_last_user_then_sweep(root: Path) -> None:
    """With ``linger``, the last release keeps the layer mounted and leased; an acquire
    meanwhile takes it without verifying or mounting again; a sweep before the linger is
    up keeps it, one after unmounts it and drops the lease; unmount_all takes lingering
    layers too. Each time a layer starts to linger the sweeper is woken (``lingered``),
    and :meth:`next_due` tells it when the longest-lingering one is due."""
    digest, other = ("sha256:" + c * 64 for c in "de")
    image = make_layer(root, "linger", {"etc/l": "l"})
    verified: list[str] = []
    events: list[tuple[str, str]] = []
    woken: list[float | None] = []

    class Leases:
        def take(self, d: str) -> None:
            events.append(("take", d))

        def drop(self, d: str) -> None:
            events.append(("drop", d))

    lm = LayerMounts(
        root / "linger-mnt",
        lambda d: image,
        verified.append,
        None,
        leases=Leases(),  # type: ignore[arg-type]
        linger=30.0,
        lingered=lambda: woken.append(lm.next_due()),
    )
    try:
        assert lm.next_due() is None
        p = lm.acquire(digest)
        assert woken == [] and lm.next_due() is None  # used: not lingering
        before = time.monotonic()
        lm.release(digest)
        released = time.monotonic()
        assert len(woken) == 1 and woken[0] is not None
        assert before + 30.0 <= woken[0] <= released + 30.0 and lm.next_due() == woken[0]
        assert lm.mounted() == {} and lm.lingering() == [digest]
        assert mounts.is_mountpoint(p) and events == [("take", digest)]
        assert lm.acquire(digest) == p  # taken back: no verify, no mount, no new lease
        assert verified == [digest] and events == [("take", digest)]
        assert lm.mounted() == {digest: 1} and lm.lingering() == [] and lm.next_due() is None
        lm.release(digest)
        assert len(woken) == 2 and woken[1] is not None and woken[1] >= woken[0]
        assert lm.sweep(now=released + 29.0) == []  # within the linger (of either release)
        assert mounts.is_mountpoint(p)
        assert lm.sweep(now=time.monotonic() + 30.0) == [digest]
        assert lm.lingering() == [] and not mounts.is_mountpoint(p) and lm.next_due() is None
        assert events == [("take", digest), ("drop", digest)]
        assert lm.acquire(digest) == p and verified == [digest, digest]  # mounted afresh
        lm.release(digest)
        q = lm.acquire(other)
        lm.unmount_all()  # node shutdown: the lingering and the used alike
        assert not mounts.is_mountpoint(p) and not mounts.is_mountpoint(q)
        assert lm.lingering() == [] and lm.mounted() == {}
    finally:
        for m in mounts.mounts_under(root):
            mounts.umount(m)


def test_layer_mounts_refcount_and_adopt(root: Path, userns: UserNamespace) -> None:
    imgs = {
        "sha256:" + "a" * 64: make_layer(root, "a", {"etc/a": "a"}),
        "sha256:" + "b" * 64: make_layer(root, "b", {"etc/b": "b"}),
    }
    da, db = sorted(imgs)
    verified: list[str] = []

    def verify(d: str) -> None:
        verified.append(d)
        if d == "sha256:" + "c" * 64:
            raise LayerCorrupt(f"layer {d} does not match its digest")

    resolve = lambda d: imgs.get(d, root / "a.erofs")  # noqa: E731
    mroot = root / "layers"
    lm = LayerMounts(mroot, resolve, verify, userns)
    try:
        p1 = lm.acquire(da)
        p2 = lm.acquire(da)
        assert p1 == p2 == mroot / "idmap" / ("a" * 64)
        assert os.stat(p1 / "etc" / "a").st_uid == SANDBOX_UID
        assert verified == [da]
        assert len(mounts.mounts_under(mroot)) == 2  # one raw + one idmapped, once
        lm.release(da)
        assert mounts.is_mountpoint(p1)
        lm.release(da)
        assert mounts.mounts_under(mroot) == []
        with pytest.raises(HostError):
            lm.release(da)
        with pytest.raises(LayerCorrupt):
            lm.acquire("sha256:" + "c" * 64)
        assert mounts.mounts_under(mroot) == []

        # many threads at once: still one mount
        verified.clear()
        threads = [threading.Thread(target=lm.acquire, args=(db,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert lm.mounted() == {db: 8} and verified == [db]
        lm.acquire(da)

        # an agent restart: a new manager adopts db with 2 users and drops da
        lm2 = LayerMounts(mroot, resolve, verify, userns)
        verified.clear()
        lm2.adopt({db: 2})
        assert lm2.mounted() == {db: 2} and verified == []
        assert not mounts.is_mountpoint(mroot / "raw" / ("a" * 64))
        assert mounts.is_mountpoint(mroot / "idmap" / ("b" * 64))
        lm2.release(db)
        lm2.release(db)
        assert mounts.mounts_under(mroot) == []

        # without a userns the raw mount is the lower
        lm3 = LayerMounts(root / "plain", resolve, verify, None)
        p = lm3.acquire(da)
        assert p == root / "plain" / "raw" / ("a" * 64)
        assert os.stat(p / "etc" / "a").st_uid == 0
        lm3.unmount_all()
        assert lm3.mounted() == {}
    finally:
        for p in mounts.mounts_under(root):
            mounts.umount(p)


# -- OCI runtime ----------------------------------------------------------------------


def _bundle(bundle: Path, rootfs: Path, args: list[str], cgroups_path: str) -> Path:
    bundle.mkdir(parents=True, exist_ok=True)
    subprocess.run(["runc", "spec"], cwd=bundle, check=True)
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["root"] = {"path": str(rootfs), "readonly": True}
    cfg["process"]["terminal"] = False
    cfg["process"]["args"] = args
    cfg["linux"]["cgroupsPath"] = cgroups_path
    (bundle / "config.json").write_text(json.dumps(cfg))
    return bundle


def _plain_rootfs(base: Path) -> Path:
    rootfs = base / "rootfs"
    for d in ("bin", "proc", "sys", "dev", "tmp"):
        (rootfs / d).mkdir(parents=True)
    shutil.copy("/bin/busybox", rootfs / "bin" / "busybox")
    for applet in ("sh", "sleep", "echo"):
        os.symlink("busybox", rootfs / "bin" / applet)
    return rootfs


@pytest.mark.parametrize("prefer", [None, "runc", "crun"])
async def test_runc_run_detached_state_kill_delete(
    root: Path, cgroups: Cgroups, prefer: str | None
) -> None:
    rt = OCIRuntime.detect(cgroups.mode, root_base=root / "rt", prefer=prefer)
    assert rt.name == (prefer or "crun")
    assert rt.legacy_view == (rt.name == "crun" and cgroups.mode == "hybrid")
    cid = f"corral-test-{uuid.uuid4().hex[:8]}"
    bundle = _bundle(
        root / "bundle",
        _plain_rootfs(root),
        ["/bin/sh", "-c", "echo hello-fd3 >&3; exec sleep 60"],
        cgroups.oci_path(cid),
    )
    r, w = os.pipe()
    try:
        t0 = time.perf_counter()
        await rt.run_detached(cid, bundle, pass_fd=w)
        _report(f"{rt.name} run_detached", _ms(t0))
        os.close(w)
        w = -1
        assert os.read(r, 100) == b"hello-fd3\n"
        st = await rt.state(cid)
        assert st is not None and st["status"] == "running" and st["pid"] > 0
        assert cgroups.exists(cid) and st["pid"] in cgroups.procs(cid)
        assert [c["id"] for c in await rt.list()] == [cid]
        t0 = time.perf_counter()
        await rt.pause(cid)
        _report(f"{rt.name} pause", _ms(t0))
        assert (await rt.state(cid) or {})["status"] == "paused"
        await rt.resume(cid)
        await rt.kill(cid, "KILL")
        for _ in range(100):
            if (await rt.state(cid) or {}).get("status") == "stopped":
                break
            await asyncio.sleep(0.01)
        await rt.delete(cid)
        assert await rt.state(cid) is None
        await rt.delete(cid)  # missing: no error
        await rt.kill(cid)  # missing: no error
        assert await rt.list() == []
        assert cgroups.list() == []
        # a paused container is deleted too (a v1-frozen task ignores SIGKILL until thawed)
        await rt.run_detached(cid, bundle)
        await rt.pause(cid)
        t0 = time.perf_counter()
        await rt.delete(cid, force=True)
        _report(f"{rt.name} delete of a paused container", _ms(t0))
        assert await rt.state(cid) is None and cgroups.list() == []
        with pytest.raises(HostError, match="run"):
            await rt.run_detached(cid + "-bad", root / "no-such-bundle")
    finally:
        if w >= 0:
            os.close(w)
        os.close(r)
        await rt.delete(cid, force=True)


async def test_runc_userns_over_idmapped_layers(
    xroot: Path, userns: UserNamespace, scratch: Scratch, cgroups: Cgroups
) -> None:
    """The whole rootfs chain: idmapped EROFS lower + btrfs upper + runc in a userns."""
    root = xroot
    rt = OCIRuntime.detect(cgroups.mode, root_base=root / "rt")
    lm = LayerMounts(root / "layers", lambda d: busybox_layer(root), lambda d: None, userns)
    digest = "sha256:" + "e" * 64
    cid = f"corral-test-{uuid.uuid4().hex[:8]}"
    sub = scratch.create_subvol(cid, quota=16 << 20)
    target = root / "rootfs"
    target.mkdir()
    r, w = os.pipe()
    try:
        lower = lm.acquire(digest)
        for d in ("upper", "work"):
            (sub / d).mkdir()
            os.chown(sub / d, SANDBOX_UID, SANDBOX_UID)
        mounts.mount_overlay([lower], sub / "upper", sub / "work", target)
        script = "stat -c %u /etc >&3; touch /etc/new && echo wrote >&3; id -u >&3"
        bundle = _bundle(root / "bundle", target, ["/bin/sh", "-c", script], cgroups.oci_path(cid))
        cfg = json.loads((bundle / "config.json").read_text())
        cfg["root"]["readonly"] = False
        cfg["linux"]["namespaces"].append({"type": "user"})
        m = [{"containerID": 0, "hostID": SANDBOX_UID, "size": 65536}]
        cfg["linux"]["uidMappings"] = cfg["linux"]["gidMappings"] = m
        cfg["mounts"] = [x for x in cfg["mounts"] if x["destination"] != "/sys/fs/cgroup"]
        (bundle / "config.json").write_text(json.dumps(cfg))
        await rt.run_detached(cid, bundle, pass_fd=w)
        os.close(w)
        w = -1
        out = b""
        while chunk := os.read(r, 100):
            out += chunk
        assert out.decode().split() == ["0", "wrote", "0"]
        st = os.stat(sub / "upper" / "etc" / "new")
        assert (st.st_uid, st.st_gid) == (SANDBOX_UID, SANDBOX_UID)
    finally:
        if w >= 0:
            os.close(w)
        os.close(r)
        await rt.delete(cid, force=True)
        mounts.umount(target)
        lm.unmount_all()
        scratch.delete_subvol(cid)
