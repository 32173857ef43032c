"""``corral image``: build, import, compose and inspect images in a layer store.

These commands work on the store directory itself (the node's ``store_dir`` or
``--store DIR``), so they need no running node and can build on any host that mounts a
shared store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Iterator
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from corral.cli._context import Globals, emit_json, err, human_bytes, out, parse_pairs
from corral.errors import ImageNotFound, InvalidRequest, LayerNotFound

if TYPE_CHECKING:
    from corral.images.store import LayerStore
    from corral.spec import ImageInfo, LayerInfo

__all__ = ["app", "resolve_stack"]

app = typer.Typer(
    help="Build, import and compose images (works on the layer store).", no_args_is_help=True
)
import_app = typer.Typer(help="Import images made by other tools.", no_args_is_help=True)
app.add_typer(import_app, name="import")

StoreOpt = Annotated[
    Path | None,
    typer.Option(
        "--store",
        envvar="CORRAL_STORE",
        help="Layer store directory (default: the node's store_dir).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
_HEX_PREFIX_RE = re.compile(r"^(?:sha256:)?([0-9a-f]{6,64})$")


class Kind(str, Enum):
    dir = "dir"
    tar = "tar"
    debian = "debian"
    pip = "pip"
    run = "run"


def _store(ctx: typer.Context, store_dir: Path | None) -> LayerStore:
    from corral.images.store import LayerStore

    g: Globals = ctx.obj
    cfg = g.config()
    compress = None if cfg.store_compress == "none" else cfg.store_compress
    return LayerStore(store_dir if store_dir is not None else cfg.store_dir, compress=compress)


@contextlib.contextmanager
def _progress() -> Iterator[Progress]:
    # On stderr, so stdout carries only the result (a digest, or JSON); off when stderr is
    # not a terminal, where redrawn bars would only litter logs.
    console = err()
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
    ) as p:
        yield p


def _short(digest: str) -> str:
    return digest.split(":", 1)[-1][:12]


def _as_json(ctx: typer.Context, flag: bool) -> bool:
    return flag or bool(getattr(ctx.obj, "json", False))


def _comma_list(values: list[str] | None) -> list[str]:
    return [v.strip() for item in values or [] for v in item.split(",") if v.strip()]


def _tag_names(name: str, tags: list[str] | None) -> list[str]:
    """``--tag v1`` on ``demo/py`` → ``demo/py:v1``; a value with ``/`` or ``:`` is a name."""
    base = name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name
    return [t if ("/" in t or ":" in t) else f"{base}:{t}" for t in tags or []]


# ----------------------------------------------------------------------------- build
@app.command("build")
def build(
    ctx: typer.Context,
    kind: Annotated[Kind, typer.Argument(help="What SOURCE is: dir, tar, debian, pip or run.")],
    source: Annotated[
        str | None,
        typer.Argument(
            help="dir: a directory; tar: an archive; debian: a suite (default "
            "bookworm); pip: a requirements file; run: a shell script file."
        ),
    ] = None,
    name: Annotated[str, typer.Option("--name", "-n", help="Image to create or update.")] = "",
    on: Annotated[
        str | None,
        typer.Option(
            "--on",
            help="Base image: stacked below the new layer (needed by pip "
            "and run, which build inside it).",
        ),
    ] = None,
    tag: Annotated[
        list[str] | None,
        typer.Option("--tag", "-t", help="Also write the image under this tag (repeatable)."),
    ] = None,
    include: Annotated[
        list[str] | None,
        typer.Option("--include", help="debian: extra packages, comma-separated (repeatable)."),
    ] = None,
    desktop: Annotated[
        bool,
        typer.Option(
            "--desktop",
            help="debian: add a small X desktop (Xorg, openbox, xterm, dillo) for the vm backend.",
        ),
    ] = False,
    variant: Annotated[str, typer.Option(help="debian: mmdebstrap variant.")] = "minbase",
    mirror: Annotated[str | None, typer.Option(help="debian: mirror URL.")] = None,
    req: Annotated[
        list[str] | None,
        typer.Option("--req", help="pip: a requirement, e.g. six==1.16.0 (repeatable)."),
    ] = None,
    target: Annotated[
        str, typer.Option(help="pip: 'system' or an absolute --target directory.")
    ] = "system",
    cmd: Annotated[
        list[str] | None, typer.Option("--cmd", "-c", help="run: a shell command (repeatable).")
    ] = None,
    file: Annotated[
        list[str] | None,
        typer.Option(
            "--file",
            metavar="DEST=HOST_PATH",
            help="run: copy a host file or directory in first (repeatable).",
        ),
    ] = None,
    network: Annotated[bool, typer.Option(help="run: give the commands the host network.")] = False,
    timeout: Annotated[float | None, typer.Option(help="run: seconds per command.")] = None,
    env: Annotated[
        list[str] | None, typer.Option("--env", "-e", metavar="K=V", help="Image environment.")
    ] = None,
    dest: Annotated[
        str | None,
        typer.Option(
            "--dest",
            help="dir, tar: where the tree goes in the image, and the image's working "
            "directory. Default for dir: /work when built --on a base image (a workspace), "
            "/ otherwise (a root filesystem); for tar: /.",
        ),
    ] = None,
    workdir: Annotated[
        str | None, typer.Option(help="Image working directory (default: --dest, or the base's).")
    ] = None,
    store_dir: StoreOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Build a layer and write image NAME = (base layers +) the new layer.

    Examples: ``corral image build dir ./rootfs --name demo/base``;
    ``corral image build dir ./repo --on py/pytest --name task/42`` (the repo at /work);
    ``corral image build debian bookworm --include python3,python3-pip --name demo/py``;
    ``corral image build pip --req six==1.16.0 --on demo/py --name demo/py-six``;
    ``corral image build run --cmd 'apt-get -y install git' --network --on demo/py --name x``.
    """
    from corral.images import build as b

    if not name:
        raise InvalidRequest("image build needs --name NAME (the image to write)")
    store = _store(ctx, store_dir)
    base = store.image(on) if on else None
    if kind in (Kind.pip, Kind.run) and base is None:
        raise InvalidRequest(f"image build {kind.value} needs --on BASE_IMAGE to build inside")
    image_env = {**(base.env if base else {}), **parse_pairs(env, "--env")}
    if desktop and kind is not Kind.debian:
        raise InvalidRequest(f"--desktop adds Debian packages; image build {kind.value} has none")
    if dest is not None and kind not in (Kind.dir, Kind.tar):
        raise InvalidRequest(f"--dest places a dir or tar; image build {kind.value} has no tree")
    if dest is None:
        dest = "/work" if kind is Kind.dir and base is not None else "/"
    if not dest.startswith("/") or ".." in dest.split("/"):
        raise InvalidRequest(f"--dest {dest!r}: an absolute path in the image without '..'")
    dest = str(PurePosixPath(dest))
    in_tree = kind in (Kind.dir, Kind.tar) and dest.rstrip("/") != ""
    image_workdir = workdir or (dest if in_tree else base.workdir if base else "/")
    # Everything is checked before the progress display starts, so a usage error is one
    # clean line rather than a half-drawn progress bar.
    if kind in (Kind.dir, Kind.tar):
        path = Path(_need(source, "a directory" if kind is Kind.dir else "an archive"))
    elif kind is Kind.pip:
        reqs = _requirements(source, req)
    elif kind is Kind.run:
        commands = list(cmd or [])
        if source:
            commands.append(_read_text(Path(source), "script"))
        files = {k: Path(v) for k, v in parse_pairs(file, "--file").items()}
    with _progress() as progress:
        if kind is Kind.dir:
            layer = b.build_dir(store, path, dest=dest, progress=progress)
        elif kind is Kind.tar:
            layer = b.build_tar(store, path, dest=dest, progress=progress)
        elif kind is Kind.debian:
            layer = b.build_debian(
                store,
                source or "bookworm",
                variant=variant,
                include=[*_comma_list(include), *(b.DESKTOP_PACKAGES if desktop else ())],
                mirror=mirror,
                progress=progress,
            )
        elif kind is Kind.pip:
            assert base is not None
            layer = b.build_pip(store, base, reqs, target=target, progress=progress)
        else:
            assert base is not None
            layer = b.build_run(
                store,
                base,
                commands,
                files=files,
                network=network,
                timeout=timeout,
                source=source or "",
                progress=progress,
            )
    layers = [*(base.layers if base else []), layer.digest]
    images = [
        store.put_image(n, layers, env=image_env, workdir=image_workdir)
        for n in [name, *_tag_names(name, tag)]
    ]
    if _as_json(ctx, json_out):
        emit_json({"layer": layer, "images": images})
        return
    for img in images:
        err().print(
            f"image [bold]{escape(img.name)}[/] {_short(img.digest)}: "
            f"{len(img.layers)} layer(s), new layer {human_bytes(layer.size)}"
        )
    typer.echo(layer.digest)


