"""The full-VM desktop backend (``backend="vm"``) on a real node: QEMU q35 under TCG,
the generic Debian kernel, corral-init as PID 1, an X session with a terminal, QMP
screenshots and input. One desktop VM for the module (a TCG desktop boot takes a minute
or more on a busy host: heavy). The kernel is fetched once into /var/cache, the desktop
image built once into the test store (``build_debian(..., DESKTOP_PACKAGES)``)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.conftest import TAG, TEST_STORE
from tests.integration import pngread
from tests.integration.conftest import assert_no_leaks, node_config, open_node, run_bench
from tests.integration.nethosts import PKGS_IP, TestHosts, guest_http, network_config

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs QEMU"),
    pytest.mark.skipif(not Path("/bin/busybox").exists(), reason="needs busybox-static"),
    pytest.mark.timeout(900),  # the module's VM boots in the first test's setup
]

STATE = Path(f"/var/lib/corral-test{TAG}-desk")
RUN = Path(f"/run/corral-test{TAG}-desk")
SUBTREE = f"corral-test{TAG}-desk"
KERNEL = Path("/var/cache/corral-test-desktop/kernel")
W, H = 1024, 768


def _ensure_desktop_image() -> str:
    """The desktop test image's name (by its package list: a changed list builds anew)."""
    from corral.images import build
    from corral.images.store import LayerStore

    packages = ["python3", *build.DESKTOP_PACKAGES]
    name = "test/desktop-" + hashlib.sha256(" ".join(packages).encode()).hexdigest()[:8]
    store = LayerStore(TEST_STORE)
    if name not in {i.name for i in store.images()}:
        layer = build.build_debian(store, "bookworm", include=packages)
        store.put_image(name, [layer.digest])
    return name


def _vmm_procs() -> list[int]:
    """QEMU processes whose command line names this module's state dirs."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if cmd.startswith(b"qemu-system") and f"corral-test{TAG}-desk".encode() in cmd:
            out.append(int(p))
    return out


def _png(data: bytes) -> pngread.Image:
    return pngread.read(data)


@pytest.fixture(scope="module")
def hosts():  # type: ignore[no-untyped-def]
    with TestHosts() as h:
        yield h


@pytest.fixture(scope="module")
async def desk(images_ready, hosts):  # type: ignore[no-untyped-def]
    """(node, sandbox info, seconds from create to the first screenshot). The node has
    the network tests' permissions (its subnet differs from theirs and the microVMs')."""
    from corral.backends.config import ContainerConfig, VMConfig
    from corral.spec import Desktop, Limits, SandboxSpec

    image = _ensure_desktop_image()
    cfg = node_config(
        state_dir=STATE,
        run_dir=RUN,
        cgroup_subtree=SUBTREE,
        backends=[ContainerConfig(), VMConfig(kernel_dir=KERNEL)],
        network=network_config(subnet="10.212.12.0/22"),
    )
    async with open_node(cfg) as n:
        spec = SandboxSpec(
            image=image,
            backend="vm",
            desktop=Desktop(width=W, height=H),
            limits=Limits(cpus=1, memory="1GiB", disk="1GiB"),
            qos="latency",  # a TCG boot on idle CPU only would take minutes more
        )
        t0 = time.monotonic()
        info = await n.sandbox_create(spec)
        try:
            await n.desktop_screenshot(info.id)
            yield n, info, time.monotonic() - t0
        finally:
            d = n.backends.get("vm").dir(info.id)
            await n.sandbox_destroy(info.id)
            assert not _vmm_procs()
            assert not d.exists()
    assert_no_leaks(STATE, RUN, SUBTREE)


async def _wait_file(n, sid: str, path: str, timeout: float = 120.0) -> bytes:  # type: ignore[no-untyped-def]
    """The file's bytes once the guest wrote it (a readiness poll, bounded)."""
    from corral.errors import NotFound

    deadline = time.monotonic() + timeout
    while True:
        try:
            return await n.file_read(sid, path)
        except NotFound:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)


