"""Layer and image builders: from a directory, a tarball, a Debian release, shell commands
or pip requirements over a base image, a ``docker save`` archive, an OCI image layout.

Every builder returns the LayerInfo it added (importers, which define a whole image,
return the ImageInfo), and shows its phases as rich progress lines when given a
``progress`` (``rich.progress.Progress``); without one it prints nothing.

Example::

    store = LayerStore(Path("/srv/corral/store"))
    base = build_debian(store, "bookworm", include=["python3", "python3-pip"])
    img = store.put_image("demo/python", [base.digest])
    tools = build_pip(store, img, ["six"])
    store.put_image("demo/python-six", [*img.layers, tools.digest])
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from corral.errors import BuildError, InvalidRequest
from corral.images import _apt
from corral.images._oci import blob_path as _blob_path
from corral.images._oci import layer_from_blob, parse_config, read_oci_layout
from corral.images._proc import ToolFailed, run_tool
from corral.images._progress import Step
from corral.images._rootfs import BuildRoot
from corral.images._tarx import extract_tar
from corral.images.store import LayerStore
from corral.spec import ImageInfo, LayerInfo

if TYPE_CHECKING:
    from rich.progress import Progress

__all__ = [
    "build_dir",
    "build_tar",
    "build_debian",
    "build_run",
    "build_pip",
    "import_docker_save",
    "import_oci",
    "RESOLV_CONF_PLACEHOLDER",
    "DESKTOP_PACKAGES",
]

RESOLV_CONF_PLACEHOLDER = (
    "# Placeholder written by corral's image builder. A sandbox gets its resolver\n"
    "# configuration from the node at start; with no network it has none.\n"
)
_SUITE_RE = re.compile(r"^[a-z][a-z0-9.-]{1,40}$")
_PKG_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]*(?::[a-z0-9-]+)?(?:[=/][A-Za-z0-9.+~:-]+)?$")
_DEBIAN_TIMEOUT = 3600.0

DESKTOP_PACKAGES = (
    "xserver-xorg-core",  # Xorg with the modesetting driver (the VM's bochs-drm display)
    "xserver-xorg-input-evdev",  # input from /dev/input, configured without udev
    "x11-xserver-utils",  # xrandr, xsetroot
    "x11-utils",  # xdpyinfo, xwininfo: the session's readiness checks
    "xfonts-base",  # xterm's core fonts
    "fonts-dejavu-core",  # the browser's and the window manager's fonts
    "openbox",  # a small window manager that places windows by itself
    "xterm",
    "dillo",  # a small browser
    "xdotool",  # the session focuses its terminal with it; agents may script X with it too
    "procps",
)
"""What ``corral image build debian --desktop`` adds: a small X desktop for the ``vm``
backend (corral.backends.vm), whose session script runs Xorg, the window manager and a
terminal. No display manager, no udev, no dbus: the VM's agent starts the session."""


def _scratch_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


def _rmtree_unmounted(path: Path) -> None:
    """rmtree, unless something is still mounted below (never delete through a mount)."""
    from corral.host import mounts

    if not path.exists():
        return
    if mounts.mounts_under(path):
        raise BuildError(f"not removing {path}: something is still mounted below it")
    shutil.rmtree(path)


# --------------------------------------------------------------------------- dir, tar


def _dest_parts(dest: str) -> tuple[str, ...]:
    """The path components of an absolute in-image destination (none for ``/``)."""
    return PurePosixPath(_check_inside_path(dest)).parts[1:]


def _make_parents(root: Path, parts: tuple[str, ...]) -> Path:
    """``root/parts...`` with each level ``0755 root:root``, mtime 0 (a layer's digest must
    not depend on when it was built); returns the innermost directory."""
    d = root
    for part in parts:
        d = d / part
        d.mkdir(mode=0o755)
        os.chmod(d, 0o755)
    for level in [root / Path(*parts[: i + 1]) for i in range(len(parts))][::-1]:
        os.utime(level, (0, 0), follow_symlinks=False)
    return d


