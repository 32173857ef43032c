"""``corral image build dir|tar --dest``: a workspace lands at /work, not over the image's /."""

from __future__ import annotations

import contextlib
import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

from typer.testing import CliRunner

import corral.cli.app as cli_app
from corral.host import mounts
from corral.images.store import LayerStore


@contextlib.contextmanager
def mounted(store: LayerStore, digest: str, at: Path) -> Iterator[Path]:
    at.mkdir(parents=True, exist_ok=True)
    mounts.mount_erofs(store.path_of(digest), at)
    try:
        yield at
    finally:
        mounts.umount(at)


def build(store: Path, *args: str) -> dict:  # type: ignore[type-arg]
    r = CliRunner().invoke(cli_app.app, ["image", "build", *args, "--store", str(store), "--json"])
    assert r.exit_code == 0, (r.stdout, r.stderr)
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def repo(path: Path) -> Path:
    (path / "tests").mkdir(parents=True)
    (path / "setup.py").write_text("print('setup')\n")
    (path / "tests" / "test_x.py").write_text("def test_x(): pass\n")
    os.chmod(path / "setup.py", 0o640)
    return path


def test_workspace_on_a_base_goes_to_work(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    base_tree = tmp_path / "base"
    (base_tree / "etc").mkdir(parents=True)
    (base_tree / "etc" / "hostname").write_text("sandbox\n")
    build(store_dir, "dir", str(base_tree), "--name", "t/base")
    src = repo(tmp_path / "repo")

    out = build(store_dir, "dir", str(src), "--on", "t/base", "--name", "task/42")
    store = LayerStore(store_dir)
    img = store.image("task/42")
    assert img.workdir == "/work"
    assert len(img.layers) == 2
    with mounted(store, out["layer"]["digest"], tmp_path / "mnt") as m:
        assert sorted(os.listdir(m)) == ["work"]  # nothing spread over /
        assert (m / "work" / "setup.py").read_text() == "print('setup')\n"
        assert (m / "work" / "tests" / "test_x.py").exists()
        assert (m / "work" / "setup.py").stat().st_mode & 0o777 == 0o640
        assert m.stat().st_mode & 0o777 == 0o755
    # The same tree builds the same layer (no build time in it).
    again = build(store_dir, "dir", str(src), "--on", "t/base", "--name", "task/42b")
    assert again["layer"]["digest"] == out["layer"]["digest"]

    # An explicit --dest, and --dest / for a tree that really is a root filesystem.
    deep = build(store_dir, "dir", str(src), "--on", "t/base", "--dest", "/srv/app/", "--name", "x")
    assert store.image("x").workdir == "/srv/app"
    with mounted(store, deep["layer"]["digest"], tmp_path / "mnt2") as m:
        assert (m / "srv" / "app" / "setup.py").exists()
    flat = build(store_dir, "dir", str(src), "--on", "t/base", "--dest", "/", "--name", "y")
    assert store.image("y").workdir == "/"
    with mounted(store, flat["layer"]["digest"], tmp_path / "mnt3") as m:
        assert (m / "setup.py").exists()


def test_dir_without_base_stays_a_root_filesystem(tmp_path: Path) -> None:
    src = repo(tmp_path / "rootfs")
    out = build(tmp_path / "store", "dir", str(src), "--name", "r")
    store = LayerStore(tmp_path / "store")
    assert store.image("r").workdir == "/"
    with mounted(store, out["layer"]["digest"], tmp_path / "mnt") as m:
        assert (m / "setup.py").exists()


def test_tar_with_dest(tmp_path: Path) -> None:
    src = repo(tmp_path / "repo")
    archive = tmp_path / "repo.tar"
    with tarfile.open(archive, "w") as tf:
        tf.add(src / "setup.py", arcname="setup.py")
    out = build(tmp_path / "store", "tar", str(archive), "--dest", "/work", "--name", "t")
    store = LayerStore(tmp_path / "store")
    assert store.image("t").workdir == "/work"
    with mounted(store, out["layer"]["digest"], tmp_path / "mnt") as m:
        assert sorted(os.listdir(m)) == ["work"]
        assert (m / "work" / "setup.py").exists()


def test_dest_is_refused_where_there_is_no_tree(tmp_path: Path) -> None:
    r = CliRunner().invoke(
        cli_app.app,
        ["image", "build", "debian", "--dest", "/x", "--name", "n", "--store", str(tmp_path)],
    )
    assert r.exit_code == 2 and "--dest" in r.stderr
    r = CliRunner().invoke(
        cli_app.app,
        ["image", "build", "dir", str(tmp_path), "--dest", "../x", "--name", "n"]
        + ["--store", str(tmp_path / "s")],
    )
    assert r.exit_code == 2 and "absolute" in r.stderr