def _need(source: str | None, what: str) -> str:
    if not source:
        raise InvalidRequest(f"image build: SOURCE must name {what}")
    return source


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise InvalidRequest(f"cannot read {what} {path}: {e.strerror}") from None


def _requirements(source: str | None, req: list[str] | None) -> list[str]:
    reqs = list(req or [])
    if source:
        for line in _read_text(Path(source), "requirements file").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                reqs.append(line)
    if not reqs:
        raise InvalidRequest("image build pip: give a requirements file or --req SPEC")
    return reqs


# ---------------------------------------------------------------------------- import
@import_app.command("docker-save")
def import_docker_save(
    ctx: typer.Context,
    archive: Annotated[Path, typer.Argument(help="A `docker save` tar archive.")],
    name: Annotated[str, typer.Option("--name", "-n", help="Image to write.")],
    store_dir: StoreOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Import the first image of a `docker save` archive."""
    from corral.images import build as b

    store = _store(ctx, store_dir)
    with _progress() as progress:
        img = b.import_docker_save(store, archive, name, progress=progress)
    _print_image(ctx, img, json_out)


@import_app.command("oci")
def import_oci(
    ctx: typer.Context,
    layout: Annotated[Path, typer.Argument(help="An OCI image layout directory.")],
    name: Annotated[str, typer.Option("--name", "-n", help="Image to write.")],
    ref: Annotated[
        str | None, typer.Option(help="org.opencontainers.image.ref.name to pick.")
    ] = None,
    store_dir: StoreOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Import an image from an OCI image layout."""
    from corral.images import build as b

    store = _store(ctx, store_dir)
    with _progress() as progress:
        img = b.import_oci(store, layout, name, ref, progress=progress)
    _print_image(ctx, img, json_out)


def _print_image(ctx: typer.Context, img: ImageInfo, json_out: bool) -> None:
    if _as_json(ctx, json_out):
        emit_json(img)
    else:
        typer.echo(f"{img.name} {img.digest} ({len(img.layers)} layers)")


# --------------------------------------------------------------------------- compose
def resolve_stack(store: LayerStore, refs: list[str]) -> tuple[list[str], list[ImageInfo]]:
    """Layer digests for ``refs`` (bottom first) and the images among them.

    A ref is a layer digest, an image name (all its layers), an image's manifest digest,
    or an unambiguous prefix of a layer digest (6+ hex digits, as ``image layers`` shows).
    """
    digests: list[str] = []
    images: list[ImageInfo] = []
    known = [li.digest for li in store.layers()]
    for ref in refs:
        if ref in known:
            digests.append(ref)
            continue
        img = _image_or_none(store, ref)
        if img is not None:
            digests.extend(img.layers)
            images.append(img)
            continue
        m = _HEX_PREFIX_RE.match(ref)
        if m is None:
            store.image(ref)  # raises ImageNotFound naming close matches
            raise ImageNotFound(f"image {ref!r} not found")
        hits = [d for d in known if d.split(":", 1)[1].startswith(m.group(1))]
        if not hits:
            raise LayerNotFound(f"{ref!r} is neither an image nor a layer of the store")
        if len(hits) > 1:
            raise InvalidRequest(f"{ref!r} matches {len(hits)} layers; give more digits")
        digests.append(hits[0])
    return digests, images


def _image_or_none(store: LayerStore, ref: str) -> ImageInfo | None:
    try:
        return store.image(ref)
    except (ImageNotFound, InvalidRequest):
        return None


@app.command("compose")
def compose(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Image to write.")],
    refs: Annotated[
        list[str],
        typer.Argument(
            metavar="LAYER_OR_IMAGE...",
            help="Bottom first: image names (all "
            "their layers) or layer digests (or unique prefixes).",
        ),
    ],
    env: Annotated[
        list[str] | None, typer.Option("--env", "-e", metavar="K=V", help="Image environment.")
    ] = None,
    workdir: Annotated[str | None, typer.Option(help="Image working directory.")] = None,
    store_dir: StoreOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Write image NAME as a stack of layers; copies nothing, writes one manifest.

    Environment and workdir are inherited from the images named (later ones win), then
    --env/--workdir apply.
    """
    store = _store(ctx, store_dir)
    digests, images = resolve_stack(store, refs)
    image_env: dict[str, str] = {}
    image_workdir = "/"
    for img in images:
        image_env.update(img.env)
        if img.workdir != "/":
            image_workdir = img.workdir
    image_env.update(parse_pairs(env, "--env"))
    img = store.put_image(name, digests, env=image_env, workdir=workdir or image_workdir)
    _print_image(ctx, img, json_out)


# ------------------------------------------------------------------- ls, inspect, rm
def _sizes(store: LayerStore) -> dict[str, LayerInfo]:
    return {li.digest: li for li in store.layers()}


@app.command("ls")
def ls(ctx: typer.Context, store_dir: StoreOpt = None, json_out: JsonOpt = False) -> None:
    """List images: name, digest, layer count, total layer size."""
    store = _store(ctx, store_dir)
    images = store.images()
    if _as_json(ctx, json_out):
        emit_json(images)
        return
    layers = _sizes(store)
    table = Table(box=None, pad_edge=False)
    for col in ("NAME", "DIGEST", "LAYERS", "SIZE", "CREATED"):
        table.add_column(
            col, no_wrap=True, justify="right" if col in ("LAYERS", "SIZE") else "left"
        )
    for img in images:
        missing = [d for d in img.layers if d not in layers]
        size = sum(layers[d].size for d in img.layers if d in layers)
        table.add_row(
            img.name,
            _short(img.digest),
            str(len(img.layers)),
            human_bytes(size) + (" (+missing)" if missing else ""),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(img.created_at)),
        )
    out().print(table)


@app.command("inspect")
def inspect(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Image name or sha256: manifest digest.")],
    store_dir: StoreOpt = None,
) -> None:
    """Print an image manifest as JSON, with the records of its layers."""
    store = _store(ctx, store_dir)
    img = store.image(name)
    details = []
    for d in img.layers:
        try:
            details.append(store.layer(d).model_dump(mode="json"))
        except LayerNotFound:
            details.append({"digest": d, "missing": True})
    emit_json({**img.model_dump(mode="json"), "layer_details": details})


@app.command("rm")
def rm(
    ctx: typer.Context,
    names: Annotated[list[str], typer.Argument(metavar="NAME...", help="Images to remove.")],
    store_dir: StoreOpt = None,
) -> None:
    """Remove image manifests (their layers stay in the store)."""
    store = _store(ctx, store_dir)
    for n in names:
        store.remove_image(n)
        typer.echo(n)


@app.command("layers")
def layers(ctx: typer.Context, store_dir: StoreOpt = None, json_out: JsonOpt = False) -> None:
    """List the layers of the store and which images use them."""
    store = _store(ctx, store_dir)
    all_layers = store.layers()
    if _as_json(ctx, json_out):
        emit_json(all_layers)
        return
    users: dict[str, list[str]] = {}
    for img in store.images():
        for d in img.layers:
            users.setdefault(d, []).append(img.name)
    table = Table(box=None, pad_edge=False)
    for col in ("DIGEST", "KIND", "SIZE", "CREATED", "SOURCE", "IMAGES"):
        table.add_column(
            col,
            no_wrap=col in ("DIGEST", "KIND", "SIZE", "CREATED"),
            justify="right" if col == "SIZE" else "left",
        )
    for li in all_layers:
        table.add_row(
            _short(li.digest),
            li.kind,
            human_bytes(li.size),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(li.created_at)),
            li.source,
            ",".join(users.get(li.digest, [])) or "-",
        )
    out().print(table)


@app.command("gc")
def gc(
    ctx: typer.Context,
    store_dir: StoreOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only list what would be removed.")
    ] = False,
    grace: Annotated[
        float,
        typer.Option(
            "--grace",
            min=0,
            help="Keep layers touched (built, reused or composed) within this many seconds.",
        ),
    ] = 3600.0,
    forget_holder: Annotated[
        list[str] | None,
        typer.Option(
            "--forget-holder",
            metavar="HOLDER",
            help="First drop the leases of this node, gone for good (repeatable).",
        ),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Remove layers that no image references, no node has mounted (leases on the store)
    and nothing touched within --grace seconds. Safe with several nodes on one store."""
    from corral.images.leases import Leases

    store = _store(ctx, store_dir)
    for holder in forget_holder or []:
        dropped = Leases.forget(store.root, holder)
        err().print(f"forgot {len(dropped)} lease(s) of {holder}")
    report = store.gc(grace=grace, dry_run=dry_run)
    if _as_json(ctx, json_out):
        emit_json(dataclasses.asdict(report))
        return
    verb = "would remove" if dry_run else "removed"
    for d in report.removed:
        typer.echo(f"{verb} {d}")
    for d, holders in report.kept_leased.items():
        err().print(f"kept {_short(d)}: mounted by {', '.join(holders)}")
    err().print(
        f"{verb} {len(report.removed)} layer(s), {human_bytes(report.freed_bytes)}; kept "
        f"{report.referenced} referenced, {len(report.kept_leased)} mounted, "
        f"{len(report.kept_young)} younger than {grace:g} s"
    )