@pytest.mark.heavy
async def test_screenshot_is_a_png_of_the_desktop(desk):  # type: ignore[no-untyped-def]
    n, info, boot = desk
    print(f"\ndesktop boot-to-screenshot: {boot:.1f} s (load {os.getloadavg()[0]:.1f})")
    status = n.backends.get("vm").status()
    assert status.ok and status.accel in ("kvm", "tcg"), status
    img = _png(await n.desktop_screenshot(info.id))
    assert (img.width, img.height) == (W, H)
    colors = img.colors()
    assert len(colors) > 2, "a blank screen"
    # the session's background colour covers much of the screen: X is drawing, not the
    # kernel's text console
    assert colors[(0x2E, 0x5A, 0x88)] > W * H // 10, colors.most_common(5)


@pytest.mark.heavy
async def test_network_default_none_then_allowlist(desk):  # type: ignore[no-untyped-def]
    """The desktop VM has the microVM's network: a virtio-net NIC on a tap in the VMM's
    netns. No policy: no way out; a named allowlist granted live reaches its ``.test``
    host through the node's resolver, another name is denied."""
    from corral.spec import ExecRequest

    n, info, _ = desk
    assert info.address is None
    r = await n.exec(info.id, ExecRequest(cmd=["cat", "/sys/class/net/eth0/address"]))
    assert r.exit_code == 0 and r.stdout.startswith(b"52:54:"), r
    ok, out = await guest_http(n, info.id, PKGS_IP, "/simple/")
    assert not ok, out
    got = await n.network_update(info.id, allow=["pkgs"])
    assert got.address
    ok, out = await guest_http(n, info.id, "pkgs.test", "/simple/")
    assert ok and "tinypkg" in out, out
    ok, out = await guest_http(n, info.id, "npm.test")
    assert not ok, out


@pytest.mark.heavy
async def test_pause_with_memory_snapshot_keeps_the_desktop(desk):  # type: ignore[no-untyped-def]
    """A desktop VM saved to a memory snapshot (the microVM engine's path, on q35 with a
    display) and restored: the VMM is gone meanwhile, and after resume the screen is the
    same size and the session still takes typed commands."""
    from corral.spec import DesktopInput

    n, info, _ = desk
    paused = await n.sandbox_pause(info.id, memory_snapshot=True)
    assert paused.state == "paused" and not _vmm_procs()
    got = await n.sandbox_resume(info.id)
    assert got.state == "running" and len(_vmm_procs()) == 1
    img = _png(await n.desktop_screenshot(info.id))
    assert (img.width, img.height) == (W, H) and len(img.colors()) > 2
    await n.desktop_input(info.id, DesktopInput(action="type", text="echo back > /tmp/back\n"))
    assert await _wait_file(n, info.id, "/tmp/back") == b"back\n"


@pytest.mark.heavy
async def test_snapshot_to_a_layer_then_container_and_vm(desk):  # type: ignore[no-untyped-def]
    """snapshot() of a desktop VM (the microVM engine's path: the guest freezes its own
    processes, X session included, and streams its overlay upper dir out; sockets such as
    X's are left out): a new store layer from which a container and a headless full VM
    both see the files, the owner and mode, and an image file deleted (a whiteout); the
    desktop runs on after."""
    from corral.spec import ExecRequest, Limits, SandboxSpec

    n, info, _ = desk
    changes = (
        "mkdir -p /srv/snap && echo one > /srv/snap/f && chown 1000:1000 /srv/snap/f"
        " && chmod 640 /srv/snap/f && rm /etc/issue.net && echo ok"
    )
    listing = "cat /srv/snap/f; stat -c '%u %a' /srv/snap/f; test -e /etc/issue.net || echo gone"
    want = b"one\n1000 640\ngone\n"
    r = await n.exec(info.id, ExecRequest(cmd=["sh", "-c", changes]))
    assert r.stdout == b"ok\n", r
    snap = await n.sandbox_snapshot(info.id, name="desktest/snap:one")
    assert snap.layers[:-1] == info.layers and len(snap.layers) == len(info.layers) + 1
    assert n.store.layer(snap.layers[-1]).source == info.id
    vm = SandboxSpec(
        image=snap.name,
        backend="vm",
        limits=Limits(cpus=1, memory="512MiB", disk="512MiB"),
        qos="latency",
    )
    for spec in (SandboxSpec(image=snap.name), vm):
        copy = await n.sandbox_create(spec)
        try:
            r = await n.exec(copy.id, ExecRequest(cmd=["sh", "-c", listing]))
            assert r.stdout == want, (spec.backend, r)
        finally:
            await n.sandbox_destroy(copy.id)
    assert len(_vmm_procs()) == 1
    _png(await n.desktop_screenshot(info.id))