def _dir_compress(store: LayerStore) -> str | None:
    """lz4hc for workspaces unless the store's owner turned compression off."""
    return None if store.compress is None else "lz4hc"


def build_dir(
    store: LayerStore, path: Path, *, dest: str = "/", progress: Progress | None = None
) -> LayerInfo:
    """A layer of the tree at ``path``, as it is on disk (owners, modes, xattrs...), placed
    at ``dest`` in the image: ``/`` for a root filesystem, e.g. ``/work`` for a repository
    stacked on a base image as its workspace (without one the repository's files would
    land next to /etc and /proc). Compressed with lz4hc in 64 KiB clusters: a workspace
    is built once and read, from a shared store, by every sandbox of its task, so bytes
    on the wire count more than build time (see :data:`corral.images.erofs.LZ4HC_PCLUSTER`)."""
    path = Path(path)
    if not path.is_dir():
        raise InvalidRequest(f"{path} is not a directory")
    parts = _dest_parts(dest)
    source = str(path.resolve())
    if not parts:
        return store.add_dir(
            path, kind="dir", source=source, progress=progress, compress=_dir_compress(store)
        )
    tmp = _scratch_dir("corral-dir-")
    try:
        root = tmp / "rootfs"
        root.mkdir()
        target = _make_parents(root, parts[:-1]) / parts[-1]
        with Step(progress, f"copy {path.name or path} to {dest}") as step:
            # cp -a keeps owners, modes, links, xattrs and mtimes, as mkfs.erofs would have
            # read them from ``path`` itself.
            run_tool(
                ["cp", "-a", "--", source, str(target)],
                what=f"copying {path} to {dest} in the layer",
                step=step,
            )
        os.utime(target.parent, (0, 0), follow_symlinks=False)
        return store.add_dir(
            root,
            kind="dir",
            source=source,
            meta={"dest": dest},
            progress=progress,
            compress=_dir_compress(store),
        )
    finally:
        _rmtree_unmounted(tmp)


def build_tar(
    store: LayerStore, archive: Path, *, dest: str = "/", progress: Progress | None = None
) -> LayerInfo:
    """A layer of a ``.tar``, ``.tar.gz`` or ``.tgz`` archive, extracted at ``dest``.

    Extracted as root with owners, modes, setuid bits and xattrs kept; members with an
    absolute path or ``..``, or that would be written through a symlink, are refused.
    """
    archive = Path(archive)
    if not archive.is_file():
        raise InvalidRequest(f"{archive} is not a file")
    parts = _dest_parts(dest)
    tmp = _scratch_dir("corral-tar-")
    try:
        root = tmp / "rootfs"
        root.mkdir()
        target = _make_parents(root, parts[:-1]) / parts[-1] if parts else root
        target.mkdir(exist_ok=True)
        with Step(progress, f"extract {archive.name}") as step:
            summary = extract_tar(archive, target, step=step)
        if parts:
            os.utime(target.parent, (0, 0), follow_symlinks=False)
        meta = {"members": str(summary.members), **({"dest": dest} if parts else {})}
        return store.add_dir(
            root, kind="tar", source=str(archive.resolve()), meta=meta, progress=progress
        )
    finally:
        _rmtree_unmounted(tmp)


# --------------------------------------------------------------------------- debian


def _clean_debian_tree(root: Path) -> None:
    """Drop what only the build needed (apt lists and caches, logs); keep apt's lock files
    and directories, which it expects."""
    for sub in ("var/lib/apt/lists", "var/cache/apt", "var/log/apt"):
        for dirpath, _dirs, filenames in os.walk(root / sub):
            for f in filenames:
                if f != "lock":
                    os.unlink(os.path.join(dirpath, f))
    for rel in ("var/log/dpkg.log", "var/log/alternatives.log", "var/log/bootstrap.log"):
        (root / rel).unlink(missing_ok=True)
    _write_etc(root, "resolv.conf", RESOLV_CONF_PLACEHOLDER)
    _neutral_host_names(root)


