"""Pure-Python parts of corral.images: apt source parsing, name and digest checks, the
image digest, the EROFS superblock CRC, tar member checks."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from corral.errors import BuildError, InvalidRequest
from corral.images import _apt
from corral.images._tarx import check_tar
from corral.images.erofs import _compress_args, crc32c_raw
from corral.images.store import check_digest, check_image_name, image_digest


def _apt_dir(tmp_path: Path, files: dict[str, str]) -> Path:
    d = tmp_path / "apt"
    (d / "sources.list.d").mkdir(parents=True)
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def test_mirror_from_deb822(tmp_path: Path) -> None:
    d = _apt_dir(
        tmp_path,
        {
            "sources.list.d/debian.sources": (
                "Types: deb\n# a comment\nURIs: http://mirror.example.test/debian\n"
                "Suites: bookworm bookworm-updates\nComponents: main\n\n"
                "Types: deb\nURIs: http://mirror.example.test/debian-security\n"
                "Suites: bookworm-security\nComponents: main\n"
            )
        },
    )
    assert _apt.find_mirror("bookworm", d) == "http://mirror.example.test/debian"
    assert _apt.find_mirror("bookworm-security", d) == (
        "http://mirror.example.test/debian-security"
    )


def test_mirror_from_one_line_format(tmp_path: Path) -> None:
    d = _apt_dir(
        tmp_path,
        {
            "sources.list": "# nothing\ndeb-src http://src.example.test/debian trixie main\n",
            "sources.list.d/vendor.list": (
                "deb [arch=amd64 signed-by=/k.gpg] https://vendor.example.test/apt "
                "cloud-sdk-trixie main\n"
                "deb [ arch=amd64 ] http://m.example.test/debian trixie contrib main\n"
            ),
            "sources.list.d/ignored.list.disabled": "deb http://x.example.test/ trixie main\n",
        },
    )
    assert _apt.find_mirror("trixie", d) == "http://m.example.test/debian"


def test_mirror_missing_is_a_clear_build_error(tmp_path: Path) -> None:
    d = _apt_dir(tmp_path, {"sources.list": "deb http://m.example.test/debian bookworm contrib\n"})
    with pytest.raises(BuildError, match="no Debian mirror for suite 'bookworm'.*mirror="):
        _apt.find_mirror("bookworm", d)


def test_disabled_deb822_stanza_is_skipped(tmp_path: Path) -> None:
    d = _apt_dir(
        tmp_path,
        {
            "sources.list.d/a.sources": (
                "Enabled: no\nTypes: deb\nURIs: http://off.example.test/debian\nSuites: sid\n"
                "Components: main\n"
            )
        },
    )
    with pytest.raises(BuildError):
        _apt.find_mirror("sid", d)


@pytest.mark.parametrize("name", ["demo/python", "demo/python:3.11", "a", "x.y/z_w-1:Tag_2"])
def test_good_image_names(name: str) -> None:
    assert check_image_name(name) == name


@pytest.mark.parametrize("name", ["", "Demo", "/abs", "-x", "a:b:c", "a:", "a b", "é"])
def test_bad_image_names(name: str) -> None:
    with pytest.raises(InvalidRequest):
        check_image_name(name)


def test_digest_check() -> None:
    good = "sha256:" + "ab" * 32
    assert check_digest(good) == good
    for bad in ["sha256:" + "AB" * 32, "sha256:abc", "md5:" + "0" * 32, "ab" * 32]:
        with pytest.raises(InvalidRequest):
            check_digest(bad)


def test_image_digest_is_canonical() -> None:
    a = image_digest("n", ["sha256:" + "1" * 64], {"B": "2", "A": "1"}, "/")
    b = image_digest("n", ["sha256:" + "1" * 64], {"A": "1", "B": "2"}, "/")
    assert a == b and a.startswith("sha256:")
    assert image_digest("m", ["sha256:" + "1" * 64], {"A": "1", "B": "2"}, "/") != a


def test_crc32c_matches_the_standard_check_value() -> None:
    # CRC-32C("123456789") = 0xE3069283 after the final inversion EROFS leaves out.
    assert crc32c_raw(0xFFFFFFFF, b"123456789") ^ 0xFFFFFFFF == 0xE3069283


def test_compression_choices() -> None:
    assert _compress_args(None) == []
    assert _compress_args("lz4") == ["-zlz4"]
    assert _compress_args("lz4hc,9") == ["-zlz4hc,9", "-C65536"]  # big pclusters
    assert _compress_args("dax") == ["-Enoinline_data"]  # uncompressed, block-aligned
    with pytest.raises(InvalidRequest):
        _compress_args("zstd")


def _tar(tmp_path: Path, members: list[tarfile.TarInfo]) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for m in members:
            tf.addfile(m, io.BytesIO(b"") if m.isfile() else None)
    p = tmp_path / "t.tar"
    p.write_bytes(buf.getvalue())
    return p


def _m(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    t = tarfile.TarInfo(name)
    t.type, t.linkname = kind, link
    return t


def test_check_tar_accepts_normal_rootfs(tmp_path: Path) -> None:
    s = check_tar(
        _tar(
            tmp_path,
            [
                _m("./", tarfile.DIRTYPE),
                _m("./usr", tarfile.DIRTYPE),
                _m("./usr/lib", tarfile.DIRTYPE),
                _m("./lib", tarfile.SYMTYPE, "usr/lib"),
                _m("./usr/lib/x"),
                _m("./usr/lib/y", tarfile.LNKTYPE, "./usr/lib/x"),
                _m("./etc", tarfile.DIRTYPE),
                _m("./etc/localtime", tarfile.SYMTYPE, "/usr/share/z"),
            ],
        )
    )
    assert s.members == 8 and s.has_root


@pytest.mark.parametrize(
    "members, why",
    [
        ([_m("a/../../x")], r"'\.\.'"),
        ([_m("/x")], "absolute"),
        ([_m("l", tarfile.SYMTYPE, "/"), _m("l/etc/passwd")], "through the symlink 'l'"),
        ([_m("h", tarfile.LNKTYPE, "missing")], "not a file earlier"),
        ([_m("d", tarfile.DIRTYPE), _m("h", tarfile.LNKTYPE, "d")], "not a file earlier"),
    ],
)
def test_check_tar_refuses(tmp_path: Path, members: list[tarfile.TarInfo], why: str) -> None:
    with pytest.raises(BuildError, match=why):
        check_tar(_tar(tmp_path, members))


def test_directory_entry_over_a_symlink_does_not_clear_it(tmp_path: Path) -> None:
    # Conservative: some tar versions/options keep the symlink and would write into /etc.
    with pytest.raises(BuildError, match="through the symlink 'a'"):
        check_tar(
            _tar(tmp_path, [_m("a", tarfile.SYMTYPE, "/etc"), _m("a", tarfile.DIRTYPE), _m("a/x")])
        )
