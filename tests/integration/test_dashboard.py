"""The dashboard in a real browser: Debian's headless Chromium driven by playwright's
Python API (never ``playwright install``: the system browser is used).

The node is an ObservedFakeNode behind a unix socket, the browser reaches it through
``corral ui``'s proxy exactly as a user would (one-time token, cookie). Screenshots go
to ``$CORRAL_TEST_ARTIFACTS`` (default /tmp/corral-test-artifacts).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral.api.ui_proxy import UIProxy
from corral.sdk._http import HTTPOps
from corral.spec import ExecRequest, SandboxSpec
from tests.observe_fakes import ObservedFakeNode, observed_app, serve, uds_socket

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("CORRAL_TEST_ARTIFACTS", "/tmp/corral-test-artifacts"))

playwright_api = pytest.importorskip("playwright.async_api")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium")

_ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]


@pytest.fixture
async def browser_context() -> AsyncIterator[object]:
    profile = Path(tempfile.mkdtemp(prefix="corral-chromium-"))
    try:
        async with playwright_api.async_playwright() as pw:
            ctx = await pw.chromium.launch_persistent_context(
                str(profile),
                executable_path=str(CHROMIUM),
                headless=True,
                args=_ARGS,
                viewport={"width": 1400, "height": 1500},
            )
            try:
                yield ctx
            finally:
                await ctx.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


async def test_dashboard_in_chromium(browser_context: object) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="corral-ui-", dir="/tmp"))
    node = ObservedFakeNode(work)
    sock_path = work / "api.sock"
    try:
        async with serve(observed_app(node), uds_socket(sock_path)):
            ops = HTTPOps(f"unix://{sock_path}")
            made = []
            for job in ("rl-a", "rl-a", "rl-b"):
                info = await ops.sandbox_create(
                    SandboxSpec(image="demo/python", labels={"job": job}, qos="latency")
                )
                made.append(info.id)
                await ops.exec(info.id, ExecRequest(cmd=["echo", "hi"]))
            async with UIProxy(f"unix://{sock_path}") as proxy:
                page = await browser_context.new_page()  # type: ignore[attr-defined]
                problems: list[str] = []
                page.on(
                    "console",
                    lambda m: problems.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning")
                    else None,
                )
                page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
                await page.goto(proxy.login_url)
                assert page.url.endswith("/ui")
                rows = page.locator("#sandboxes tbody tr")
                await playwright_api.expect(rows).to_have_count(3)
                for sid in made:
                    await playwright_api.expect(
                        page.locator(f"tr[data-id='{sid}']")
                    ).to_be_visible()
                await playwright_api.expect(page.locator("#live")).to_have_text("live")
                await playwright_api.expect(page.locator("#c-sandboxes")).to_have_text("3")
                await playwright_api.expect(page.locator("#stats tbody")).to_contain_text("create")
                await page.screenshot(path=str(ARTIFACTS / "dashboard-all.png"), full_page=True)

                # a label filter
                await page.fill("#f-label", "job=rl-a")
                await page.click("#filters button[type=submit]")
                await playwright_api.expect(rows).to_have_count(2)
                await playwright_api.expect(page.locator("#stats-for")).to_have_text("(job=rl-a)")
                await playwright_api.expect(page.locator("#stats-events")).to_contain_text(
                    "2 sandboxes"
                )
                assert made[2] not in await page.locator("#sandboxes tbody").inner_text()

                # a security event raised now reaches the live feed
                node.record_event(made[0], "seccomp", syscall="bpf", count=1)
                item = page.locator("#feed li[data-kind='seccomp']")
                await playwright_api.expect(item).to_have_count(1)
                await playwright_api.expect(item).to_contain_text(made[0])
                await playwright_api.expect(item).to_contain_text("syscall=bpf")

                # one sandbox's timeline
                await page.click(f"tr[data-id='{made[0]}']")
                tl = page.locator("#timeline li")
                await playwright_api.expect(page.locator("#timeline-box")).to_be_visible()
                await playwright_api.expect(tl.first).to_contain_text("create")
                await playwright_api.expect(page.locator("#timeline")).to_contain_text("seccomp")
                await page.screenshot(
                    path=str(ARTIFACTS / "dashboard-filtered.png"), full_page=True
                )
                await page.close()
                assert problems == []
            await ops.close()
    finally:
        await node.close()
        shutil.rmtree(work, ignore_errors=True)
