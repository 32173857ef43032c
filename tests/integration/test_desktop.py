"""The full-VM desktop backend (``backend="vm"``) on a real node: QEMU q35 under TCG,
the generic Debian kernel, corral-init as PID 1, an X session with a terminal, QMP
screenshots and input. One desktop VM for the module (a TCG desktop boot takes a minute
or more on a busy host: heavy). The kernel is fetched once into /var/cache, the desktop
image built once into the test store (``build_debian(..., DESKTOP_PACKAGES)``)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.conftest import TAG, TEST_STORE
from tests.integration import pngread
from tests.integration.conftest import assert_no_leaks, node_config, open_node

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs QEMU"),
    pytest.mark.skipif(not Path("/bin/busybox").exists(), reason="needs busybox-static"),
]

STATE = Path(f"/var/lib/corral-test{TAG}-desk")
RUN = Path(f"/run/corral-test{TAG}-desk")
SUBTREE = f"corral-test{TAG}-desk"
KERNEL = Path("/var/cache/corral-test-desktop/kernel")
W, H = 1024, 768


def _ensure_desktop_image() -> None:
    from corral.images import build
    from corral.images.store import LayerStore

    store = LayerStore(TEST_STORE)
    if "test/desktop" not in {i.name for i in store.images()}:
        layer = build.build_debian(store, "bookworm", include=["python3", *build.DESKTOP_PACKAGES])
        store.put_image("test/desktop", [layer.digest])


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
async def desk(images_ready):  # type: ignore[no-untyped-def]
    """(node, sandbox info, seconds from create to the first screenshot)."""
    from corral.backends.config import ContainerConfig, VMConfig
    from corral.spec import Desktop, Limits, SandboxSpec

    _ensure_desktop_image()
    cfg = node_config(
        state_dir=STATE,
        run_dir=RUN,
        cgroup_subtree=SUBTREE,
        backends=[ContainerConfig(), VMConfig(kernel_dir=KERNEL)],
    )
    async with open_node(cfg) as n:
        spec = SandboxSpec(
            image="test/desktop",
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
        await __import__("asyncio").sleep(0.2)


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
async def test_typing_into_the_terminal(desk):  # type: ignore[no-untyped-def]
    """Keys typed into the xterm run as a shell command: its file appears, and the
    screen changed."""
    from corral.spec import DesktopInput

    n, info, _ = desk
    before = await n.desktop_screenshot(info.id)
    # the pointer over the terminal (at +40+40): it has the keyboard focus
    await n.desktop_input(info.id, DesktopInput(action="click", x=200, y=150))
    await n.desktop_input(info.id, DesktopInput(action="type", text="echo hi > /tmp/typed\n"))
    assert await _wait_file(n, info.id, "/tmp/typed") == b"hi\n"
    after = await n.desktop_screenshot(info.id)
    assert _png(after).rgb != _png(before).rgb
    # a combo and shifted characters: ctrl+u clears a half-typed line
    await n.desktop_input(info.id, DesktopInput(action="type", text="junk"))
    await n.desktop_input(info.id, DesktopInput(action="key", keys="ctrl+u"))
    await n.desktop_input(info.id, DesktopInput(action="type", text='echo "A_B:~|" > /tmp/t2\n'))
    assert await _wait_file(n, info.id, "/tmp/t2") == b"A_B:~|\n"


@pytest.mark.heavy
async def test_pointer_moves_and_clicks(desk):  # type: ignore[no-untyped-def]
    """The absolute pointer lands where asked: X reports the position (xdotool-free:
    xterm's child reads it with xwininfo... here with a query through the agent)."""
    from corral.spec import DesktopInput, ExecRequest

    n, info, _ = desk
    for x, y in ((10, 20), (W - 1, H - 1), (500, 300)):
        await n.desktop_input(info.id, DesktopInput(action="move", x=x, y=y))
        r = await n.exec(
            info.id,
            ExecRequest(cmd=["python3", "-c", _POINTER], env={"DISPLAY": ":0"}),
        )
        assert r.exit_code == 0, r
        assert r.stdout.split() == [str(x).encode(), str(y).encode()], r.stdout
    await n.desktop_input(info.id, DesktopInput(action="scroll", x=500, y=300, dy=2))
    await n.desktop_input(
        info.id, DesktopInput(action="drag", x=100, y=100, to_x=120, to_y=110, button="left")
    )
    await n.desktop_input(info.id, DesktopInput(action="click", x=5, y=5, button="right"))
    await n.desktop_input(info.id, DesktopInput(action="key", keys="esc"))


_POINTER = """
import ctypes, ctypes.util
x11 = ctypes.cdll.LoadLibrary(ctypes.util.find_library("X11"))
x11.XOpenDisplay.restype = ctypes.c_void_p
d = x11.XOpenDisplay(None)
assert d, "no display"
root = x11.XDefaultRootWindow(ctypes.c_void_p(d))
w = ctypes.c_ulong(); c = ctypes.c_ulong()
rx, ry, wx, wy = (ctypes.c_int() for _ in range(4)); m = ctypes.c_uint()
x11.XQueryPointer(ctypes.c_void_p(d), ctypes.c_ulong(root), ctypes.byref(w), ctypes.byref(c),
    ctypes.byref(rx), ctypes.byref(ry), ctypes.byref(wx), ctypes.byref(wy), ctypes.byref(m))
print(rx.value, ry.value)
"""


async def test_desktop_on_a_container_is_refused(node):  # type: ignore[no-untyped-def]
    from corral.errors import InvalidRequest
    from corral.spec import Desktop, SandboxSpec

    with pytest.raises(InvalidRequest, match="only the 'vm' backend has a display"):
        await node.sandbox_create(SandboxSpec(image="test/busybox", desktop=Desktop()))
    assert await node.sandbox_list() == []
