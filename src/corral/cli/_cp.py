"""``corral sandbox cp``: docker-cp-style copies between this host and a sandbox.

One side is ``SANDBOX_ID:PATH`` (a relative PATH is taken from the sandbox's workdir). If
the destination is an existing directory the source lands inside it under its own name;
otherwise the destination path names the copy (its parent must exist), like ``docker cp``.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from corral.errors import InvalidRequest, NotFound

if TYPE_CHECKING:
    from corral.sdk import AsyncClient
    from corral.sdk._sandbox import Sandbox
    from corral.spec import FileStat

__all__ = ["Ref", "parse_ref", "copy"]

# A sandbox side looks like "sb-abc123:/path"; "./a:b" or "/a:b" stay local paths.
_REMOTE_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*):(.*)$")


@dataclass(frozen=True)
class Ref:
    """One side of a copy: a local path, or a path inside sandbox ``sandbox_id``."""

    path: str
    sandbox_id: str | None = None

    def __str__(self) -> str:
        return f"{self.sandbox_id}:{self.path}" if self.sandbox_id else self.path


def parse_ref(arg: str) -> Ref:
    """``"sb-1:/etc"`` → Ref("/etc", "sb-1"); anything else is a local path."""
    if not arg:
        raise InvalidRequest("cp: an empty path is not a source or destination")
    m = _REMOTE_RE.match(arg)
    if m and not arg.startswith((".", "/")):
        return Ref(m.group(2) or ".", m.group(1))
    return Ref(arg)


async def copy(client: AsyncClient, src: Ref, dst: Ref) -> str:
    """Copy ``src`` to ``dst`` (exactly one of them in a sandbox); returns where it landed."""
    if (src.sandbox_id is None) == (dst.sandbox_id is None):
        raise InvalidRequest(
            "cp: exactly one side must be in a sandbox, as SANDBOX_ID:PATH "
            "(e.g. corral sandbox cp ./src sb-123:/work)"
        )
    if src.sandbox_id is not None:
        sb = await client.sandboxes.get(src.sandbox_id)
        return str(await _download(sb, _remote_path(sb, src.path), Path(dst.path)))
    assert dst.sandbox_id is not None
    sb = await client.sandboxes.get(dst.sandbox_id)
    landed = await _upload(sb, Path(src.path), _remote_path(sb, dst.path))
    return f"{sb.id}:{landed}"


def _remote_path(sb: Sandbox, path: str) -> str:
    joined = posixpath.join(sb.info.spec.workdir or "/", path)
    return posixpath.normpath(joined) if joined != "/" else "/"


async def _remote_stat(sb: Sandbox, path: str) -> FileStat | None:
    try:
        return await sb.files.stat(path)
    except NotFound:
        return None


async def _download(sb: Sandbox, remote: str, local: Path) -> Path:
    st = await _remote_stat(sb, remote)
    if st is None:
        raise NotFound(f"cp: {sb.id}:{remote}: no such file or directory")
    if local.is_dir():
        return await sb.files.download(remote, local)
    parent = local.parent
    if not parent.is_dir():
        raise InvalidRequest(f"cp: local directory {parent} does not exist")
    if st.type == "dir" and local.exists():
        raise InvalidRequest(f"cp: cannot copy directory {sb.id}:{remote} onto file {local}")
    # Unpack next to the destination (same filesystem) and rename into place, so the copy
    # takes the destination's name and a failed transfer leaves nothing half-written.
    stage = Path(tempfile.mkdtemp(prefix=".corral-cp-", dir=parent))
    try:
        got = await sb.files.download(remote, stage)
        os.replace(got, local)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return local


async def _upload(sb: Sandbox, local: Path, remote: str) -> str:
    if not local.exists() and not local.is_symlink():
        raise InvalidRequest(f"cp: local path {local} does not exist")
    st = await _remote_stat(sb, remote)
    if st is not None and st.type == "dir":
        return await sb.files.upload(local, remote)
    if st is not None and local.is_dir():
        raise InvalidRequest(f"cp: cannot copy directory {local} onto file {sb.id}:{remote}")
    parent = posixpath.dirname(remote) or "/"
    pst = await _remote_stat(sb, parent)
    if pst is None or pst.type != "dir":
        raise InvalidRequest(f"cp: directory {sb.id}:{parent} does not exist")
    if local.is_file():
        await sb.files.write(remote, local.read_bytes(), mode=local.stat().st_mode & 0o7777)
        return remote
    # A directory under a new name: the tar upload names entries after the local source,
    # so stage a (hard-linked where possible) copy carrying the destination's name.
    stage = Path(tempfile.mkdtemp(prefix="corral-cp-"))
    try:
        staged = stage / posixpath.basename(remote)
        shutil.copytree(local, staged, symlinks=True, copy_function=_link_or_copy)
        await sb.files.upload(staged, parent)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return remote


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