NEUTRAL_HOSTNAME = "sandbox"
"""The hostname images carry (and :class:`corral.spec.SandboxSpec`'s default)."""
NEUTRAL_HOSTS = (
    "127.0.0.1\tlocalhost\n"
    f"127.0.1.1\t{NEUTRAL_HOSTNAME}\n"
    "::1\tlocalhost ip6-localhost ip6-loopback\n"
    "ff02::1\tip6-allnodes\n"
    "ff02::2\tip6-allrouters\n"
)


def _write_etc(root: Path, name: str, text: str) -> None:
    """Replace ``root/etc/name`` (a file or a symlink, never followed) with ``text``."""
    path = root / "etc" / name
    if os.path.lexists(path):
        path.unlink()
    path.write_text(text)
    os.chmod(path, 0o644)


def _neutral_host_names(root: Path) -> None:
    """No build host's name in the image: mmdebstrap copies the host's /etc/hostname (here
    "vm") into the tree, and every sandbox would read it. /etc/hosts is replaced when it
    names the build host, and written when missing (minbase has none), so ``localhost``
    and the sandbox's own name resolve without DNS."""
    _write_etc(root, "hostname", NEUTRAL_HOSTNAME + "\n")
    hosts = root / "etc/hosts"
    build_host = socket.gethostname()
    text = "" if os.path.islink(hosts) else _read_or_empty(hosts)
    names = {w for line in text.splitlines() for w in line.split("#", 1)[0].split()[1:]}
    if not text or build_host in names or build_host.split(".")[0] in names:
        _write_etc(root, "hosts", NEUTRAL_HOSTS)


def _read_or_empty(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def build_debian(
    store: LayerStore,
    suite: str = "bookworm",
    *,
    variant: str = "minbase",
    include: Sequence[str] = (),
    mirror: str | None = None,
    progress: Progress | None = None,
) -> LayerInfo:
    """A base layer of a Debian release, bootstrapped with mmdebstrap (or debootstrap).

    ``mirror`` defaults to the Debian archive for ``suite`` in the host's apt sources.
    Apt caches, package lists and logs are removed; /etc/resolv.conf is a placeholder.
    """
    if not _SUITE_RE.match(suite):
        raise InvalidRequest(f"suite {suite!r} is not a Debian suite name like 'bookworm'")
    if variant not in ("minbase", "buildd", "required", "important", "standard"):
        raise InvalidRequest(
            f"variant {variant!r} is not one of minbase, buildd, required, important, standard"
        )
    for pkg in include:
        if not _PKG_RE.match(pkg):
            raise InvalidRequest(f"package name {pkg!r} is not a Debian package name")
    mirror = mirror or _apt.find_mirror(suite)
    tmp = _scratch_dir("corral-debian-")
    root = tmp / "rootfs"
    try:
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "DEBIAN_FRONTEND": "noninteractive",
            "HOME": "/root",
        }
        mmdebstrap = shutil.which("mmdebstrap")
        if mmdebstrap:
            argv = [
                mmdebstrap,
                "--mode=root",
                f"--variant={variant}",
                "--components=main",
                "--format=directory",
            ]
            if include:
                argv.append("--include=" + ",".join(include))
            argv += [suite, str(root), mirror]
            tool = "mmdebstrap"
        elif shutil.which("debootstrap"):
            argv = ["debootstrap", f"--variant={variant}", "--components=main"]
            if include:
                argv.append("--include=" + ",".join(include))
            argv += [suite, str(root), mirror]
            tool = "debootstrap"
        else:
            raise BuildError("neither mmdebstrap nor debootstrap is installed on this host")
        with Step(progress, f"{tool} {suite}") as step:
            try:
                run_tool(argv, what=f"{tool} {suite}", step=step, env=env, timeout=_DEBIAN_TIMEOUT)
            except ToolFailed as e:
                raise BuildError(
                    f"{tool} of {suite} ({variant}) from {mirror} failed:\n{e.output}"
                ) from None
        _clean_debian_tree(root)
        meta = {"suite": suite, "variant": variant, "mirror": mirror, "tool": tool}
        if include:
            meta["include"] = ",".join(include)
        return store.add_dir(
            root, kind="debian", source=f"debian:{suite}/{variant}", meta=meta, progress=progress
        )
    finally:
        _rmtree_unmounted(tmp)


