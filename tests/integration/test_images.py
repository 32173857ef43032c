"""Layer store and image builders against the real kernel (EROFS, overlayfs) and tools
(mkfs.erofs, mmdebstrap, pip). Root only.

The Debian base (minbase + python3 + pip) is built once into a store under
/var/tmp/corral-test-store/ and reused by later runs; it is rebuilt when missing or
corrupt, so a fresh CI machine builds it from scratch (about 40 s here).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from corral.errors import (
    BuildError,
    Conflict,
    ImageNotFound,
    InvalidRequest,
    LayerCorrupt,
    LayerNotFound,
)
from corral.images.build import (
    RESOLV_CONF_PLACEHOLDER,
    build_debian,
    build_dir,
    build_pip,
    build_run,
    build_tar,
    import_docker_save,
    import_oci,
)
from corral.images.store import LayerStore
from corral.spec import ImageInfo
from tests.conftest import TEST_STORE

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod, mounts)")

DEBIAN_IMAGE = "test/debian"  # shared with tests/integration/conftest.py
OPAQUE = "trusted.overlay.opaque"


# --------------------------------------------------------------------------- helpers


def _mounts_under(path: Path) -> list[str]:
    base = str(path)
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p == base or p.startswith(base + "/")]


@contextmanager
def stack(store: LayerStore, layers: list[str], where: Path) -> Iterator[Path]:
    """Mount ``layers`` (bottom first) read-only with mount(8): erofs each, overlay on top."""
    where.mkdir(parents=True, exist_ok=True)
    mounted: list[Path] = []
    try:
        lowers = []
        for i, digest in enumerate(reversed(layers)):
            mp = where / f"l{i}"
            mp.mkdir()
            subprocess.run(
                ["mount", "-t", "erofs", "-o", "ro", str(store.path_of(digest)), str(mp)],
                check=True,
            )
            mounted.append(mp)
            lowers.append(str(mp))
        if len(lowers) == 1:
            yield Path(lowers[0])
            return
        merged = where / "merged"
        merged.mkdir()
        subprocess.run(
            [
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                "lowerdir=" + ":".join(lowers),
                str(merged),
            ],
            check=True,
        )
        mounted.append(merged)
        yield merged
    finally:
        for mp in reversed(mounted):
            subprocess.run(["umount", str(mp)], check=False)
        assert not _mounts_under(where), "test left mounts behind"


def _tree(root: Path, order: list[str]) -> None:
    """A small tree with the interesting kinds of entries, created in ``order``."""
    root.mkdir()
    steps = {
        "file": lambda: (root / "file.txt").write_text("hello\n"),
        "dir": lambda: (root / "sub").mkdir(),
        "nested": lambda: (root / "sub" / "owned").write_text("by 1234\n"),
        "link": lambda: os.symlink("file.txt", root / "link"),
        "suid": lambda: (root / "suid").write_bytes(b"#!/bin/sh\n"),
    }
    for name in order:
        steps[name]()
    os.chown(root / "sub" / "owned", 1234, 5678)
    os.chmod(root / "suid", 0o4755)
    os.link(root / "file.txt", root / "hard.txt")
    os.setxattr(root / "file.txt", "user.corral", b"kept")
    for p in [root / "sub" / "owned", root / "suid", root / "file.txt", root / "sub", root]:
        os.utime(p, (1_700_000_000, 1_700_000_000))
    os.utime(root / "link", (1_700_000_000, 1_700_000_000), follow_symlinks=False)


def _tar_bytes(entries: list[tuple[tarfile.TarInfo, bytes | None]], gz: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in entries:
            if data is not None:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                tf.addfile(info)
    return buf.getvalue()


def _ti(
    name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, uid: int = 0, linkname: str = ""
) -> tarfile.TarInfo:
    t = tarfile.TarInfo(name)
    t.type, t.mode, t.uid, t.gid, t.mtime, t.linkname = (
        kind,
        mode,
        uid,
        uid,
        1_700_000_000,
        linkname,
    )
    return t


def _dir(name: str) -> tarfile.TarInfo:
    return _ti(name, tarfile.DIRTYPE, 0o755)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LayerStore]:
    yield LayerStore(tmp_path / "store")
    assert not _mounts_under(tmp_path)
    assert not [p for p in (tmp_path / "store" / "tmp").iterdir()], "store tmp/ not cleaned"


@pytest.fixture(scope="session")
def debian() -> tuple[LayerStore, ImageInfo]:
    """The Debian bookworm minbase + python3 + pip image, built once and kept."""
    s = LayerStore(TEST_STORE)
    try:
        img = s.image(DEBIAN_IMAGE)
        for d in img.layers:
            s.verify(d)
        return s, img
    except (ImageNotFound, LayerNotFound, LayerCorrupt):
        pass
    t = time.monotonic()
    layer = build_debian(s, "bookworm", include=["python3", "python3-pip"])
    print(f"\nbuilt Debian base in {time.monotonic() - t:.1f} s: {layer.size} bytes")
    return s, s.put_image(DEBIAN_IMAGE, [layer.digest])


# --------------------------------------------------------------------------- store


def test_dir_layer_keeps_metadata_and_dedupes(store: LayerStore, tmp_path: Path) -> None:
    _tree(tmp_path / "a", ["file", "dir", "nested", "link", "suid"])
    time.sleep(0.01)
    _tree(tmp_path / "b", ["suid", "link", "dir", "file", "nested"])
    la = build_dir(store, tmp_path / "a")
    lb = build_dir(store, tmp_path / "b")
    assert la.digest == lb.digest, "same tree built in another order must give the same digest"
    assert len(list((store.root / "layers").glob("*.erofs"))) == 1
    assert store.layer(la.digest).kind == "dir"
    assert store.path_of(la.digest).stat().st_size == la.size
    assert hashlib.sha256(store.path_of(la.digest).read_bytes()).hexdigest() == la.digest[7:]
    with stack(store, [la.digest], tmp_path / "mnt") as m:
        st = os.lstat(m / "sub" / "owned")
        assert (st.st_uid, st.st_gid) == (1234, 5678)
        assert os.lstat(m / "file.txt").st_uid == 0
        assert stat.S_IMODE(os.lstat(m / "suid").st_mode) == 0o4755
        assert os.readlink(m / "link") == "file.txt"
        assert os.lstat(m / "file.txt").st_ino == os.lstat(m / "hard.txt").st_ino
        assert os.getxattr(m / "file.txt", "user.corral") == b"kept"
        assert os.lstat(m / "sub" / "owned").st_mtime == 1_700_000_000, "mtimes are kept"
    assert store.layers() == [store.layer(la.digest)]


def test_add_file_adopts_and_refuses_non_erofs(store: LayerStore, tmp_path: Path) -> None:
    _tree(tmp_path / "a", ["file", "dir", "nested", "link", "suid"])
    la = build_dir(store, tmp_path / "a")
    other = LayerStore(tmp_path / "other")
    lb = other.add_file(store.path_of(la.digest), kind="copy")
    assert lb.digest == la.digest
    (tmp_path / "junk").write_bytes(b"x" * 5000)
    with pytest.raises(InvalidRequest, match="not an EROFS image"):
        other.add_file(tmp_path / "junk", kind="copy")


def test_tar_gz_layer(store: LayerStore, tmp_path: Path) -> None:
    data = _tar_bytes(
        [
            (_dir("./"), None),
            (_dir("./usr"), None),
            (_dir("./usr/bin"), None),
            (_ti("./usr/bin/tool", mode=0o4755), b"#!/bin/sh\necho hi\n"),
            (_ti("./usr/bin/alias", tarfile.SYMTYPE, 0o777, linkname="tool"), None),
            (_ti("./usr/bin/hard", tarfile.LNKTYPE, linkname="./usr/bin/tool"), None),
            (_dir("./home"), None),
            (_ti("./home/user.txt", uid=1000), b"mine\n"),
        ],
        gz=True,
    )
    archive = tmp_path / "rootfs.tar.gz"
    archive.write_bytes(data)
    layer = build_tar(store, archive)
    assert layer.kind == "tar"
    assert build_tar(store, archive).digest == layer.digest
    with stack(store, [layer.digest], tmp_path / "mnt") as m:
        assert stat.S_IMODE(os.lstat(m / "usr/bin/tool").st_mode) == 0o4755
        assert os.lstat(m / "home/user.txt").st_uid == 1000
        assert os.lstat(m / "usr/bin/tool").st_uid == 0
        assert os.readlink(m / "usr/bin/alias") == "tool"
        assert os.lstat(m / "usr/bin/hard").st_ino == os.lstat(m / "usr/bin/tool").st_ino


def test_tar_layer_does_not_depend_on_extraction_time(store: LayerStore, tmp_path: Path) -> None:
    archive = tmp_path / "implicit.tar"  # no "." and no directory entries at all
    archive.write_bytes(_tar_bytes([(_ti("a/b/c"), b"c"), (_ti("d/e"), b"e")]))
    first = build_tar(store, archive)
    time.sleep(1.1)
    assert build_tar(store, archive).digest == first.digest


def test_concurrent_builders_of_one_layer(store: LayerStore, tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    _tree(tmp_path / "a", ["file", "dir", "nested", "link", "suid"])
    other = LayerStore(store.root)  # a second builder on the same (shared) directory
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(lambda s: build_dir(s, tmp_path / "a"), [store, other, store, other])
        )
    assert len({r.digest for r in results}) == 1
    assert len(list((store.root / "layers").glob("*.erofs"))) == 1
    store.verify(results[0].digest)


@pytest.mark.parametrize(
    "entries, why",
    [
        ([(_ti("../evil"), b"x")], "'..'"),
        ([(_ti("/etc/evil"), b"x")], "absolute"),
        (
            [(_ti("a", tarfile.SYMTYPE, 0o777, linkname="/etc"), None), (_ti("a/passwd"), b"x")],
            "through the symlink",
        ),
        ([(_ti("h", tarfile.LNKTYPE, linkname="/etc/shadow"), None)], "absolute"),
        (
            [
                (_ti("s", tarfile.SYMTYPE, 0o777, linkname="/etc/shadow"), None),
                (_ti("h", tarfile.LNKTYPE, linkname="s"), None),
            ],
            "symlink",
        ),
    ],
)
def test_tar_refuses_unsafe_members(
    store: LayerStore, tmp_path: Path, entries: list, why: str
) -> None:
    archive = tmp_path / "bad.tar"
    archive.write_bytes(_tar_bytes(entries))
    with pytest.raises(BuildError, match=why):
        build_tar(store, archive)
    assert store.layers() == []


def test_compose_writes_only_a_manifest(store: LayerStore, tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "a").write_text("a")
    (tmp_path / "tool").mkdir()
    (tmp_path / "tool" / "b").write_text("b")
    base = build_dir(store, tmp_path / "base")
    tool = build_dir(store, tmp_path / "tool")
    files_before = sorted((store.root / "layers").iterdir())
    img = store.put_image(
        "demo/tool:1", [base.digest, tool.digest], env={"A": "1"}, workdir="/work"
    )
    again = store.put_image(
        "demo/tool:1", [base.digest, tool.digest], env={"A": "1"}, workdir="/work"
    )
    assert sorted((store.root / "layers").iterdir()) == files_before
    assert img.digest == again.digest and img.digest.startswith("sha256:")
    assert store.image("demo/tool:1").layers == [base.digest, tool.digest]
    assert store.image(img.digest).name == "demo/tool:1"
    store.put_image("demo/base", [base.digest])
    assert [i.name for i in store.images()] == ["demo/base", "demo/tool:1"]
    with pytest.raises(ImageNotFound, match="demo/tool:1"):
        store.image("demo/tool:2")
    with pytest.raises(InvalidRequest):
        store.put_image("Demo/Upper", [base.digest])
    with pytest.raises(InvalidRequest):
        store.image("sha256:xyz")
    with pytest.raises(LayerNotFound):
        store.put_image("demo/missing", ["sha256:" + "0" * 64])
    with pytest.raises(Conflict, match="demo/tool:1"):
        store.remove_layer(tool.digest)
    store.remove_image("demo/tool:1")
    store.remove_layer(tool.digest)
    with pytest.raises(LayerNotFound):
        store.layer(tool.digest)
    assert not store.path_of(base.digest).with_name(tool.digest[7:] + ".erofs").exists()


def test_verify_detects_corruption(store: LayerStore, tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "data").write_bytes(os.urandom(100_000))
    layer = build_dir(store, tmp_path / "src")
    store.verify(layer.digest)
    shutil.copytree(store.root, tmp_path / "copy")
    copy = LayerStore(tmp_path / "copy")
    copy.verify(layer.digest)  # caches a good result...
    path = copy.path_of(layer.digest)
    with open(path, "r+b") as f:
        f.seek(8192)
        b = f.read(1)
        f.seek(8192)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(LayerCorrupt, match="corrupt"):
        copy.verify(layer.digest)  # ...which a rewrite (new mtime) invalidates
    store.verify(layer.digest)


def test_whiteouts_hide_lower_files(store: LayerStore, tmp_path: Path) -> None:
    lower = tmp_path / "lower"
    (lower / "d").mkdir(parents=True)
    (lower / "gone").write_text("x")
    (lower / "kept").write_text("y")
    (lower / "d" / "old").write_text("z")
    upper = tmp_path / "upper"
    (upper / "d").mkdir(parents=True)
    os.mknod(upper / "gone", stat.S_IFCHR | 0o000, os.makedev(0, 0))
    os.setxattr(upper / "d", OPAQUE, b"y")
    (upper / "d" / "new").write_text("n")
    bottom = build_dir(store, lower)
    top = build_dir(store, upper)
    with stack(store, [bottom.digest, top.digest], tmp_path / "mnt") as m:
        assert sorted(os.listdir(m)) == ["d", "kept"]
        assert os.listdir(m / "d") == ["new"]


# --------------------------------------------------------------------------- importers


def _layer_entries(
    files: dict[str, bytes], whiteouts: Sequence[str] = (), opaque: Sequence[str] = ()
) -> bytes:
    entries: list[tuple[tarfile.TarInfo, bytes | None]] = []
    dirs = sorted({str(Path(p).parent) for p in [*files, *whiteouts, *opaque]} - {"."})
    entries += [(_dir(d), None) for d in dirs]
    entries += [(_ti(p), data) for p, data in files.items()]
    entries += [(_ti(str(Path(p).parent / (".wh." + Path(p).name))), b"") for p in whiteouts]
    entries += [(_ti(f"{d}/.wh..wh..opq"), b"") for d in opaque]
    return _tar_bytes(entries)


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _check_two_layer_image(store: LayerStore, img: ImageInfo, where: Path) -> None:
    assert len(img.layers) == 2
    assert img.env == {"PATH": "/usr/bin:/bin", "FOO": "bar=baz"}
    assert img.workdir == "/work"
    with stack(store, img.layers, where) as m:
        assert sorted(os.listdir(m / "etc")) == ["b", "c"]
        assert os.listdir(m / "opt") == ["y"]
        assert (m / "etc/c").read_text() == "new"


_L1 = _layer_entries({"etc/a": b"a", "etc/b": b"b", "opt/x": b"x"})
_L2 = _layer_entries({"etc/c": b"new", "opt/y": b"y"}, whiteouts=["etc/a"], opaque=["opt"])
_CONFIG = {
    "architecture": "amd64",
    "os": "linux",
    "config": {"Env": ["PATH=/usr/bin:/bin", "FOO=bar=baz"], "WorkingDir": "/work"},
    "rootfs": {"type": "layers", "diff_ids": [_sha(_L1), _sha(_L2)]},
}


def test_import_docker_save(store: LayerStore, tmp_path: Path) -> None:
    config = json.dumps(_CONFIG).encode()
    manifest = json.dumps(
        [{"Config": "cfg.json", "RepoTags": ["t:1"], "Layers": ["l1/layer.tar", "l2/layer.tar"]}]
    ).encode()
    archive = tmp_path / "image.tar"
    archive.write_bytes(
        _tar_bytes(
            [
                (_ti("manifest.json"), manifest),
                (_ti("cfg.json"), config),
                (_dir("l1"), None),
                (_ti("l1/layer.tar"), _L1),
                (_dir("l2"), None),
                (_ti("l2/layer.tar"), _L2),
            ]
        )
    )
    img = import_docker_save(store, archive, "imported/docker:1")
    _check_two_layer_image(store, img, tmp_path / "mnt")
    assert store.layer(img.layers[1]).meta["whiteouts"] == "2"
    n = len(store.layers())
    again = import_docker_save(store, archive, "imported/docker:2")
    assert again.layers == img.layers and len(store.layers()) == n


def test_import_oci_layout(store: LayerStore, tmp_path: Path) -> None:
    layout = tmp_path / "oci"
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        d = _sha(data)
        (blobs / d[7:]).write_bytes(data)
        return d

    l1 = gzip.compress(_L1, mtime=0)
    config = json.dumps(_CONFIG).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": put(config),
                "size": len(config),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": put(l1),
                    "size": len(l1),
                },
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": put(_L2),
                    "size": len(_L2),
                },
            ],
        }
    ).encode()
    other = json.dumps(
        {"schemaVersion": 2, "config": {"digest": put(config)}, "layers": []}
    ).encode()
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(
        json.dumps(
            {
                "schemaVersion": 2,
                "manifests": [
                    {
                        "mediaType": "application/vnd.oci.image.manifest.v1+json",
                        "digest": put(manifest),
                        "size": len(manifest),
                        "annotations": {"org.opencontainers.image.ref.name": "v1"},
                    },
                    {
                        "mediaType": "application/vnd.oci.image.manifest.v1+json",
                        "digest": put(other),
                        "size": len(other),
                        "annotations": {"org.opencontainers.image.ref.name": "empty"},
                    },
                ],
            }
        )
    )
    with pytest.raises(InvalidRequest, match="v1"):
        import_oci(store, layout, "imported/oci")  # two images: ref needed
    img = import_oci(store, layout, "imported/oci", ref="v1")
    _check_two_layer_image(store, img, tmp_path / "mnt")
    # A corrupted blob is caught by its digest (on a fresh store: no layer reuse).
    (blobs / _sha(_L2)[7:]).write_bytes(_L2[:-1] + b"\1")
    with pytest.raises(BuildError, match="hashes to"):
        import_oci(LayerStore(tmp_path / "fresh"), layout, "imported/oci", ref="v1")


# --------------------------------------------------------------------------- debian


def test_debian_base(debian: tuple[LayerStore, ImageInfo], tmp_path: Path) -> None:
    s, img = debian
    layer = s.layer(img.layers[0])
    assert layer.kind == "debian" and layer.meta["suite"] == "bookworm"
    with stack(s, img.layers, tmp_path / "mnt") as m:
        assert "bookworm" in (m / "etc/os-release").read_text()
        assert (m / "etc/resolv.conf").read_text() == RESOLV_CONF_PLACEHOLDER
        assert os.lstat(m / "etc/passwd").st_uid == 0
        assert stat.S_IMODE(os.lstat(m).st_mode) == 0o755
        assert (m / "usr/bin/python3").exists()
        assert not [
            p for p in (m / "var/lib/apt/lists").iterdir() if p.is_file() and p.name != "lock"
        ]
        assert not list((m / "var/cache/apt/archives").glob("*.deb"))


def test_build_run_captures_changes_and_deletions(
    debian: tuple[LayerStore, ImageInfo], tmp_path: Path
) -> None:
    s, img = debian
    host_file = tmp_path / "payload.txt"
    host_file.write_text("payload\n")
    before = _mounts_under(Path("/tmp"))
    layer = build_run(
        s,
        img,
        [
            "rm /etc/issue",
            "mkdir -p /opt/app && echo built > /opt/app/out",
            # no network: a fresh namespace with only loopback
            'test "$(grep -c : /proc/net/dev)" = 1',
        ],
        files={"/opt/app/payload.txt": host_file},
    )
    assert _mounts_under(Path("/tmp")) == before
    composed = s.put_image("test/run-result", [*img.layers, layer.digest])
    try:
        with stack(s, composed.layers, tmp_path / "mnt") as m:
            assert not (m / "etc/issue").exists()
            assert (m / "etc/issue.net").exists()
            assert (m / "opt/app/out").read_text() == "built\n"
            assert (m / "opt/app/payload.txt").read_text() == "payload\n"
            assert os.lstat(m / "opt/app/payload.txt").st_uid == 0
            assert not (m / ".corral-build").exists()
        with pytest.raises(BuildError, match="exit 3"):
            build_run(s, img, ["echo visible-error; exit 3"])
    finally:
        s.remove_image("test/run-result")
        s.remove_layer(layer.digest)  # keep the shared session store from growing


def test_build_pip_installs_six(debian: tuple[LayerStore, ImageInfo], tmp_path: Path) -> None:
    s, img = debian
    t = time.monotonic()
    layer = build_pip(s, img, ["six"])
    print(f"\nbuild_pip six: {time.monotonic() - t:.2f} s, {layer.size} bytes")
    try:
        assert layer.kind == "pip"
        assert json.loads(layer.meta["requirements"]) == ["six"]
        chroot = shutil.which("chroot") or "/usr/sbin/chroot"
        with stack(s, [*img.layers, layer.digest], tmp_path / "mnt") as m:
            res = subprocess.run(
                [chroot, str(m), "python3", "-c", "import six; print(six.__file__)"],
                capture_output=True,
                text=True,
                env={"PATH": "/usr/bin:/bin"},
            )
            assert res.returncode == 0, res.stderr
            assert res.stdout.startswith("/usr/local/lib/python3")
    finally:
        s.remove_layer(layer.digest)


def test_build_pip_needs_python(store: LayerStore, tmp_path: Path) -> None:
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox-static is not installed")
    root = tmp_path / "bb"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(busybox, root / "bin" / "busybox")
    for tool in ("sh", "test"):
        os.symlink("busybox", root / "bin" / tool)
    base = store.put_image("test/busybox", [build_dir(store, root).digest], env={"PATH": "/bin"})
    with pytest.raises(BuildError, match="python3"):
        build_pip(store, base, ["six"])
    with pytest.raises(InvalidRequest):
        build_pip(store, base, ["--index-url=http://example.test/"])
