"""Container image formats: ``docker save`` archives and OCI image layouts.

Both come down to: a config JSON (env, workdir, the uncompressed layer digests) and an
ordered list of layer tars, possibly gzip- or zstd-compressed. Each layer tar is checked
against its digest, extracted safely, its OCI whiteouts turned into overlayfs ones, and
built into an EROFS layer. A layer whose uncompressed digest (``diff_id``) the store has
seen before is reused without extracting it again.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol, cast

from corral.errors import BuildError, InvalidRequest
from corral.images._progress import Step
from corral.images._tarx import apply_oci_whiteouts, extract_tar
from corral.images.store import DIGEST_RE, LayerStore
from corral.spec import LayerInfo

if TYPE_CHECKING:
    from rich.progress import Progress

__all__ = ["ImageConfig", "parse_config", "layer_from_blob", "read_oci_layout", "OciImage"]

_CHUNK = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_INDEX_TYPES = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}
_REF_ANNOTATION = "org.opencontainers.image.ref.name"
_CONTAINERD_NAME = "io.containerd.image.name"


class _Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


@dataclass
class ImageConfig:
    env: dict[str, str]
    workdir: str
    diff_ids: list[str]


def parse_config(doc: dict[str, Any], where: str) -> ImageConfig:
    """Env, workdir and diff_ids of an image config JSON (docker and OCI share the shape)."""
    cfg = doc.get("config") or {}
    env: dict[str, str] = {}
    for item in cfg.get("Env") or []:
        k, sep, v = str(item).partition("=")
        if k and sep:
            env[k] = v
    workdir = cfg.get("WorkingDir") or "/"
    if not str(workdir).startswith("/"):
        workdir = "/" + str(workdir)
    diff_ids = list((doc.get("rootfs") or {}).get("diff_ids") or [])
    for d in diff_ids:
        if not isinstance(d, str) or not DIGEST_RE.match(d):
            raise BuildError(f"{where}: diff_id {d!r} is not a sha256 digest")
    return ImageConfig(env, str(workdir), diff_ids)


def _copy_hashing(src: _Readable, dst: IO[bytes], step: Step | None = None) -> str:
    h = hashlib.sha256()
    while chunk := src.read(_CHUNK):
        h.update(chunk)
        dst.write(chunk)
        if step is not None:
            step.advance(len(chunk))
    return "sha256:" + h.hexdigest()


class _HashingReader:
    """Reads through to ``raw`` and hashes what passes (the compressed blob)."""

    def __init__(self, raw: _Readable) -> None:
        self.raw = raw
        self.h = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.h.update(data)
        return data

    def digest(self) -> str:
        while self.read(_CHUNK):  # gzip may stop before trailing bytes
            pass
        return "sha256:" + self.h.hexdigest()


def _plain_tar(
    blob: _Readable, out: Path, *, tmpdir: Path, step: Step | None = None
) -> tuple[str, str]:
    """Write the uncompressed tar of ``blob`` to ``out``; return (blob digest, tar digest)."""
    head = blob.read(4)
    rest = _Prefixed(head, blob)
    if head.startswith(_GZIP_MAGIC):
        reader = _HashingReader(rest)
        gz = gzip.GzipFile(fileobj=cast(IO[bytes], reader), mode="rb")
        with gz, open(out, "wb") as f:
            try:
                diff = _copy_hashing(gz, f, step)
            except (OSError, EOFError) as e:
                raise BuildError(f"layer blob is not valid gzip: {e}") from None
        return reader.digest(), diff
    if head.startswith(_ZSTD_MAGIC):
        zst = tmpdir / (out.name + ".zst")
        with open(zst, "wb") as f:
            blob_digest = _copy_hashing(rest, f, step)
        try:
            with open(out, "wb") as f:
                subprocess.run(
                    ["zstd", "-q", "-d", "-c", str(zst)],
                    stdout=f,
                    check=True,
                    stderr=subprocess.PIPE,
                )
        except FileNotFoundError:
            raise BuildError("layer is zstd-compressed but zstd is not installed") from None
        except subprocess.CalledProcessError as e:
            raise BuildError(
                f"zstd could not decompress a layer: {e.stderr.decode()[-500:]}"
            ) from None
        finally:
            zst.unlink(missing_ok=True)
        with open(out, "rb") as f:
            diff = "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
        return blob_digest, diff
    with open(out, "wb") as f:
        digest = _copy_hashing(rest, f, step)
    return digest, digest


class _Prefixed:
    """A stream with ``head`` (already read for sniffing) put back in front."""

    def __init__(self, head: bytes, raw: _Readable) -> None:
        self.head = head
        self.raw = raw

    def read(self, n: int = -1) -> bytes:
        if self.head:
            if n < 0:
                data, self.head = self.head + self.raw.read(), b""
                return data
            data, self.head = self.head[:n], self.head[n:]
            if len(data) < n:
                data += self.raw.read(n - len(data))
            return data
        return self.raw.read(n)


def _known_layer(store: LayerStore, diff_id: str) -> LayerInfo | None:
    for info in store.layers():
        if info.meta.get("diff_id") == diff_id:
            try:
                store.path_of(info.digest)
            except Exception:
                continue
            return info
    return None


@contextmanager
def _scratch(prefix: str) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def layer_from_blob(
    store: LayerStore,
    open_blob: Any,
    *,
    kind: str,
    source: str,
    blob_digest: str | None,
    diff_id: str | None,
    progress: Progress | None = None,
    label: str = "layer",
) -> LayerInfo:
    """Convert one layer blob (``open_blob()`` gives a binary stream) into a store layer.

    ``blob_digest`` / ``diff_id``, when known, are checked (BuildError on mismatch).
    """
    if diff_id is not None:
        known = _known_layer(store, diff_id)
        if known is not None:
            return known
    with _scratch("corral-import-") as tmp:
        plain = tmp / "layer.tar"
        with Step(progress, f"unpack {label}") as step, open_blob() as blob:
            got_blob, got_diff = _plain_tar(blob, plain, tmpdir=tmp, step=step)
        if blob_digest is not None and got_blob != blob_digest:
            raise BuildError(f"{label}: blob hashes to {got_blob}, not {blob_digest}")
        if diff_id is not None and got_diff != diff_id:
            raise BuildError(
                f"{label}: uncompressed layer hashes to {got_diff}, "
                f"but the image config says {diff_id}"
            )
        root = tmp / "rootfs"
        root.mkdir()
        with Step(progress, f"extract {label}") as step:
            extract_tar(plain, root, step=step)
        plain.unlink()
        whiteouts = apply_oci_whiteouts(root)
        meta = {"diff_id": got_diff, "whiteouts": str(whiteouts)}
        return store.add_dir(root, kind=kind, source=source, meta=meta, progress=progress)


# --------------------------------------------------------------------------- OCI layout


@dataclass
class OciImage:
    manifest_digest: str
    config: ImageConfig
    layers: list[tuple[str, str]]
    """(media type, blob digest) bottom first."""


def _host_arch() -> str:
    m = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(m, m)


def blob_path(layout: Path, digest: str) -> Path:
    if not DIGEST_RE.match(digest):
        raise BuildError(f"{layout}: descriptor digest {digest!r} is not a sha256 digest")
    p = layout / "blobs" / "sha256" / digest.split(":", 1)[1]
    if not p.is_file():
        raise BuildError(f"{layout}: blob {digest} is missing ({p})")
    return p


def _load_json(layout: Path, digest: str) -> dict[str, Any]:
    p = blob_path(layout, digest)
    data = p.read_bytes()
    actual = "sha256:" + hashlib.sha256(data).hexdigest()
    if actual != digest:
        raise BuildError(f"{layout}: blob {digest} is corrupt (hashes to {actual})")
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise BuildError(f"{layout}: blob {digest} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BuildError(f"{layout}: blob {digest} is not a JSON object")
    return doc


def _ref_of(desc: dict[str, Any]) -> str:
    ann = desc.get("annotations") or {}
    return str(ann.get(_REF_ANNOTATION) or ann.get(_CONTAINERD_NAME) or "")


def _pick(descs: list[dict[str, Any]], ref: str | None, layout: Path) -> dict[str, Any]:
    if ref is not None:
        for d in descs:
            ann = d.get("annotations") or {}
            names = {ann.get(_REF_ANNOTATION), ann.get(_CONTAINERD_NAME)}
            if ref in names or any(str(n).endswith(":" + ref) for n in names if n):
                return d
        refs = sorted(filter(None, (_ref_of(d) for d in descs)))
        raise InvalidRequest(
            f"{layout}: no image with ref {ref!r}; it has: {', '.join(refs) or 'no named refs'}"
        )
    if len(descs) == 1:
        return descs[0]
    refs = sorted(filter(None, (_ref_of(d) for d in descs)))
    raise InvalidRequest(
        f"{layout} holds {len(descs)} images; pass ref= one of: {', '.join(refs) or '(unnamed)'}"
    )


def read_oci_layout(layout: Path, ref: str | None) -> OciImage:
    """Resolve ``ref`` (or the only image) in an OCI image layout to config and layers."""
    index_file = layout / "index.json"
    if not index_file.is_file():
        raise BuildError(f"{layout} is not an OCI image layout: no index.json")
    try:
        index = json.loads(index_file.read_text())
    except ValueError as e:
        raise BuildError(f"{index_file} is not JSON: {e}") from None
    desc = _pick(list(index.get("manifests") or []), ref, layout)
    doc = _load_json(layout, desc["digest"])
    if desc.get("mediaType") in _INDEX_TYPES or doc.get("mediaType") in _INDEX_TYPES:
        arch = _host_arch()
        subs = [
            d
            for d in doc.get("manifests") or []
            if (d.get("platform") or {}).get("os", "linux") == "linux"
            and (d.get("platform") or {}).get("architecture") == arch
        ]
        if not subs:
            raise BuildError(f"{layout}: image {ref or ''} has no manifest for linux/{arch}")
        desc = subs[0]
        doc = _load_json(layout, desc["digest"])
    config = parse_config(_load_json(layout, doc["config"]["digest"]), f"{layout} config")
    layers = [(str(d.get("mediaType", "")), str(d["digest"])) for d in doc.get("layers") or []]
    if config.diff_ids and len(config.diff_ids) != len(layers):
        raise BuildError(
            f"{layout}: manifest has {len(layers)} layers but its config lists "
            f"{len(config.diff_ids)} diff_ids"
        )
    return OciImage(str(desc["digest"]), config, layers)