# --------------------------------------------------------------------------- run, pip


def _check_inside_path(p: str) -> str:
    pp = PurePosixPath(p)
    if not pp.is_absolute() or ".." in pp.parts or "\0" in p:
        raise InvalidRequest(f"destination {p!r} must be an absolute path without '..'")
    return str(pp)


def build_run(
    store: LayerStore,
    base: ImageInfo,
    commands: Sequence[str],
    *,
    kind: str = "run",
    source: str = "",
    files: dict[str, Path] | None = None,
    network: bool = False,
    timeout: float | None = None,
    progress: Progress | None = None,
) -> LayerInfo:
    """A layer of what shell ``commands`` change when run over ``base`` (in a chroot).

    ``files``: destination in the image -> host file or directory, copied in (owned by
    root) before the commands run. ``network``: give the commands the host's network and
    resolver (off by default: a new, empty network namespace). Deletions become overlay
    whiteouts, so the layer stacked on ``base`` reproduces the result. ``timeout`` is per
    command.
    """
    if not commands and not files:
        raise InvalidRequest("build_run needs at least one command or file")
    binds: dict[str, Path] = {}
    copies: list[tuple[str, str, bool]] = []
    for i, (dest, src) in enumerate((files or {}).items()):
        src = Path(src)
        if not src.exists():
            raise InvalidRequest(f"file to copy {src} does not exist")
        binds[f"in{i}"] = src
        copies.append((f"in{i}", _check_inside_path(dest), src.is_dir()))
    root = BuildRoot(store, base.layers, network=network, env=base.env, binds=binds)
    try:
        with (
            root,
            Step(progress, f"run over {base.name}", total=len(commands) + len(copies)) as step,
        ):
            for name, dest, is_dir in copies:
                staged, q = root.staged(name), shlex.quote
                parent = q(str(PurePosixPath(dest).parent))
                if is_dir:
                    script = (
                        f"mkdir -p {q(dest)} && cp -R --preserve=mode,timestamps,links "
                        f"{q(staged)}/. {q(dest)}/"
                    )
                else:
                    script = (
                        f"mkdir -p {parent} && cp --preserve=mode,timestamps {q(staged)} {q(dest)}"
                    )
                root.run(
                    ["/bin/sh", "-c", script], what=f"copying {dest} into the image", step=step
                )
                step.advance(1)
            for cmd in commands:
                try:
                    root.run(
                        ["/bin/sh", "-c", cmd], what=f"command {cmd!r}", step=step, timeout=timeout
                    )
                except ToolFailed as e:
                    raise BuildError(
                        f"build command {cmd!r} over {base.name} failed "
                        f"(exit {e.returncode}):\n{e.output}"
                    ) from None
                step.advance(1)
        meta = {"base": base.digest, "commands": json.dumps(list(commands))}
        return store.add_dir(
            root.upper, kind=kind, source=source or base.name, meta=meta, progress=progress
        )
    finally:
        root.cleanup()


def _pip_download(
    requirements: Sequence[str], wheelhouse: Path, py_version: str, step: Step
) -> None:
    host_version = "%d.%d" % sys.version_info[:2]
    pip = [sys.executable, "-m", "pip"]
    try:
        # Wheels only, for the base's Python version (whatever version runs corral);
        # the host's pip configuration decides where packages come from.
        run_tool(
            [
                *pip,
                "download",
                "--disable-pip-version-check",
                "--only-binary=:all:",
                "--python-version",
                py_version,
                "-d",
                str(wheelhouse),
                *requirements,
            ],
            what="pip download",
            step=step,
        )
        return
    except ToolFailed as e:
        first = e
    if py_version != host_version:
        raise BuildError(
            f"pip could not download wheels of {list(requirements)} for Python "
            f"{py_version}:\n{first.output}"
        )
    # Same version as the host: pip may build wheels of source-only packages here.
    try:
        run_tool(
            [*pip, "wheel", "--disable-pip-version-check", "-w", str(wheelhouse), *requirements],
            what="pip wheel",
            step=step,
        )
    except ToolFailed as e:
        raise BuildError(
            f"pip could not fetch {list(requirements)}:\n{first.output}\npip wheel:\n{e.output}"
        ) from None


