"""SWE-ReX's own client (swe-rex 1.4.0 ``RemoteRuntime``) on a corral sandbox through
``CorralDeployment``: a bash session keeps cwd, variables and functions; a command with a
timeout; files read and written; the sandbox is gone after ``stop``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral.api.server import NodeServer
from corral.host import leaks
from tests.conftest import TAG, TEST_STORE
from tests.integration.conftest import open_node

pytest.importorskip("swerex", reason="needs the swerex extra: pip install 'corral[swerex]'")
from swerex.exceptions import CommandTimeoutError  # noqa: E402
from swerex.runtime.abstract import (  # noqa: E402
    BashAction,
    BashInterruptAction,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    WriteFileRequest,
)

from corral.integrations.swerex import CorralDeployment, ensure_image  # noqa: E402

STATE = Path(f"/var/lib/corral-test{TAG}-swerex")
RUN = Path(f"/run/corral-test{TAG}-swerex")
SUBTREE = f"corral-test{TAG}-swerex"
TOKEN = "swerex-test-token"
IMAGE = "test/swerex"


@pytest.fixture(scope="module")
async def address(images_ready: None) -> AsyncIterator[str]:
    from corral.images.store import LayerStore

    ensure_image(LayerStore(TEST_STORE), base="test/debian", name=IMAGE)  # cached after once
    async with open_node(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE, gc=True) as node:
        async with NodeServer(node, host="127.0.0.1", port=0, token=TOKEN) as srv:
            yield srv.address
    found = leaks.scan(STATE, RUN, SUBTREE, netns_prefix=SUBTREE)
    assert leaks.total(found) == 0, found


@pytest.fixture(scope="module")
async def deployment(address: str) -> AsyncIterator[CorralDeployment]:
    d = CorralDeployment(node=address, token=TOKEN, image=IMAGE)
    await d.start()
    try:
        yield d
    finally:
        await d.stop()


async def test_session_keeps_state(deployment: CorralDeployment) -> None:
    rt = deployment.runtime
    assert await deployment.is_alive()
    await rt.create_session(CreateBashSessionRequest(session="s1"))
    await rt.run_in_session(BashAction(session="s1", command="mkdir -p /tmp/d && cd /tmp/d"))
    await rt.run_in_session(BashAction(session="s1", command="x=41; f() { echo $((x+1)); }"))
    obs = await rt.run_in_session(BashAction(session="s1", command="pwd; f"))
    assert obs.output.split() == ["/tmp/d", "42"]
    assert obs.exit_code == 0
    obs = await rt.run_in_session(BashAction(session="s1", command="false", check="silent"))
    assert obs.exit_code == 1


async def test_command_timeout_then_session_goes_on(deployment: CorralDeployment) -> None:
    rt = deployment.runtime
    await rt.create_session(CreateBashSessionRequest(session="s2"))
    await rt.run_in_session(BashAction(session="s2", command="cd /tmp; y=7"))
    with pytest.raises(CommandTimeoutError):
        await rt.run_in_session(BashAction(session="s2", command="sleep 60", timeout=1))
    await rt.run_in_session(BashInterruptAction(session="s2"))
    obs = await rt.run_in_session(BashAction(session="s2", command="echo $y $PWD"))
    assert obs.output.strip() == "7 /tmp"
    # a one-off command, outside any session
    r = await rt.execute(Command(command=["python3", "-c", "print(6*7)"], timeout=30))
    assert (r.exit_code, r.stdout) == (0, "42\n")


async def test_files(deployment: CorralDeployment) -> None:
    rt = deployment.runtime
    await rt.write_file(WriteFileRequest(path="/tmp/rex/a.txt", content="héllo\nworld\n"))
    got = await rt.read_file(ReadFileRequest(path="/tmp/rex/a.txt"))
    assert got.content == "héllo\nworld\n"
    # the same file through corral's own SDK: one sandbox, two APIs
    assert deployment.sandbox is not None
    assert await deployment.sandbox.files.read("/tmp/rex/a.txt") == "héllo\nworld\n".encode()


async def test_stop_destroys_the_sandbox(address: str) -> None:
    import corral

    d = CorralDeployment(node=address, token=TOKEN, image=IMAGE)
    await d.start()
    assert d.sandbox is not None
    sid = d.sandbox.id
    await d.stop()
    await d.stop()  # twice is fine
    async with corral.AsyncClient(address, token=TOKEN) as c:
        assert sid not in [s.id for s in await c.sandboxes.list()]
