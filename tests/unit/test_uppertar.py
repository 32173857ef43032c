"""The unpacker of a guest's upper-dir tar (microVM snapshots): what a good archive keeps,
and crafted hostile archives refused with nothing written outside the scratch dir."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from corral.errors import BuildError
from corral.images.uppertar import unpack_upper

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (owners, mknod)")


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


def _m(name: str, type_: bytes = tarfile.REGTYPE, data: bytes = b"", **kw) -> tuple:  # type: ignore[type-arg]
    info = tarfile.TarInfo(name)
    info.type = type_
    info.mode = kw.pop("mode", 0o755 if type_ == tarfile.DIRTYPE else 0o644)
    info.mtime = kw.pop("mtime", 1_700_000_000)
    for k, v in kw.items():
        setattr(info, k, v)
    if type_ == tarfile.REGTYPE:
        info.size = len(data)
        return info, data
    return info, None


def _d(name: str, **kw) -> tuple:  # type: ignore[type-arg]
    return _m(name, tarfile.DIRTYPE, **kw)


def test_good_upper_keeps_whiteouts_opaque_links_owners_and_modes(tmp_path: Path) -> None:
    opaque = _d("etc", pax_headers={"SCHILY.xattr.trusted.overlay.opaque": "y"})
    tar = _tar(
        opaque,
        _m("etc/hosts", data=b"127.0.0.1 x\n", uid=1000, gid=1000),
        _m("etc/su", data=b"#!", mode=0o4755),
        _m("etc/su2", tarfile.LNKTYPE, linkname="etc/su"),
        _m("etc/ln", tarfile.SYMTYPE, linkname="/nowhere/../etc"),
        _m("gone", tarfile.CHRTYPE, devmajor=0, devminor=0),
        _d(
            "odd",
            uid=1 << 40,  # outside the sandbox's ids: root's
            pax_headers={"SCHILY.xattr.trusted.overlay.origin": "x", "uid": str(1 << 40)},
        ),
        _d(".corral"),
        _m(".corral/init", data=b"skip me"),
    )
    dest = tmp_path / "u"
    s = unpack_upper(tar, dest, max_bytes=1 << 20)
    assert s.whiteouts == 1 and s.bytes == len(b"127.0.0.1 x\n") + 2
    assert os.getxattr(dest / "etc", "trusted.overlay.opaque") == b"y"
    assert os.listxattr(dest / "odd") == []  # bookkeeping dropped
    assert (dest / "odd").stat().st_uid == 0
    st = (dest / "etc/hosts").stat()
    assert (st.st_uid, st.st_gid, st.st_mtime) == (1000, 1000, 1_700_000_000)
    su = (dest / "etc/su").stat()
    assert stat.S_IMODE(su.st_mode) == 0o4755 and su.st_nlink == 2
    assert su.st_ino == (dest / "etc/su2").stat().st_ino
    assert os.readlink(dest / "etc/ln") == "/nowhere/../etc"
    wh = os.lstat(dest / "gone")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0
    assert not (dest / ".corral").exists()
    assert stat.S_IMODE((dest / "etc").stat().st_mode) == 0o755


def test_corral_tar_output_round_trips(tmp_path: Path) -> None:
    """What the guest's streamer writes (built here) unpacks to the same tree."""
    from corral.init import ensure_tar_built

    exe = ensure_tar_built(tmp_path / "bin")
    src = tmp_path / "src"
    (src / "opq" / "deep").mkdir(parents=True)
    os.setxattr(src / "opq", "trusted.overlay.opaque", b"y")
    long = src / ("n" * 150)
    long.mkdir()
    (long / ("m" * 200)).write_bytes(b"long")
    (src / "f").write_bytes(b"data" * 1000)
    os.link(src / "f", src / "g")
    os.symlink("../../x", src / "opq" / "l")
    os.mknod(src / "wh", stat.S_IFCHR | 0o600, 0)
    out = subprocess.run([str(exe), str(src)], capture_output=True, check=True).stdout
    dest = tmp_path / "dest"
    s = unpack_upper(io.BytesIO(out), dest, max_bytes=1 << 20)
    assert s.whiteouts == 1
    assert os.getxattr(dest / "opq", "trusted.overlay.opaque") == b"y"
    assert (dest / "opq" / "deep").is_dir()
    assert (dest / ("n" * 150) / ("m" * 200)).read_bytes() == b"long"
    assert (dest / "f").stat().st_ino == (dest / "g").stat().st_ino
    assert os.readlink(dest / "opq" / "l") == "../../x"
    assert os.lstat(dest / "wh").st_rdev == 0


HOSTILE = {
    "dotdot": (_m("../escape", data=b"x"),),
    "absolute": (_m("/tmp/escape", data=b"x"),),
    "through symlink": (_m("l", tarfile.SYMTYPE, linkname=".."), _m("l/escape", data=b"x")),
    "through a file": (_m("f", data=b"x"), _m("f/escape", data=b"x")),
    "parent not made": (_m("nodir/escape", data=b"x"),),
    "device node": (_m("mem", tarfile.CHRTYPE, devmajor=1, devminor=1),),
    "block device": (_m("sda", tarfile.BLKTYPE, devmajor=8, devminor=0),),
    "hardlink outside": (_m("h", tarfile.LNKTYPE, linkname="../../etc/passwd"),),
    "hardlink absolute": (_m("h", tarfile.LNKTYPE, linkname="/etc/passwd"),),
    "hardlink to symlink": (
        _m("l", tarfile.SYMTYPE, linkname="/etc/passwd"),
        _m("h", tarfile.LNKTYPE, linkname="l"),
    ),
    "twice": (_m("a", data=b"1"), _m("a", data=b"2")),
    "huge": (_m("big", data=b"x" * 5000),),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archives_are_refused_and_nothing_leaves_the_scratch_dir(
    tmp_path: Path, case: str
) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(BuildError) as e:
        unpack_upper(_tar(*HOSTILE[case]), scratch / "u", max_bytes=4096)
    assert "guest upper tar" in str(e.value) and "refused" in str(e.value), e.value
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not (tmp_path / "escape").exists() and not Path("/tmp/escape").exists()
    assert [p.name for p in scratch.iterdir()] == ["u"]


def test_garbage_and_cut_archives_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="guest upper tar"):
        unpack_upper(io.BytesIO(os.urandom(2048)), tmp_path / "a", max_bytes=1 << 20)
    good = _tar(_m("f", data=b"y" * 3000)).getvalue()
    with pytest.raises(BuildError, match="guest upper tar"):
        unpack_upper(io.BytesIO(good[:1200]), tmp_path / "b", max_bytes=1 << 20)


def test_entry_count_is_bounded(tmp_path: Path) -> None:
    tar = _tar(*(_m(f"f{i}") for i in range(20)))
    with pytest.raises(BuildError, match="more than 10 entries"):
        unpack_upper(tar, tmp_path / "u", max_bytes=1 << 20, max_entries=10)
