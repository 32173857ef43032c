"""Calls that name no image on a node without ``fncall.default_image``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import corral.cli.app as cli_app
from corral.backends.fncall.config import SETUP_IMAGE, FnCallConfig
from corral.errors import ImageNotFound, InvalidRequest
from corral.node.fncall import FnCallService


class _Store:
    def __init__(self, *names: str) -> None:
        self.names = set(names)

    def image(self, name: str) -> object:
        if name not in self.names:
            raise ImageNotFound(f"no image {name!r} in the store")
        return object()


async def test_fresh_node_names_the_command_that_makes_its_default() -> None:
    svc = FnCallService(SimpleNamespace(store=_Store()), FnCallConfig())  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest) as e:
        svc._pool(None)
    assert "corral fncall setup" in e.value.message and SETUP_IMAGE in e.value.message
    # Named images keep their own error.
    with pytest.raises(ImageNotFound, match="judge/cpp"):
        svc._pool("judge/cpp")


async def test_configured_default_wins_and_setup_image_is_the_fallback() -> None:
    store = _Store("judge/cpp")
    svc = FnCallService(SimpleNamespace(store=store), FnCallConfig(default_image="judge/cpp"))  # type: ignore[arg-type]
    assert svc._pool(None).cfg.image == "judge/cpp"
    svc = FnCallService(SimpleNamespace(store=store), FnCallConfig(default_image="x/missing"))  # type: ignore[arg-type]
    with pytest.raises(ImageNotFound, match="x/missing"):
        svc._pool(None)
    store.names.add(SETUP_IMAGE)
    svc = FnCallService(SimpleNamespace(store=store), FnCallConfig())  # type: ignore[arg-type]
    assert svc._pool(None).cfg.image == SETUP_IMAGE


def test_setup_is_a_no_op_when_the_image_exists(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from corral.images import build
    from corral.images.store import LayerStore

    src = tmp_path / "tree"
    (src / "etc").mkdir(parents=True)
    store = LayerStore(tmp_path / "store")
    layer = build.build_dir(store, src)
    store.put_image(SETUP_IMAGE, [layer.digest])

    def no_build(*a, **kw):  # type: ignore[no-untyped-def]
        raise AssertionError("built again")

    monkeypatch.setattr(build, "build_debian", no_build)
    r = CliRunner().invoke(cli_app.app, ["fncall", "setup", "--store", str(tmp_path / "store")])
    assert r.exit_code == 0, r.stderr
    assert "already" in r.stderr
