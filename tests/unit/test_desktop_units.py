"""The desktop VM's pure parts: key and pointer events, action batches, the QEMU
command line, the spec and CLI checks (no VM booted here; tests/integration/test_desktop.py
boots one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.backends.microvm.qemu import VMFiles
from corral.backends.vm import keys, machine
from corral.backends.vm.screen import Screen
from corral.errors import InvalidRequest
from corral.spec import Desktop, DesktopInput, SandboxSpec


def _q(name: str) -> dict[str, object]:
    return {"type": "qcode", "data": name}


def test_text_is_us_layout_key_presses() -> None:
    assert keys.text_combos("a A\n") == [
        [_q("a")],
        [_q("spc")],
        [_q("shift"), _q("a")],
        [_q("ret")],
    ]
    assert keys.text_combos('~|"')[0] == [_q("shift"), _q("grave_accent")]
    with pytest.raises(InvalidRequest, match="'é' cannot be typed"):
        keys.text_combos("é")


def test_key_combos() -> None:
    assert keys.combo("ctrl+l") == [_q("ctrl"), _q("l")]
    assert keys.combo("Ctrl+Shift+T") == [_q("ctrl"), _q("shift"), _q("shift"), _q("t")]
    assert keys.combo("ctrl++") == [_q("ctrl"), _q("shift"), _q("equal")]
    assert keys.combo("enter") == [_q("ret")]
    assert keys.combo("f5") == [_q("f5")]
    for bad in ("ctrl+", "", "hyper+x", "ctrl+ä"):
        with pytest.raises(InvalidRequest):
            keys.combo(bad)


def test_pointer_scaling_and_bounds() -> None:
    assert keys.abs_events(0, 0, 1024, 768)[0]["data"] == {"axis": "x", "value": 0}
    far = keys.abs_events(1023, 767, 1024, 768)
    assert [e["data"]["value"] for e in far] == [keys.ABS_MAX, keys.ABS_MAX]  # type: ignore[index]
    with pytest.raises(InvalidRequest, match="outside the 1024x768 screen"):
        keys.abs_events(1024, 0, 1024, 768)


def _batches(**kw: object) -> list[list[dict[str, object]]]:
    return Screen(Path("/nonexistent"), 1024, 768)._batches(DesktopInput.model_validate(kw))


def test_action_batches() -> None:
    click = _batches(action="click", x=10, y=10, count=2, button="right")
    assert len(click) == 5 and click[1][0]["data"] == {"down": True, "button": "right"}
    # a key combo: downs in order, ups in reverse, one report each
    k = _batches(action="key", keys="ctrl+l")
    assert [(e[0]["data"]["down"], e[0]["data"]["key"]) for e in k] == [  # type: ignore[index]
        (True, _q("ctrl")),
        (True, _q("l")),
        (False, _q("l")),
        (False, _q("ctrl")),
    ]
    drag = _batches(action="drag", x=0, y=0, to_x=200, to_y=100)
    assert len(drag) == 2 + 20 + 1  # start, press, 20 steps, release
    assert drag[-2][0]["data"]["value"] == round(200 * keys.ABS_MAX / 1023)  # type: ignore[index]
    assert len(_batches(action="scroll", dy=-3)) == 3
    for bad in (
        dict(action="click"),
        dict(action="drag", x=1, y=1),
        dict(action="scroll", x=1, y=1),
        dict(action="type"),
        dict(action="key"),
    ):
        with pytest.raises(InvalidRequest):
            _batches(**bad)


def test_vm_argv_has_display_input_qmp_and_the_jail(tmp_path: Path) -> None:
    files = VMFiles(
        kernel=Path("/k"),
        initrd=Path("/i"),
        layers=[Path("/store/a"), Path("/store/b")],
        disk=tmp_path / "disk.img",
        console=tmp_path / "console.log",
        vm_sock=tmp_path / "vm.sock",
        pidfile=tmp_path / "vmm.pid",
    )
    argv = machine.vm_argv(
        files,
        qmp=tmp_path / "qmp.sock",
        accel="tcg",
        cpus=1,
        memory_mib=1024,
        runas="7:7",
        width=1280,
        height=800,
    )
    joined = " ".join(argv)
    assert "q35,i8042=off" in joined
    assert "VGA,xres=1280,yres=800,edid=on,vgamem_mb=16" in joined
    assert "virtio-tablet-pci" in argv and "virtio-keyboard-pci" in argv
    assert f"unix:{tmp_path}/qmp.sock,server=on,wait=off" in argv
    assert argv[argv.index("-chroot") + 1] == str(tmp_path)
    assert argv[argv.index("-runas") + 1] == "7:7"
    assert joined.count("virtio-blk-pci") == 3
    assert machine.vgamem_mb(3840, 2160) == 64  # 2 frames of 31.6 MiB
    assert "id=rw,file=disk.img,format=raw" in joined  # relative: reopened in the chroot
    assert "-netdev" not in argv  # no MAC, no NIC


def test_vm_argv_nic_and_the_guest_driver_for_it(tmp_path: Path) -> None:
    """With a MAC the desktop VM gets the microVM's NIC (the tap in the VMM's netns) as
    virtio-net-pci, and its initramfs loads the driver (the generic kernel has it as a
    module: without it the guest has no eth0)."""
    files = VMFiles(
        kernel=Path("/k"),
        initrd=Path("/i"),
        layers=[],
        disk=tmp_path / "disk.img",
        console=tmp_path / "console.log",
        vm_sock=tmp_path / "vm.sock",
        pidfile=tmp_path / "vmm.pid",
        mac="52:54:00:00:00:01",
    )
    argv = machine.vm_argv(
        files,
        qmp=tmp_path / "qmp.sock",
        accel="tcg",
        cpus=1,
        memory_mib=1024,
        runas="7:7",
        width=1280,
        height=800,
        dns="10.0.0.1",
        hostname="h",
    )
    joined = " ".join(argv)
    assert "tap,id=n0,ifname=tap0,script=no,downscript=no" in argv
    assert "virtio-net-pci,netdev=n0,mac=52:54:00:00:00:01" in argv
    assert "corral.net=100.127.255.254/30,100.127.255.253" in joined
    assert "corral.dns=10.0.0.1 corral.hostname=h" in joined
    assert "virtio_net" in machine.MODULES


def test_desktop_spec_limits() -> None:
    assert SandboxSpec(image="x", backend="vm", desktop=Desktop()).desktop == Desktop(
        width=1280, height=800
    )
    with pytest.raises(ValueError):
        Desktop(width=100, height=100)


async def test_desktop_on_a_container_is_refused_by_the_registry() -> None:
    from corral.node.registry import Backends

    class _B:
        kind = "container"

    with pytest.raises(InvalidRequest, match="only the 'vm' backend has a display"):
        Backends([_B()], "container").for_spec(  # type: ignore[list-item]
            SandboxSpec(image="x", desktop=Desktop())
        )


def test_desktop_on_a_microvm_and_a_backend_the_node_lacks_are_refused() -> None:
    from corral.node.registry import Backends

    class _C:
        kind = "container"

    class _M:
        kind = "microvm"

    reg = Backends([_C(), _M()], "container")  # type: ignore[list-item]
    with pytest.raises(InvalidRequest, match="only the 'vm' backend .* backend is 'microvm'"):
        reg.for_spec(SandboxSpec(image="x", backend="microvm", desktop=Desktop()))
    with pytest.raises(InvalidRequest, match="no 'vm' backend \\(it has: container, microvm\\)"):
        reg.for_spec(SandboxSpec(image="x", backend="vm"))


async def test_fake_node_refuses_desktops() -> None:
    from corral.testing import FakeNode

    fake = FakeNode()
    with pytest.raises(InvalidRequest, match="only the 'vm' backend"):
        await fake.sandbox_create(SandboxSpec(image="x", desktop=Desktop()))


def test_cli_desktop_size() -> None:
    from corral.cli._desktop import parse_size

    assert parse_size("1024x768") == Desktop(width=1024, height=768)
    assert parse_size(None) is None
    for bad in ("1024", "axb", "10x10"):
        with pytest.raises(InvalidRequest):
            parse_size(bad)


async def test_sdk_desktop_over_http() -> None:
    """``sb.desktop`` through the REST API: PNG bytes back, each action one validated
    request; a sandbox without a display is a 400 InvalidRequest."""
    import httpx

    from corral.api.app import create_app
    from corral.sdk._http import HTTPOps
    from corral.sdk._sandbox import Sandbox
    from corral.testing import FakeNode

    png = b"\x89PNG\r\n\x1a\n" + b"x" * 10
    got: list[DesktopInput] = []

    class _Desk(FakeNode):
        BACKENDS = ("container", "vm")

        async def desktop_screenshot(self, sandbox_id: str) -> bytes:
            if self._sb(sandbox_id).info.backend != "vm":
                return await super().desktop_screenshot(sandbox_id)
            return png

        async def desktop_input(self, sandbox_id: str, req: DesktopInput) -> None:
            got.append(req)

    node = _Desk()
    ops = HTTPOps("http://corral.test", transport=httpx.ASGITransport(create_app(node)))
    try:
        info = await ops.sandbox_create(
            SandboxSpec(image="demo/base", backend="vm", desktop=Desktop())
        )
        sb = Sandbox._wrap(ops, info)
        assert await sb.desktop.screenshot() == png
        await sb.desktop.click(1, 2, button="right")
        await sb.desktop.type("hi\n")
        await sb.desktop.key("ctrl+l")
        await sb.desktop.drag(1, 2, 3, 4)
        await sb.desktop.scroll(dy=-2)
        await sb.desktop.move(5, 6)
        assert [g.action for g in got] == ["click", "type", "key", "drag", "scroll", "move"]
        assert got[0].button == "right" and got[1].text == "hi\n" and got[3].to_y == 4
        with pytest.raises(InvalidRequest):
            await sb.desktop.click(-1, 0)  # refused by the model, before any request
        plain = Sandbox._wrap(ops, await ops.sandbox_create(SandboxSpec(image="demo/base")))
        with pytest.raises(InvalidRequest, match="has no display"):
            await plain.desktop.screenshot()
    finally:
        await ops.close()


def test_cli_desktop_commands(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``sandbox create --backend vm --desktop WxH``, ``screenshot``, ``input``; a desktop
    on a container and a bad size are one-line user errors."""
    from typer.testing import CliRunner

    from corral.cli import app as cli_app
    from corral.sdk import AsyncClient
    from corral.testing import FakeNode

    got: list[DesktopInput] = []

    class _Desk(FakeNode):
        BACKENDS = ("container", "vm")

        async def desktop_screenshot(self, sandbox_id: str) -> bytes:
            return b"\x89PNG\r\n\x1a\nfake"

        async def desktop_input(self, sandbox_id: str, req: DesktopInput) -> None:
            got.append(req)

    node = _Desk(node_id="fake")
    monkeypatch.setattr(cli_app, "_client_factory", lambda g: AsyncClient(ops=node))

    def cli(*args: str):  # type: ignore[no-untyped-def]
        return CliRunner().invoke(cli_app.app, list(args))

    r = cli("sandbox", "create", "demo/base", "--backend", "vm", "--desktop", "800x600")
    assert r.exit_code == 0, r.stderr
    sid = r.stdout.strip()
    info = node._sb(sid).info
    assert info.backend == "vm" and info.spec.desktop == Desktop(width=800, height=600)
    r = cli("sandbox", "screenshot", sid, str(tmp_path / "s.png"))
    assert r.exit_code == 0, r.stderr
    assert (tmp_path / "s.png").read_bytes().startswith(b"\x89PNG")
    r = cli("sandbox", "input", sid, "type", "--text", "ls\\n")
    assert r.exit_code == 0, r.stderr
    r = cli("sandbox", "input", sid, "click", "--x", "5", "--y", "6", "--button", "right")
    assert r.exit_code == 0, r.stderr
    assert [(g.action, g.text, g.x, g.button) for g in got] == [
        ("type", "ls\n", None, "left"),
        ("click", "", 5, "right"),
    ]
    for bad in (
        ("sandbox", "create", "demo/base", "--desktop", "800x600"),
        ("sandbox", "create", "demo/base", "--backend", "vm", "--desktop", "big"),
        ("sandbox", "input", sid, "wiggle"),
    ):
        r = cli(*bad)
        assert r.exit_code == 2 and r.stderr.startswith("error: "), (bad, r.stderr)
