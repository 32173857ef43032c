"""The layer store: content-addressed EROFS layers and named image manifests in a directory.

Layout (the directory may be a shared filesystem that several builders and nodes use)::

    ROOT/layers/<hex>.erofs     the layer, named by the SHA-256 of its bytes
    ROOT/layers/<hex>.json      its LayerInfo
    ROOT/layers/<hex>.verified  stamp: the file as it was when some node last hashed it
    ROOT/layers/<hex>.hot       what of the layer sandboxes read (images/hotblocks.py)
    ROOT/images/<quoted>.json   an ImageInfo, the name percent-quoted into one file name
    ROOT/tmp/                   files being written; renamed into place when complete
    ROOT/leases/<hex>/<holder>  node <holder> has the layer mounted (images/leases.py)

Every write goes to a unique file in ``tmp/`` (same filesystem), is fsynced, and is then
linked or renamed into place, so a reader never sees a partial file and two builders of
the same layer cannot corrupt each other: both produce the same bytes and the second
simply finds the first one's file.

Reads that a node makes on its request path (``image``, ``images``, ``layer``,
``path_of``) have a deadline (``timeout``): a network store whose servers are gone gives
:class:`StoreUnavailable` instead of hanging the node (images/_bounded.py). Unused layers
are removed by :meth:`LayerStore.gc` (images/storegc.py).

Example::

    store = LayerStore(Path("/srv/corral/store"))
    base = store.add_dir(Path("rootfs"), kind="dir")
    img = store.put_image("demo/base", [base.digest])
    store.verify(img.layers[0])
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from pydantic import ValidationError

from corral.errors import (
    BuildError,
    Conflict,
    ImageNotFound,
    InvalidRequest,
    LayerCorrupt,
    LayerNotFound,
    StoreUnavailable,
)
from corral.images import erofs
from corral.images._bounded import Bounded
from corral.images._progress import Step
from corral.images.leases import Leases
from corral.spec import ImageInfo, LayerInfo

if TYPE_CHECKING:
    from rich.progress import Progress

    from corral.images.storegc import GcReport

__all__ = ["LayerStore", "check_digest", "check_image_name", "image_digest", "DIGEST_RE"]

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# Like docker references: lower-case path components, an optional :tag.
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._/-]*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$")
_NAME_MAX = 255
_CHUNK = 1 << 20
_SETTLE_NS = 2_000_000_000


def check_digest(digest: str, what: str = "layer digest") -> str:
    """Return ``digest`` if it is ``sha256:`` + 64 lower-case hex digits, else InvalidRequest."""
    if not isinstance(digest, str) or not DIGEST_RE.match(digest):
        raise InvalidRequest(f"{what} {digest!r} is not of the form sha256:<64 hex digits>")
    return digest


def check_image_name(name: str) -> str:
    """Return ``name`` if it is a valid image name (``demo/python`` or ``demo/python:3.11``)."""
    if not isinstance(name, str) or len(name) > _NAME_MAX or not _NAME_RE.match(name):
        raise InvalidRequest(
            f"image name {name!r} is invalid: use lower-case letters, digits and . _ / -, "
            f"starting with a letter or digit, optionally :tag, at most {_NAME_MAX} characters"
        )
    return name


def image_digest(name: str, layers: list[str], env: dict[str, str], workdir: str) -> str:
    """SHA-256 of the canonical manifest JSON (every field but digest and created_at)."""
    doc = {"env": env, "layers": layers, "name": name, "workdir": workdir}
    canon = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some network filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _sig_of(st: os.stat_result) -> tuple[int, int, int, int]:
    """What changes whenever a file is replaced or rewritten."""
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _sig(path: Path) -> tuple[int, int, int, int] | None:
    try:
        return _sig_of(os.stat(path))
    except FileNotFoundError:
        return None


def _hash_file(path: Path, step: Step | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if step is not None:
                step.advance(len(chunk))
    return "sha256:" + h.hexdigest()


class LayerStore:
    """Content-addressed EROFS layers and image manifests under ``root``."""

    def __init__(
        self, root: Path, *, compress: str | None = "lz4", timeout: float | None = 10.0
    ) -> None:
        """Open (creating if needed) the store at ``root``.

        ``compress``: what ``add_dir`` passes to mkfs.erofs (``"lz4"``, ``"lz4hc"``, None, or
        ``"dax"``: uncompressed for microVMs that map layers with DAX, see erofs.DAX).
        ``timeout``: seconds a metadata read may take before StoreUnavailable (None: wait
        as long as the filesystem does).
        """
        self.root = Path(root)
        self.compress = compress
        self._io = Bounded(str(self.root), timeout)
        self._layers_dir = self.root / "layers"
        self._images_dir = self.root / "images"
        self._tmp_dir = self.root / "tmp"

        def make_dirs() -> None:
            for d in (self._layers_dir, self._images_dir, self._tmp_dir):
                d.mkdir(parents=True, exist_ok=True)

        self._io.call("opening it", make_dirs)
        self._verified: dict[str, tuple[int, int, int, int]] = {}
        self._images: dict[str, tuple[tuple[int, int, int, int], ImageInfo]] = {}
        """Name -> (its manifest file's signature, the image): see :meth:`image`."""
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LayerStore({str(self.root)!r})"

    # ----------------------------------------------------------------- writing helpers

    def _tmp_path(self, suffix: str) -> Path:
        return self._tmp_dir / f"{os.getpid()}-{uuid.uuid4().hex}{suffix}"

    def _write_atomic(self, dest: Path, data: bytes) -> None:
        tmp = self._tmp_path(".json")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(dest.parent)

    def _place(self, tmp: Path, dest: Path) -> None:
        """Move the finished ``tmp`` to ``dest`` unless an identical file is already there."""
        try:
            # link() refuses to replace: a node that has ``dest`` mounted keeps its inode,
            # and a concurrent builder that got there first wins without a second write.
            os.link(tmp, dest)
        except FileExistsError:
            pass
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
                raise
            # Filesystems without hard links: rename, which replaces same bytes with same.
            if not dest.exists():
                os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(dest.parent)

    def _adopt(
        self,
        tmp: Path,
        digest: str,
        *,
        kind: str,
        source: str,
        meta: dict[str, str] | None,
    ) -> LayerInfo:
        hex_ = digest.split(":", 1)[1]
        dest = self._layers_dir / f"{hex_}.erofs"
        manifest = self._layers_dir / f"{hex_}.json"
        size = tmp.stat().st_size
        self._place(tmp, dest)
        if manifest.exists():
            # Deduplicated: the first build's record (its kind, source and time) stands.
            # Touched, so gc's grace period counts from this build, whose image manifest
            # is not written yet.
            self._touch(manifest)
            try:
                return self.layer(digest)
            except (LayerNotFound, LayerCorrupt):
                pass  # unreadable record: rewrite it below
        info = LayerInfo(digest=digest, size=size, kind=kind, source=source, meta=dict(meta or {}))
        self._write_atomic(manifest, info.model_dump_json(indent=1).encode())
        return info

    # ---------------------------------------------------------------------- layers

    def add_dir(
        self,
        src: Path,
        *,
        kind: str,
        source: str = "",
        meta: dict[str, str] | None = None,
        progress: Progress | None = None,
        compress: str | None = "store",
    ) -> LayerInfo:
        """Build an EROFS layer from the tree at ``src`` and add it (deduplicated by digest).

        Owners, modes, mtimes, links, xattrs and overlay whiteouts of ``src`` are kept.
        ``compress``: ``"store"`` (the store's setting), or what ``erofs.mkfs`` takes.
        """
        src = Path(src)
        if not src.is_dir():
            raise BuildError(f"cannot build a layer from {src}: not a directory")
        level = self.compress if compress == "store" else compress
        tmp = self._tmp_path(".erofs")
        try:
            with Step(progress, f"mkfs.erofs {src.name or src}"):
                erofs.mkfs(src, tmp, compress=level)
            with Step(progress, "sha256", total=tmp.stat().st_size) as step:
                digest = _hash_file(tmp, step)
            meta = {"compression": level or "none", **(meta or {})}
            built = tmp.stat()
            info = self._adopt(tmp, digest, kind=kind, source=source, meta=meta)
            self._hashed(digest, built)
            return info
        finally:
            tmp.unlink(missing_ok=True)

    def _hashed(self, digest: str, built: os.stat_result) -> None:
        """Remember as verified a layer file this store just hashed, if the file in place
        is that very inode (a concurrent builder's file is checked on first use)."""
        st = self._layer_paths(digest)[0].stat()
        if (st.st_dev, st.st_ino) == (built.st_dev, built.st_ino):
            with self._lock:
                self._verified[digest] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def add_file(
        self,
        erofs_file: Path,
        *,
        kind: str,
        source: str = "",
        meta: dict[str, str] | None = None,
    ) -> LayerInfo:
        """Adopt an already-built EROFS image: copy it into the store (hashing on the way)."""
        erofs_file = Path(erofs_file)
        try:
            with open(erofs_file, "rb") as f:
                f.seek(1024)
                magic = f.read(4)
        except OSError as e:
            raise InvalidRequest(f"cannot read layer file {erofs_file}: {e.strerror}") from None
        if int.from_bytes(magic, "little") != erofs.EROFS_MAGIC:
            raise InvalidRequest(f"{erofs_file} is not an EROFS image (no EROFS magic at 1024)")
        tmp = self._tmp_path(".erofs")
        try:
            h = hashlib.sha256()
            with open(erofs_file, "rb") as src, open(tmp, "wb") as dst:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
            return self._adopt(tmp, "sha256:" + h.hexdigest(), kind=kind, source=source, meta=meta)
        finally:
            tmp.unlink(missing_ok=True)

    def _layer_paths(self, digest: str) -> tuple[Path, Path]:
        hex_ = check_digest(digest).split(":", 1)[1]
        return self._layers_dir / f"{hex_}.erofs", self._layers_dir / f"{hex_}.json"

    @staticmethod
    def _touch(path: Path) -> None:
        try:
            os.utime(path)
        except FileNotFoundError:
            pass

    def leases(self, holder: str) -> Leases:
        """The lease markers of node ``holder`` on this store (for ``LayerMounts``)."""
        return Leases(self.root, holder)

    def gc(self, *, grace: float = 3600.0, dry_run: bool = False) -> GcReport:
        """Remove layers no image references, no node has leased, and untouched for
        ``grace`` seconds (see images/storegc.py)."""
        from corral.images.storegc import collect

        return collect(self, grace=grace, dry_run=dry_run)

    def layer(self, digest: str) -> LayerInfo:
        """The record of one layer; LayerNotFound if the store does not have it."""
        return self._io.call(f"reading layer {digest}", lambda: self._layer(digest))

    def _layer(self, digest: str) -> LayerInfo:
        _, manifest = self._layer_paths(digest)
        try:
            data = manifest.read_bytes()
        except FileNotFoundError:
            raise LayerNotFound(f"layer {digest} is not in the store at {self.root}") from None
        try:
            return LayerInfo.model_validate_json(data)
        except ValidationError as e:
            raise LayerCorrupt(
                f"the record of layer {digest} ({manifest}) is invalid: {e}"
            ) from None

    def layers(self) -> list[LayerInfo]:
        """Every layer, oldest first."""
        return self._io.call("listing layers", self._list_layers)

    def _list_layers(self) -> list[LayerInfo]:
        out = []
        for p in self._layers_dir.glob("*.json"):
            try:
                out.append(LayerInfo.model_validate_json(p.read_bytes()))
            except (OSError, ValidationError):
                continue  # vanished or half-removed meanwhile: not a layer any more
        return sorted(out, key=lambda i: (i.created_at, i.digest))

    def path_of(self, digest: str) -> Path:
        """The ``.erofs`` file of a layer (LayerNotFound if absent)."""
        path, _ = self._layer_paths(digest)
        if not self._io.call(f"finding layer {digest}", path.is_file):
            raise LayerNotFound(f"layer {digest} has no file in the store at {self.root}")
        return path

    def _stat_layer(self, digest: str, path: Path) -> os.stat_result:
        try:
            st = path.stat()
        except FileNotFoundError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            raise LayerNotFound(f"layer {digest} has no file in the store at {self.root}")
        return st

    def verify(self, digest: str) -> None:
        """Re-hash the layer file; LayerCorrupt if it does not match its digest.

        A good result is remembered per (device, inode, size, mtime) of the file, so a
        node pays for the hash once per layer, and a replaced or rewritten file is checked
        again.

        It is also stamped on the store (``<hex>.verified``: inode, size, mtime, ctime of
        the file that hashed right), so on a shared store one node's full read stands for
        all: another node whose view of the file matches the stamp skips the hash. Without
        that, every node would read every byte of every layer it mounts over the network,
        and on-demand loading would read as much as an eager copy. What the stamp trusts:
        any change made through the filesystem (a rewrite, a truncation, a replaced file)
        moves the mtime/ctime or inode and forces a new hash; media errors under the
        filesystem are the shared filesystem's to catch (MooseFS, CephFS and 3FS checksum
        their chunks). Some filesystems keep whole seconds only (MooseFS), where a rewrite
        within the second of the hash would not show: a stamp counts only once it is
        settled, written at least ``_SETTLE_NS`` after the file's last change by the
        store's own clock (the stamp file's mtime); an unsettled one is re-hashed and
        rewritten.
        """
        # One stat of the file and one open of its stamp: on a network store each path
        # walk is a round trip, and a layer's first mount waits for these.
        path = self._layer_paths(digest)[0]
        st = self._io.call(f"finding layer {digest}", lambda: self._stat_layer(digest, path))
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if self._verified.get(digest) == key:
            return
        stamp_path = path.with_suffix(".verified")
        stamp = f"{st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}\n"
        try:
            with open(stamp_path, "rb") as f:
                written = os.fstat(f.fileno()).st_mtime_ns
                settled = written >= max(st.st_mtime_ns, st.st_ctime_ns) + _SETTLE_NS
                stamped = settled and f.read().decode() == stamp
        except (OSError, UnicodeDecodeError):
            stamped = False
        if not stamped:
            actual = _hash_file(path)
            if actual != digest:
                with self._lock:
                    self._verified.pop(digest, None)
                raise LayerCorrupt(
                    f"layer file {path} is corrupt: its content hashes to {actual}, not {digest}"
                )
            with contextlib.suppress(OSError):  # a read-only store: every node hashes
                self._write_atomic(stamp_path, stamp.encode())
        with self._lock:
            self._verified[digest] = key

    def hot_profile(self, digest: str) -> bytes | None:
        """The layer's hot-block profile (``<hex>.hot``, images/hotblocks.py), None if it
        has none. Under the store's deadline."""
        path = self._layer_paths(digest)[0].with_suffix(".hot")

        def read() -> bytes | None:
            try:
                return path.read_bytes()
            except FileNotFoundError:
                return None

        return self._io.call(f"reading the hot-block profile of {digest}", read)

    def save_hot_profile(self, digest: str, data: bytes, *, replace: bool = False) -> None:
        """Store the layer's hot-block profile; unless ``replace``, only if it has none
        (the first writer wins, as with layers)."""
        dest = self._layer_paths(digest)[0].with_suffix(".hot")

        def write() -> None:
            tmp = self._tmp_path(".hot")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if replace:
                os.replace(tmp, dest)
                _fsync_dir(dest.parent)
            else:
                self._place(tmp, dest)

        self._io.call(f"writing the hot-block profile of {digest}", write)

    def forget_verified(self, digest: str) -> None:
        """Drop the remembered good hash of ``digest`` (its file was removed)."""
        with self._lock:
            self._verified.pop(digest, None)

    def remove_layer(self, digest: str) -> None:
        """Delete a layer; Conflict if an image references it."""
        path, manifest = self._layer_paths(digest)
        if not manifest.exists() and not path.exists():
            raise LayerNotFound(f"layer {digest} is not in the store at {self.root}")
        users = sorted(i.name for i in self.images() if digest in i.layers)
        if users:
            raise Conflict(
                f"layer {digest} is used by image(s) {', '.join(users)}; remove those images first"
            )
        # Record first: a file without a record is invisible; a record without a file
        # would be a broken layer.
        manifest.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        path.with_suffix(".verified").unlink(missing_ok=True)
        path.with_suffix(".hot").unlink(missing_ok=True)
        with self._lock:
            self._verified.pop(digest, None)
        _fsync_dir(self._layers_dir)

    # ---------------------------------------------------------------------- images

    def _image_path(self, name: str) -> Path:
        return self._images_dir / (quote(name, safe="") + ".json")

    def put_image(
        self,
        name: str,
        layers: list[str],
        *,
        env: dict[str, str] | None = None,
        workdir: str = "/",
    ) -> ImageInfo:
        """Write (or replace) the manifest of image ``name``: ``layers`` bottom first.

        Only a manifest is written; every layer must already be in the store.
        """
        check_image_name(name)
        if not layers:
            raise InvalidRequest(f"image {name!r} needs at least one layer")
        for d in layers:
            check_digest(d)
        self._touch_layers(name, layers)
        env = dict(env or {})
        if not isinstance(workdir, str) or not workdir.startswith("/"):
            raise InvalidRequest(f"image {name!r}: workdir {workdir!r} must be an absolute path")
        try:
            info = ImageInfo(
                name=name,
                digest=image_digest(name, list(layers), env, workdir),
                layers=list(layers),
                env=env,
                workdir=workdir,
            )
        except ValidationError as e:
            raise InvalidRequest(f"image {name!r}: {e}") from None
        self._write_atomic(self._image_path(name), info.model_dump_json(indent=1).encode())
        # A gc that decided between the touch above and the write may have removed a
        # layer meanwhile: checked again, so such an image is reported, not left broken.
        self._touch_layers(name, layers)
        return info

    def _touch_layers(self, name: str, layers: list[str]) -> None:
        """Reset gc's grace period of every layer of a manifest being written; LayerNotFound
        for layers not in the store."""
        missing = []
        for d in layers:
            try:
                os.utime(self._layer_paths(d)[1])
            except FileNotFoundError:
                missing.append(d)
        if missing:
            raise LayerNotFound(
                f"image {name!r} names layer(s) not in the store: {', '.join(missing)}"
            )

    def image(self, ref: str) -> ImageInfo:
        """An image by name or by ``sha256:`` manifest digest; ImageNotFound lists near names.

        Every create looks its image up: a name whose manifest file is unchanged (same
        inode, size, mtime and ctime; a manifest is only ever replaced by a rename, so a
        new one is a new inode) is answered from memory after one ``stat`` instead of a
        read and a parse. Another node writing the shared store is seen at the next call.
        """
        return self._io.call(f"reading image {ref!r}", lambda: self._image_fresh(ref))

    async def image_async(self, ref: str) -> ImageInfo:
        """:meth:`image` for the event loop: the lookup's store round trip is awaited, not
        waited for, so the loop serves other requests meanwhile."""
        return await self._io.acall(f"reading image {ref!r}", lambda: self._image_fresh(ref))

    def _image_fresh(self, ref: str) -> ImageInfo:
        cached = self._images.get(ref) if isinstance(ref, str) else None
        if cached is not None:
            sig, info = cached
            if _sig(self._image_path(ref)) == sig:
                return info.model_copy(update={"layers": list(info.layers), "env": dict(info.env)})
        return self._image(ref)

    def _image(self, ref: str) -> ImageInfo:
        if isinstance(ref, str) and ref.startswith("sha256:"):
            check_digest(ref, "image digest")
            for info in self._list_images():
                if info.digest == ref:
                    return info
            raise ImageNotFound(f"no image in the store at {self.root} has digest {ref}")
        check_image_name(ref)
        path = self._image_path(ref)
        try:
            with open(path, "rb") as f:
                sig = _sig_of(os.fstat(f.fileno()))
                info = ImageInfo.model_validate_json(f.read())
            if len(self._images) >= 256:  # a handful of images per node in practice
                self._images.clear()
            self._images[ref] = (sig, info.model_copy(deep=True))
            return info
        except FileNotFoundError:
            if not self.root.is_dir():
                raise StoreUnavailable(
                    f"image {ref!r}: the layer store {self.root} is not there (an unmounted "
                    "share or a moved directory?); sandboxes already running keep their "
                    "mounted layers, new ones can start once it is back"
                ) from None
        names = [i.name for i in self._list_images()]
        close = difflib.get_close_matches(ref, names, n=5, cutoff=0.5)
        hint = (
            f"; did you mean {', '.join(close)}?"
            if close
            else (
                f"; the store has {len(names)} image(s)" if names else "; the store has no images"
            )
        )
        raise ImageNotFound(f"image {ref!r} not found{hint}")

    def images(self) -> list[ImageInfo]:
        """Every image, by name."""
        return self._io.call("listing images", self._list_images)

    def _list_images(self) -> list[ImageInfo]:
        out = []
        for p in self._images_dir.glob("*.json"):
            try:
                out.append(ImageInfo.model_validate_json(p.read_bytes()))
            except (OSError, ValidationError):
                continue
        return sorted(out, key=lambda i: i.name)

    def remove_image(self, name: str) -> None:
        """Delete an image manifest (its layers stay; remove them with remove_layer)."""
        info = self.image(name)
        self._image_path(info.name).unlink(missing_ok=True)
        _fsync_dir(self._images_dir)

    # ---------------------------------------------------------------------- upkeep

    def clean_tmp(self, older_than: float = 6 * 3600) -> int:
        """Remove files left in ``tmp/`` by builders that died; returns how many."""
        cutoff = time.time() - older_than
        removed = 0
        for p in self._tmp_dir.iterdir():
            try:
                if p.lstat().st_mtime < cutoff:
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p)
                    else:
                        p.unlink()
                    removed += 1
            except OSError:
                continue
        return removed