def build_pip(
    store: LayerStore,
    base: ImageInfo,
    requirements: Sequence[str],
    *,
    target: str = "system",
    progress: Progress | None = None,
) -> LayerInfo:
    """A toolkit layer of pip ``requirements`` installed into ``base``'s Python.

    Wheels are downloaded on the host with the host's pip (and its configuration), then
    installed offline in a chroot over ``base``. ``target``: ``"system"`` (the base's
    site-packages, e.g. /usr/local/lib/python3.X/dist-packages on Debian) or an absolute
    directory (``pip install --target``, for PYTHONPATH). The base needs python3 and pip.
    """
    reqs = [r.strip() for r in requirements]
    if not reqs:
        raise InvalidRequest("build_pip needs at least one requirement")
    for r in reqs:
        if not r or r.startswith("-") or "\0" in r or "\n" in r:
            raise InvalidRequest(
                f"requirement {r!r} is not a requirement specifier (options are not accepted)"
            )
    if target != "system":
        _check_inside_path(target)
    wheelhouse = _scratch_dir("corral-wheels-")
    root = BuildRoot(store, base.layers, network=False, env=base.env, binds={"wheels": wheelhouse})
    try:
        with root, Step(progress, f"pip over {base.name}") as step:
            py = _probe_python(root, base)
            step.note(f"python {py['version']}, pip {py['pip']}")
            _pip_download(reqs, wheelhouse, py["version"], step)
            wheels = sorted(p.name for p in wheelhouse.iterdir())
            argv = [
                "python3",
                "-m",
                "pip",
                "install",
                "--no-index",
                "--no-cache-dir",
                "--disable-pip-version-check",
                "--find-links",
                root.staged("wheels"),
            ]
            if _pip_at_least(py["pip"], (23, 0, 1)):
                argv.append("--break-system-packages")
            if _pip_at_least(py["pip"], (22, 1)):
                argv.append("--root-user-action=ignore")
            if target != "system":
                argv += ["--target", target]
            try:
                root.run([*argv, *reqs], what="pip install", step=step)
            except ToolFailed as e:
                raise BuildError(
                    f"pip install of {reqs} over {base.name} failed:\n{e.output}"
                ) from None
        meta = {
            "base": base.digest,
            "requirements": json.dumps(reqs),
            "wheels": json.dumps(wheels),
            "target": target,
            "python": py["version"],
        }
        return store.add_dir(
            root.upper, kind="pip", source=" ".join(reqs), meta=meta, progress=progress
        )
    finally:
        try:
            root.cleanup()
        finally:
            shutil.rmtree(wheelhouse, ignore_errors=True)


def _pip_at_least(version: str, want: tuple[int, ...]) -> bool:
    nums = tuple(int(x) for x in re.findall(r"\d+", version)[: len(want)])
    return nums >= want