async def _screen_changes(n, sid: str, before: bytes, timeout: float = 60.0) -> bytes:  # type: ignore[no-untyped-def]
    """The next screenshot that differs from ``before`` (the guest redraws on its own time)."""
    deadline = time.monotonic() + timeout
    while True:
        now = await n.desktop_screenshot(sid)
        if _png(now).rgb != _png(before).rgb:
            return now
        assert time.monotonic() < deadline, "the screen did not change"
        await asyncio.sleep(0.2)


async def _sh(n, sid: str, script: str) -> bytes:  # type: ignore[no-untyped-def]
    """``script`` run in the guest against its X display; stdout."""
    from corral.spec import ExecRequest

    r = await n.exec(sid, ExecRequest(cmd=["sh", "-c", script], env={"DISPLAY": ":0"}))
    assert r.exit_code == 0, r
    return r.stdout


@pytest.mark.heavy
async def test_typing_into_the_terminal(desk):  # type: ignore[no-untyped-def]
    """Keys typed on the desktop reach the terminal (focused when create returned) and
    run as a shell command: its file appears, and the screen changed."""
    from corral.spec import DesktopInput

    n, info, _ = desk
    before = await n.desktop_screenshot(info.id)
    await n.desktop_input(info.id, DesktopInput(action="type", text="echo hi > /tmp/typed\n"))
    assert await _wait_file(n, info.id, "/tmp/typed") == b"hi\n"
    await _screen_changes(n, info.id, before)
    # a combo and shifted characters: ctrl+u drops a half-typed line
    await n.desktop_input(info.id, DesktopInput(action="type", text="junk"))
    await n.desktop_input(info.id, DesktopInput(action="key", keys="ctrl+u"))
    await n.desktop_input(info.id, DesktopInput(action="type", text='echo "A_B:~|" > /tmp/t2\n'))
    assert await _wait_file(n, info.id, "/tmp/t2") == b"A_B:~|\n"


@pytest.mark.heavy
async def test_pointer_moves_where_asked(desk):  # type: ignore[no-untyped-def]
    """The absolute pointer lands on the pixel asked for (X's own pointer query)."""
    from corral.spec import DesktopInput

    n, info, _ = desk
    for x, y in ((10, 20), (W - 1, H - 1), (500, 300)):
        await n.desktop_input(info.id, DesktopInput(action="move", x=x, y=y))
        got = await _sh(n, info.id, f"python3 -c '{_POINTER}'")
        assert got.split() == [str(x).encode(), str(y).encode()], got
    await n.desktop_input(info.id, DesktopInput(action="scroll", x=500, y=300, dy=2, dx=-1))


@pytest.mark.heavy
async def test_click_opens_the_menu_and_drag_moves_the_window(desk):  # type: ignore[no-untyped-def]
    """A right click on the desktop opens the window manager's menu (the screen changes
    there), esc closes it; dragging the terminal's title bar moves the window."""
    from corral.spec import DesktopInput

    n, info, _ = desk
    before = await n.desktop_screenshot(info.id)
    await n.desktop_input(info.id, DesktopInput(action="click", x=800, y=600, button="right"))
    await _screen_changes(n, info.id, before)
    await n.desktop_input(info.id, DesktopInput(action="key", keys="esc"))
    where = "xwininfo -name bash | grep Absolute | awk '{print $4}'"
    x0, y0 = map(int, (await _sh(n, info.id, where)).split())
    # the title bar: just above the client window, which sits inside the frame
    await n.desktop_input(
        info.id, DesktopInput(action="drag", x=x0 + 150, y=y0 - 10, to_x=x0 + 250, to_y=y0 + 90)
    )
    deadline = time.monotonic() + 60
    while (got := tuple(map(int, (await _sh(n, info.id, where)).split()))) == (x0, y0):
        assert time.monotonic() < deadline, "the window did not move"
        await asyncio.sleep(0.2)
    assert got == (x0 + 100, y0 + 100), (x0, y0, got)


