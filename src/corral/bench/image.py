"""The benchmark image: built once into the bench store, and the same rootfs for Docker.

``--image debian`` (the default) is a Debian minbase layer of the host's release, built
with :func:`corral.images.build.build_debian` the first time and kept in the store as
``bench/debian``. Where that build is not possible (no mirror, no builder), it falls back
to ``bench/busybox``: one layer holding busybox-static and its applet links. Any other
``--image`` value is an image name already in the store.

Docker gets exactly the same files: the image's EROFS layers are mounted read-only
(stacked with a read-only overlay when there are several) and piped through
``tar | docker import``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from corral.errors import CorralError, ImageNotFound
from corral.host import mounts
from corral.images.store import LayerStore
from corral.spec import ImageInfo

__all__ = ["BenchImage", "ensure_image", "mounted_rootfs", "BUILTIN"]

DEBIAN = "bench/debian"
BUSYBOX = "bench/busybox"
BUILTIN = {"debian": DEBIAN, "busybox": BUSYBOX}


@dataclass(frozen=True)
class BenchImage:
    info: ImageInfo
    kind: str
    """What the image is, for the JSON: ``debian-minbase (bookworm)``, ``busybox-static``."""
    note: str = ""
    """Why a fallback was taken, if one was."""

    def describe(self) -> dict[str, str]:
        d = {"name": self.info.name, "digest": self.info.digest, "kind": self.kind}
        if self.note:
            d["note"] = self.note
        return d


def _say(msg: str) -> None:
    print(f"[image] {msg}", file=sys.stderr, flush=True)


def _host_suite() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("VERSION_CODENAME="):
                return line.split("=", 1)[1].strip().strip('"') or "bookworm"
    return "bookworm"


def ensure_image(store: LayerStore, want: str = "debian") -> BenchImage:
    """The image to benchmark, building the built-in one on first use."""
    if want not in BUILTIN:
        info = store.image(want)
        return BenchImage(info, kind=f"store image {want}")
    if want == "busybox":
        return _busybox(store)
    suite = _host_suite()
    with contextlib.suppress(ImageNotFound):
        return BenchImage(store.image(DEBIAN), kind=f"debian-minbase ({suite})")
    try:
        info = _build_debian(store, suite)
    except (CorralError, ImportError, OSError, TypeError) as e:
        note = f"debian minbase build failed, fell back to busybox-static: {e}"
        _say(note)
        return BenchImage(_busybox(store).info, kind="busybox-static", note=note[:500])
    return BenchImage(info, kind=f"debian-minbase ({suite})")


def _build_debian(store: LayerStore, suite: str) -> ImageInfo:
    from corral.images import build  # the builder is heavy and only needed once

    _say(f"building {DEBIAN} (Debian {suite} minbase) once into {store.root}")
    built = build.build_debian(store, suite)
    layers = list(getattr(built, "layers", None) or [built.digest])
    env = dict(getattr(built, "env", {}) or {})
    return store.put_image(DEBIAN, layers, env=env)


def _busybox(store: LayerStore) -> BenchImage:
    with contextlib.suppress(ImageNotFound):
        return BenchImage(store.image(BUSYBOX), kind="busybox-static")
    busybox = Path("/bin/busybox")
    if not busybox.exists():
        raise CorralError("busybox-static is not installed (apt-get install busybox-static)")
    _say(f"building {BUSYBOX} into {store.root}")
    with tempfile.TemporaryDirectory(prefix="corral-bench-bb-") as tmp:
        root = Path(tmp) / "rootfs"
        for d in ("bin", "etc", "tmp", "proc", "sys", "dev", "root", "run", "var/tmp"):
            (root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(root / "tmp", 0o1777)
        shutil.copy2(busybox, root / "bin" / "busybox")
        applets = subprocess.run(
            [str(busybox), "--list"], capture_output=True, text=True, check=True
        ).stdout.split()
        for a in applets:
            if a != "busybox":
                (root / "bin" / a).symlink_to("busybox")
        (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
        (root / "etc" / "group").write_text("root:x:0:\n")
        layer = store.add_dir(root, kind="dir", source="busybox-static", meta={"bench": "busybox"})
    return BenchImage(store.put_image(BUSYBOX, [layer.digest]), kind="busybox-static")


@contextlib.contextmanager
def mounted_rootfs(store: LayerStore, image: ImageInfo, work: Path) -> Iterator[Path]:
    """The image's merged root filesystem, read-only, under ``work`` for the duration."""
    work.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="rootfs-", dir=work))
    mounted: list[Path] = []
    try:
        lowers = []
        for i, digest in enumerate(image.layers):
            d = base / f"l{i}"
            d.mkdir()
            mounts.mount_erofs(store.path_of(digest), d)
            mounted.append(d)
            lowers.append(d)
        if len(lowers) == 1:
            yield lowers[0]
            return
        merged = base / "merged"
        merged.mkdir()
        mounts.mount_overlay(list(reversed(lowers)), None, None, merged)  # top first
        mounted.append(merged)
        yield merged
    finally:
        for m in reversed(mounted):
            with contextlib.suppress(CorralError):
                mounts.umount(m, detach=True)
        shutil.rmtree(base, ignore_errors=True)