def _probe_python(root: BuildRoot, base: ImageInfo) -> dict[str, str]:
    try:
        out = root.run(
            ["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            what="python3 probe",
        )
    except BuildError:
        raise BuildError(
            f"base image {base.name} has no working python3; build it with "
            "python3 and python3-pip (e.g. build_debian(include=['python3', "
            "'python3-pip']))"
        ) from None
    version = out.strip().splitlines()[-1]
    try:
        pip_out = root.run(["python3", "-m", "pip", "--version"], what="pip probe")
    except BuildError:
        raise BuildError(
            f"base image {base.name} has python3 {version} but no pip (install python3-pip)"
        ) from None
    m = re.search(r"pip (\S+)", pip_out)
    return {"version": version, "pip": m.group(1) if m else "0"}


# --------------------------------------------------------------------------- importers


def _load_member_json(tf: tarfile.TarFile, name: str, archive: Path) -> Any:
    try:
        f = tf.extractfile(name)
    except KeyError:
        raise BuildError(f"{archive}: no {name} in the archive") from None
    if f is None:
        raise BuildError(f"{archive}: {name} is not a file")
    try:
        return json.load(f)
    except ValueError as e:
        raise BuildError(f"{archive}: {name} is not JSON: {e}") from None


def import_docker_save(
    store: LayerStore, archive: Path, name: str, *, progress: Progress | None = None
) -> ImageInfo:
    """Import a ``docker save`` archive as image ``name`` (its first image, layers in order).

    Each layer becomes an EROFS layer with OCI whiteouts turned into overlayfs ones; env
    and working directory come from the image config.
    """
    from corral.images.store import check_image_name

    check_image_name(name)
    archive = Path(archive)
    try:
        tf = tarfile.open(archive, "r:*")
    except (OSError, tarfile.TarError) as e:
        raise BuildError(f"{archive} is not a readable docker-save archive: {e}") from None
    with tf:
        manifest = _load_member_json(tf, "manifest.json", archive)
        if not isinstance(manifest, list) or not manifest:
            raise BuildError(f"{archive}: manifest.json lists no image")
        entry = manifest[0]
        config = parse_config(
            _load_member_json(tf, entry["Config"], archive), f"{archive}:{entry['Config']}"
        )
        paths = list(entry.get("Layers") or [])
        if config.diff_ids and len(config.diff_ids) != len(paths):
            raise BuildError(
                f"{archive}: {len(paths)} layers but {len(config.diff_ids)} diff_ids in the config"
            )
        digests = []
        for i, member in enumerate(paths):
            diff_id = config.diff_ids[i] if config.diff_ids else None

            def open_blob(member: str = member) -> Any:
                f = tf.extractfile(member)
                if f is None:
                    raise BuildError(f"{archive}: layer {member} is missing or not a file")
                return f

            info = layer_from_blob(
                store,
                open_blob,
                kind="docker",
                source=f"{archive.name}:{member}",
                blob_digest=None,
                diff_id=diff_id,
                progress=progress,
                label=f"layer {i + 1}/{len(paths)}",
            )
            digests.append(info.digest)
    if not digests:
        raise BuildError(f"{archive}: the image has no layers")
    return store.put_image(name, digests, env=config.env, workdir=config.workdir)


def import_oci(
    store: LayerStore,
    layout: Path,
    name: str,
    ref: str | None = None,
    *,
    progress: Progress | None = None,
) -> ImageInfo:
    """Import an image from an OCI image layout directory (index.json, blobs/sha256/...).

    ``ref`` selects by ``org.opencontainers.image.ref.name`` when the layout holds several
    images; a multi-platform index resolves to this host's architecture. Layers may be
    plain, gzip or zstd tars; every blob is checked against its digest.
    """
    from corral.images.store import check_image_name

    check_image_name(name)
    layout = Path(layout)
    img = read_oci_layout(layout, ref)
    digests = []
    for i, (_media_type, digest) in enumerate(img.layers):
        path = _blob_path(layout, digest)
        diff_id = img.config.diff_ids[i] if img.config.diff_ids else None
        info = layer_from_blob(
            store,
            lambda p=path: open(p, "rb"),
            kind="oci",
            source=f"{layout}@{digest}",
            blob_digest=digest,
            diff_id=diff_id,
            progress=progress,
            label=f"layer {i + 1}/{len(img.layers)}",
        )
        digests.append(info.digest)
    if not digests:
        raise BuildError(f"{layout}: the image has no layers")
    return store.put_image(name, digests, env=img.config.env, workdir=img.config.workdir)