_POINTER = (
    "import ctypes as c, ctypes.util as u;"
    'x = c.cdll.LoadLibrary(u.find_library("X11"));'
    "x.XOpenDisplay.restype = c.c_void_p;"
    "d = c.c_void_p(x.XOpenDisplay(None));"
    "r = c.c_ulong(x.XDefaultRootWindow(d));"
    "v = [c.c_ulong(), c.c_ulong(), c.c_int(), c.c_int(), c.c_int(), c.c_int(), c.c_uint()];"
    "x.XQueryPointer(d, r, *map(c.byref, v));"
    "print(v[2].value, v[3].value)"
)


@pytest.mark.heavy
async def test_browser_shows_a_page(desk):  # type: ignore[no-untyped-def]
    """The image's browser (dillo), started from the terminal by typed keys, renders a
    local page: its magenta background appears on the screen."""
    from corral.spec import DesktopInput

    n, info, _ = desk
    await n.file_write(info.id, "/tmp/page.html", b'<body bgcolor="#ff00ff"><h1>corral</h1>')
    await n.desktop_input(info.id, DesktopInput(action="click", x=300, y=300))  # the xterm
    await n.desktop_input(info.id, DesktopInput(action="type", text="dillo /tmp/page.html &\n"))
    deadline = time.monotonic() + 180
    while _png(await n.desktop_screenshot(info.id)).colors()[(255, 0, 255)] < 10000:
        assert time.monotonic() < deadline, "no magenta page on the screen"
        await asyncio.sleep(0.5)


@pytest.mark.heavy
async def test_desktop_on_an_image_without_x_is_a_clear_error(desk):  # type: ignore[no-untyped-def]
    """A desktop asked of an image without Xorg: the create fails naming what is missing,
    the VM is gone, the node serves on (the module's desktop still answers)."""
    from corral.errors import CorralError
    from corral.spec import Desktop, Limits, SandboxSpec

    n, info, _ = desk
    spec = SandboxSpec(
        image="test/busybox",
        backend="vm",
        desktop=Desktop(width=800, height=600),
        limits=Limits(cpus=1, memory="512MiB", disk="256MiB"),
        qos="latency",
    )
    with pytest.raises(CorralError, match="desktop did not start.*no Xorg in the image"):
        await n.sandbox_create(spec)
    assert [i.id for i in await n.sandbox_list()] == [info.id]
    assert len(_vmm_procs()) == 1
    _png(await n.desktop_screenshot(info.id))


async def test_desktop_on_a_container_is_refused(node):  # type: ignore[no-untyped-def]
    from corral.errors import InvalidRequest
    from corral.spec import Desktop, SandboxSpec

    with pytest.raises(InvalidRequest, match="only the 'vm' backend has a display"):
        await node.sandbox_create(SandboxSpec(image="test/busybox", desktop=Desktop()))
    assert await node.sandbox_list() == []


@pytest.mark.heavy
def test_bench_desktop_keys(images_ready):  # type: ignore[no-untyped-def]
    """``corral bench desktop --json`` runs end to end and leaves nothing behind."""
    image = _ensure_desktop_image()
    state, run, sub = Path(f"{STATE}b"), Path(f"{RUN}b"), SUBTREE + "b"
    out = run_bench(
        "desktop", "--count", "1", "--width", "800", "--height", "600",
        "--kernel-dir", str(KERNEL),
        state=state, run=run, subtree=sub, store=TEST_STORE, image=image, timeout=900,
    )  # fmt: skip
    assert out["scenario"] == "desktop" and out["accel"] in ("kvm", "tcg")
    assert out["size"] == "800x600" and out["screenshot_bytes"] > 0
    assert out["boot_to_screenshot_ms"]["p50"] > 0 and out["type_to_file_ms_p50"] > 0
    assert out["screenshot_ms_p50"] > 0 and out["input_ms_p50"] > 0
    assert out["host_mem_per_vm_mib"] > 0
    assert_no_leaks(state, run, sub)
    shutil.rmtree(state)
    shutil.rmtree(run, ignore_errors=True)
