"""The contract of the file operations: content, metadata, trees, archives and errors.

Each test works in a directory of its own below ``/tmp`` of the shared sandbox.
"""

from __future__ import annotations

import io
import tarfile

from corral.errors import Conflict, InvalidRequest, NotFound, PathRefused
from corral.ops import NodeOps
from corral.spec import SandboxInfo
from tests.contract.base import ContractBase, raises_exactly, run


def _tar(*members: tuple[str, bytes | None, int] | tuple[str, str]) -> bytes:
    """A tar of ``(name, data, mode)`` files/directories (data None) and
    ``(name, link_target)`` symlinks."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for m in members:
            ti = tarfile.TarInfo(m[0])
            if len(m) == 2:
                ti.type, ti.linkname = tarfile.SYMTYPE, str(m[1])
                tar.addfile(ti)
            elif m[1] is None:
                ti.type, ti.mode = tarfile.DIRTYPE, m[2]
                tar.addfile(ti)
            else:
                data = m[1]
                assert isinstance(data, bytes)
                ti.size, ti.mode = len(data), m[2]
                tar.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _members(data: bytes) -> dict[str, tuple[str, bytes | str]]:
    """name -> (kind, content or link target) of a tar."""
    out: dict[str, tuple[str, bytes | str]] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar.getmembers():
            if m.isdir():
                out[m.name] = ("dir", b"")
            elif m.issym():
                out[m.name] = ("symlink", m.linkname)
            else:
                f = tar.extractfile(m)
                out[m.name] = ("file", f.read() if f else b"")
    return out


class FilesContract(ContractBase):
    async def test_write_read(self, ops: NodeOps, sb: SandboxInfo) -> None:
        p = "/tmp/c-rw/deep/er/f.txt"  # parents are created
        await ops.file_write(sb.id, p, b"0123456789")
        assert await ops.file_read(sb.id, p) == b"0123456789"
        assert await ops.file_read(sb.id, p, offset=3) == b"3456789"
        assert await ops.file_read(sb.id, p, offset=3, length=4) == b"3456"
        assert await ops.file_read(sb.id, p, offset=50) == b""
        await ops.file_write(sb.id, p, b"AB", append=True)
        assert await ops.file_read(sb.id, p) == b"0123456789AB"
        await ops.file_write(sb.id, p, b"new")  # replaces
        assert await ops.file_read(sb.id, p) == b"new"
        assert (await run(ops, sb.id, "cat", p)).stdout == b"new"  # the guest sees it
        with raises_exactly(InvalidRequest, match="offset"):
            await ops.file_read(sb.id, p, offset=-1)

    async def test_stat_list_mkdir(self, ops: NodeOps, sb: SandboxInfo) -> None:
        await ops.file_write(sb.id, "/tmp/c-meta/b.txt", b"hello", mode=0o600)
        await ops.file_mkdir(sb.id, "/tmp/c-meta/a/x", mode=0o700)
        st = await ops.file_stat(sb.id, "/tmp/c-meta/b.txt")
        assert (st.path, st.name, st.type, st.size, st.mode) == (
            "/tmp/c-meta/b.txt",
            "b.txt",
            "file",
            5,
            0o600,
        )
        assert (await ops.file_stat(sb.id, "/tmp/c-meta/a/x")).mode == 0o700
        assert (await ops.file_stat(sb.id, "/tmp/c-meta/a")).type == "dir"
        listed = await ops.file_list(sb.id, "/tmp/c-meta")
        assert [(e.name, e.type, e.path) for e in listed] == [
            ("a", "dir", "/tmp/c-meta/a"),
            ("b.txt", "file", "/tmp/c-meta/b.txt"),
        ]
        await ops.file_mkdir(sb.id, "/tmp/c-meta/a")  # parents=True: an existing dir is fine
        with raises_exactly(Conflict, match="/tmp/c-meta/a"):
            await ops.file_mkdir(sb.id, "/tmp/c-meta/a", parents=False)
        with raises_exactly(NotFound, match="/tmp/c-meta/none"):
            await ops.file_mkdir(sb.id, "/tmp/c-meta/none/y", parents=False)
        await ops.file_mkdir(sb.id, "/tmp/c-meta/c", parents=False)
        assert (await ops.file_stat(sb.id, "/tmp/c-meta/c")).type == "dir"

    async def test_mkdir_owner(self, ops: NodeOps, sb: SandboxInfo) -> None:
        """What a mkdir with an owner creates is that owner's; what existed stays root's."""
        await ops.file_mkdir(sb.id, "/tmp/c-own/home/u", True, 0o750, 1000, 1001)
        for d in ("/tmp/c-own", "/tmp/c-own/home", "/tmp/c-own/home/u"):
            st = await ops.file_stat(sb.id, d)
            assert (st.uid, st.gid) == (1000, 1001), d
        assert (await ops.file_stat(sb.id, "/tmp/c-own/home/u")).mode == 0o750
        assert (await ops.file_stat(sb.id, "/tmp")).uid == 0
        await ops.file_mkdir(sb.id, "/tmp/c-own/home/u", True, 0o755, 5, 5)  # exists: kept
        assert (await ops.file_stat(sb.id, "/tmp/c-own/home/u")).uid == 1000

    async def test_remove(self, ops: NodeOps, sb: SandboxInfo) -> None:
        await ops.file_write(sb.id, "/tmp/c-rm/d/f", b"1")
        await ops.file_write(sb.id, "/tmp/c-rm/g", b"2")
        await ops.file_remove(sb.id, "/tmp/c-rm/g")
        with raises_exactly(InvalidRequest, match="/tmp/c-rm/d"):
            await ops.file_remove(sb.id, "/tmp/c-rm/d")  # not empty
        assert await ops.file_read(sb.id, "/tmp/c-rm/d/f") == b"1"
        await ops.file_remove(sb.id, "/tmp/c-rm/d", recursive=True)
        assert await ops.file_list(sb.id, "/tmp/c-rm") == []
        await ops.file_remove(sb.id, "/tmp/c-rm")  # empty: no recursive needed
        with raises_exactly(NotFound, match="/tmp/c-rm"):
            await ops.file_stat(sb.id, "/tmp/c-rm")

    async def test_errors(self, ops: NodeOps, sb: SandboxInfo) -> None:
        await ops.file_write(sb.id, "/tmp/c-err/f", b"x")
        missing = "/tmp/c-err/missing"
        for call in (
            lambda: ops.file_read(sb.id, missing),
            lambda: ops.file_stat(sb.id, missing),
            lambda: ops.file_list(sb.id, missing),
            lambda: ops.file_remove(sb.id, missing),
            lambda: ops.file_download_tar(sb.id, missing),
        ):
            with raises_exactly(NotFound, match=missing):
                await call()
        for call in (
            lambda: ops.file_read(sb.id, "/tmp/c-err"),  # a directory
            lambda: ops.file_write(sb.id, "/tmp/c-err", b"x"),
            lambda: ops.file_list(sb.id, "/tmp/c-err/f"),  # a file
            lambda: ops.file_read(sb.id, "relative/path"),
            lambda: ops.file_write(sb.id, "relative/path", b"x"),
            lambda: ops.file_write(sb.id, "/tmp/c-err/g/", b"x"),  # names a directory
            lambda: ops.file_write(sb.id, "/tmp/c-err/g", b"x", mode=0o17777),
            lambda: ops.file_write(sb.id, "/", b"x"),
            lambda: ops.file_remove(sb.id, "/", recursive=True),
        ):
            with raises_exactly(InvalidRequest):
                await call()
        with raises_exactly(PathRefused, match="NUL"):
            await ops.file_read(sb.id, "/tmp/c-err/a\0b")
        assert [e.name for e in await ops.file_list(sb.id, "/tmp/c-err")] == ["f"]
        assert (await ops.file_stat(sb.id, "/tmp")).type == "dir"  # the root survived

    async def test_dotdot_stays_inside(self, ops: NodeOps, sb: SandboxInfo) -> None:
        await ops.file_write(sb.id, "/../../tmp/c-dots/../c-dots/f", b"inside")
        assert await ops.file_read(sb.id, "/tmp/c-dots/f") == b"inside"
        assert await ops.file_read(sb.id, "/tmp/../../tmp/c-dots/f") == b"inside"

    async def test_tar_up_and_down(self, ops: NodeOps, sb: SandboxInfo) -> None:
        data = _tar(("d", None, 0o755), ("d/f", b"content", 0o640), ("l", "d/f"))
        await ops.file_upload_tar(sb.id, "/tmp/c-tar", data)
        assert await ops.file_read(sb.id, "/tmp/c-tar/d/f") == b"content"
        st = await ops.file_stat(sb.id, "/tmp/c-tar/d/f")
        assert (st.type, st.mode) == ("file", 0o640)
        link = await ops.file_stat(sb.id, "/tmp/c-tar/l")
        assert (link.type, link.target) == ("symlink", "d/f")
        assert [e.name for e in await ops.file_list(sb.id, "/tmp/c-tar")] == ["d", "l"]

        tree = _members(await ops.file_download_tar(sb.id, "/tmp/c-tar"))
        assert tree == {
            "d": ("dir", b""),
            "d/f": ("file", b"content"),
            "l": ("symlink", "d/f"),
        }
        one = _members(await ops.file_download_tar(sb.id, "/tmp/c-tar/d/f"))
        assert one == {"f": ("file", b"content")}

        for bad in ("../escape", "/abs/escape"):
            with raises_exactly(PathRefused, match="escape"):
                await ops.file_upload_tar(sb.id, "/tmp/c-tar", _tar((bad, b"x", 0o644)))
        assert [e.name for e in await ops.file_list(sb.id, "/tmp/c-tar")] == ["d", "l"]
        with raises_exactly(NotFound):
            await ops.file_stat(sb.id, "/tmp/escape")

    async def test_symlinks_resolve_inside(self, ops: NodeOps, sb: SandboxInfo) -> None:
        """Links are followed as the guest would see them, absolute ones from the sandbox's
        root; stat and a plain write act on the link itself, never on its target."""
        data = _tar(
            ("d", None, 0o755),
            ("d/f", b"target", 0o644),
            ("rel", "d/f"),
            ("dir", "d"),
            ("root", "/"),
            ("up", "../../../../.."),
        )
        await ops.file_upload_tar(sb.id, "/tmp/c-ln", data)
        assert await ops.file_read(sb.id, "/tmp/c-ln/rel") == b"target"
        assert [e.name for e in await ops.file_list(sb.id, "/tmp/c-ln/dir")] == ["f"]
        assert await ops.file_read(sb.id, "/tmp/c-ln/dir/f") == b"target"
        # Both lead to the sandbox's own root, never the host's.
        assert await ops.file_read(sb.id, "/tmp/c-ln/root/tmp/c-ln/d/f") == b"target"
        assert await ops.file_read(sb.id, "/tmp/c-ln/up/tmp/c-ln/d/f") == b"target"
        st = await ops.file_stat(sb.id, "/tmp/c-ln/dir")
        assert (st.path, st.type, st.target) == ("/tmp/c-ln/dir", "symlink", "d")
        await ops.file_write(sb.id, "/tmp/c-ln/rel", b"replaced")
        assert (await ops.file_stat(sb.id, "/tmp/c-ln/rel")).type == "file"
        assert await ops.file_read(sb.id, "/tmp/c-ln/d/f") == b"target"
        with raises_exactly(PathRefused, match="symlink"):
            await ops.file_write(sb.id, "/tmp/c-ln/dir", b"x", append=True)
        await ops.file_remove(sb.id, "/tmp/c-ln/dir")  # the link, not its target
        assert await ops.file_read(sb.id, "/tmp/c-ln/d/f") == b"target"
