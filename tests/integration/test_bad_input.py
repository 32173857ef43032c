"""Bad input through the real HTTP app on a real node: a clear 4xx and nothing else.

Every request here is wrong in one way (a field, an id, a size, a path, the body itself).
Each must get an HTTP 4xx whose body is ``{"error": {"kind", "message"}}`` with a message
naming what was wrong, and must change nothing: after every one, a bystander sandbox still
answers ``echo ok``, its files are as they were, and the node has as many sandboxes as
before. Requests go raw through httpx (not the SDK), so malformed bodies can be sent.
"""

from __future__ import annotations

import base64
import io
import os
import secrets
import shutil
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import TAG
from tests.integration.conftest import open_node

STATE = Path(f"/var/lib/corral-test{TAG}-bad")
RUN = Path(f"/run/corral-test{TAG}-bad")
SUBTREE = f"corral-test{TAG}-bad"

LIMITS = {"cpus": 1, "memory": "128MiB", "pids": 64, "disk": "64MiB"}
GOOD_SPEC: dict[str, Any] = {"image": "test/busybox", "limits": LIMITS}
KEEP = {"/work/keep.txt": b"bystander data\n", "/etc/keep.conf": b"k=v\n"}
NOBODY = "sb-000000000000"
"""A well-formed sandbox id that no node ever handed out."""


class World:
    """The node, its API, the bystander and the sandbox the bad requests aim at."""

    def __init__(self, node: Any, api: httpx.AsyncClient) -> None:
        self.node = node
        self.api = api
        self.bystander = ""
        self.target = ""
        self.snapshot = ""

    def url(self, sid: str | None = None) -> str:
        return f"/v1/sandboxes/{sid or self.target}"

    async def exec(self, sid: str, cmd: list[str]) -> dict[str, Any]:
        r = await self.api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout": 30})
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    async def files_of(self, sid: str) -> str:
        """Every path of the sandbox's root with its size, plus the content of KEEP."""
        out = await self.exec(
            sid,
            [
                "sh",
                "-c",
                "busybox find / -xdev -exec busybox stat "
                "-c '%n %s %a' {} + | busybox sort; cat /work/keep.txt",
            ],
        )
        assert out["reason"] == "exited" and out["exit_code"] == 0, out
        return base64.b64decode(out["stdout"]).decode()

    async def unharmed(self) -> None:
        """The bystander is fine and the node holds exactly the two sandboxes."""
        out = await self.exec(self.bystander, ["echo", "ok"])
        assert (out["exit_code"], base64.b64decode(out["stdout"])) == (0, b"ok\n"), out
        for path, data in KEEP.items():
            r = await self.api.get(self.url(self.bystander) + "/files", params={"path": path})
            assert (r.status_code, r.content) == (200, data)
        assert await self.files_of(self.bystander) == self.snapshot
        r = await self.api.get("/v1/node")
        assert r.status_code == 200 and r.json()["sandboxes"] == 2, r.text
        r = await self.api.get("/v1/sandboxes")
        ids = {s["id"]: s["state"] for s in r.json()}
        assert ids == {self.bystander: "running", self.target: "running"}

    async def bad(
        self,
        method: str,
        url: str,
        status: int | tuple[int, ...],
        *names: str,
        kind: str | None = None,
        api: httpx.AsyncClient | None = None,
        **kw: Any,
    ) -> dict[str, str]:
        """Send one bad request; check status, error body, that the message names every
        one of ``names``, and that nothing else changed."""
        r = await (api or self.api).request(method, url, **kw)
        if method == "POST" and url == "/v1/sandboxes" and r.status_code == 201:
            await self.api.delete(self.url(r.json()["id"]))  # so one miss fails one test
        want = status if isinstance(status, tuple) else (status,)
        assert r.status_code in want, f"{method} {url}: {r.status_code} {r.text[:500]}"
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == {"kind", "message"}, body
        err: dict[str, str] = body["error"]
        for name in names:
            assert name.lower() in err["message"].lower(), (name, err)
        if kind is not None:
            assert err["kind"] == kind, err
        assert "/var/lib/corral-test-bad" not in err["message"], err  # no host paths
        await self.unharmed()
        return err


@pytest.fixture(scope="module")
async def world(images_ready) -> AsyncIterator[World]:  # type: ignore[no-untyped-def]
    from corral.api.app import create_app

    async with open_node(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE) as node:
        transport = httpx.ASGITransport(app=create_app(node))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://corral.test", timeout=120
        ) as api:
            w = World(node, api)
            for attr in ("bystander", "target"):
                r = await api.post("/v1/sandboxes", json=GOOD_SPEC)
                assert r.status_code == 201, r.text
                setattr(w, attr, r.json()["id"])
            for path, data in KEEP.items():
                r = await api.put(
                    w.url(w.bystander) + "/files", params={"path": path}, content=data
                )
                assert r.status_code == 204, r.text
            w.snapshot = await w.files_of(w.bystander)
            await w.unharmed()
            yield w
            await _node_fine_after_all(w)
    _nothing_left()


# ----------------------------------------------------------------------- create
def _spec(**kw: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"image": "test/busybox", "limits": dict(LIMITS)}
    for k, v in kw.items():
        if k.startswith("limits_"):
            spec["limits"][k.removeprefix("limits_")] = v
        else:
            spec[k] = v
    return spec


BAD_SPECS = [
    pytest.param(_spec(image="test/no-such-image"), 404, ["test/no-such-image"], id="image"),
    pytest.param(_spec(image=""), 422, ["image"], id="image-empty"),
    pytest.param(_spec(limits_memory="lots"), 422, ["limits.memory", "lots"], id="mem-lots"),
    pytest.param(_spec(limits_memory=-1), 422, ["limits.memory"], id="mem-negative"),
    pytest.param(_spec(limits_memory="-5MiB"), 422, ["limits.memory"], id="mem-neg-str"),
    pytest.param(_spec(limits_memory=10**30), (400, 422), ["limits.memory"], id="mem-huge"),
    pytest.param(_spec(limits_memory="100PiB"), 422, ["limits.memory"], id="mem-unit"),
    pytest.param(_spec(limits_memory="1000TiB"), (400, 422), ["limits.memory"], id="mem-tib"),
    pytest.param(_spec(limits_memory=True), 422, ["limits.memory"], id="mem-bool"),
    pytest.param(_spec(limits_cpus=0), 422, ["limits.cpus"], id="cpus-0"),
    pytest.param(_spec(limits_cpus=1000), 422, ["limits.cpus"], id="cpus-1000"),
    pytest.param(_spec(limits_cpus="NaN"), 422, ["limits.cpus"], id="cpus-nan"),
    pytest.param(_spec(limits_pids=1), 422, ["limits.pids"], id="pids-1"),
    pytest.param(_spec(limits_disk="abc"), 422, ["limits.disk", "abc"], id="disk-abc"),
    pytest.param(_spec(limits_disk=10**30), (400, 422), ["limits.disk"], id="disk-huge"),
    pytest.param(_spec(limits_output=10), 422, ["limits.output"], id="output-small"),
    pytest.param(_spec(colour="blue"), 422, ["colour"], id="extra-field"),
    pytest.param(_spec(limits_swap="1G"), 422, ["limits.swap"], id="extra-limit"),
    pytest.param(_spec(labels={"bad key!": "v"}), 422, ["labels", "bad key!"], id="label-key"),
    pytest.param(_spec(labels={"": "v"}), 422, ["labels"], id="label-empty"),
    pytest.param(_spec(labels={"k": "v" * 300}), 422, ["labels", "k"], id="label-value"),
    pytest.param(_spec(labels={"k": 1}), 422, ["labels.k"], id="label-int"),
    pytest.param(_spec(env={"A=B": "1"}), 422, ["env", "A=B"], id="env-eq"),
    pytest.param(_spec(env={"A": "x\0y"}), 422, ["env"], id="env-nul"),
    pytest.param(_spec(env={"": "1"}), 422, ["env"], id="env-empty"),
    pytest.param(_spec(workdir="work"), 422, ["workdir"], id="workdir-rel"),
    pytest.param(_spec(workdir="/wo\0rk"), 422, ["workdir"], id="workdir-nul"),
    pytest.param(_spec(hostname="-bad"), 422, ["hostname"], id="host-dash"),
    pytest.param(_spec(hostname="a b"), 422, ["hostname"], id="host-space"),
    pytest.param(_spec(hostname="h" * 100), 422, ["hostname"], id="host-long"),
    pytest.param(_spec(ttl=-1), 422, ["ttl"], id="ttl-negative"),
    pytest.param(_spec(idle_timeout=0), 422, ["idle_timeout"], id="idle-zero"),
    pytest.param({"limits": LIMITS}, 422, ["image"], id="no-image"),
    pytest.param(
        _spec(image="../../etc/passwd"), (400, 404, 422), ["../../etc/passwd"], id="image-traversal"
    ),
    pytest.param(_spec(image="sha256:zz"), (400, 422), ["sha256:zz"], id="image-bad-digest"),
    pytest.param(
        _spec(image="sha256:" + "0" * 64), 404, ["sha256:" + "0" * 64], id="image-unknown-digest"
    ),
    pytest.param(_spec(image="x" * 301), 422, ["image"], id="image-long"),
]


@pytest.mark.parametrize(("spec", "status", "names"), BAD_SPECS)
async def test_bad_spec(world: World, spec: dict[str, Any], status: Any, names: list[str]):
    await world.bad("POST", "/v1/sandboxes", status, *names, json=spec)


@pytest.mark.parametrize(
    ("content", "names"),
    [
        pytest.param(b"{not json", ["not valid json"], id="not-json"),
        pytest.param(b"[1, 2]", ["body"], id="array"),
        pytest.param(b'"image"', ["body"], id="string"),
        pytest.param(b"", ["body"], id="empty"),
        pytest.param(b"\xff\xfe\x00garbage", ["json"], id="binary"),
        pytest.param(b'{"image": "test/busybox", "limits": []}', ["limits"], id="limits-array"),
        pytest.param(b"{" * 10000, ["json"], id="deep"),
        pytest.param(
            b'{"image": "test/busybox", "labels": {"k": ' + b"[" * 5000 + b"]" * 5000 + b"}}",
            ["body"],
            id="deep-valid",
        ),
        pytest.param(
            b'{"image": "test/busybox", "limits": {"memory": 1e400}}',
            ["limits.memory"],
            id="mem-inf",
        ),
        pytest.param(
            b'{"image": "test/busybox", "limits": {"memory": NaN}}', ["limits.memory"], id="mem-nan"
        ),
        pytest.param(
            b'{"image": "test/busybox", "limits": {"disk": "' + b"9" * 400 + b'GiB"}}',
            ["limits.disk"],
            id="disk-digits",
        ),
        pytest.param(
            b'{"image": "test/busybox", "limits": {"cpus": 1e400}}', ["limits.cpus"], id="cpus-inf"
        ),
        pytest.param(b'{"image": "test/busybox", "image": 5}', ["image"], id="dup-key"),
    ],
)
async def test_malformed_create_body(world: World, content: bytes, names: list[str]):
    headers = {"content-type": "application/json"}
    # FastAPI answers a body nested past Python's recursion limit with its own 400
    status = (400, 422) if b"[[[[" in content else 422
    await world.bad("POST", "/v1/sandboxes", status, *names, content=content, headers=headers)


# ----------------------------------------------------------------------- unknown ids
async def test_unknown_sandbox(world: World):
    for method, tail, kw in (
        ("GET", "", {}),
        ("DELETE", "", {}),
        ("POST", "/exec", {"json": {"cmd": ["true"]}}),
        ("POST", "/exec/stream", {"json": {"cmd": ["true"]}}),
        ("POST", "/processes", {"json": {"cmd": ["true"]}}),
        ("GET", "/processes", {}),
        ("POST", "/shells", {}),
        ("GET", "/files", {"params": {"path": "/etc/passwd"}}),
        ("PUT", "/files", {"params": {"path": "/x"}, "content": b"x"}),
        ("GET", "/files/list", {"params": {"path": "/"}}),
        ("GET", "/files/tar", {"params": {"path": "/"}}),
        ("GET", "/events", {}),
    ):
        await world.bad(method, world.url(NOBODY) + tail, 404, NOBODY, kind="SandboxNotFound", **kw)
    await world.bad("GET", "/v1/events", 404, NOBODY, params={"sandbox_id": NOBODY})


@pytest.mark.parametrize(
    "sid",
    [
        "..",
        "%2e%2e",
        "..%2f..",
        "%2e%2e%2f%2e%2e",
        "sb-" + "a" * 5000,
        "x" * 20000,
        "sb-%00",
        "sb-%0a",
        "%2f",
        "sb-AAAAAAAAAAAA",
    ],
)
async def test_sandbox_id_traversal(world: World, sid: str):
    """Ids that look like paths name no sandbox (and no route): 404, never a host dir."""
    for method, tail, kw in (
        ("GET", "", {}),
        ("POST", "/exec", {"json": {"cmd": ["true"]}}),
        ("GET", "/files", {"params": {"path": "/etc/passwd"}}),
        ("PUT", "/files", {"params": {"path": "/x"}, "content": b"x"}),
        ("DELETE", "", {}),
    ):
        err = await world.bad(method, f"/v1/sandboxes/{sid}{tail}", 404, **kw)
        assert len(err["message"]) < 1000, err  # a long id is not echoed whole
    assert not (STATE / "x").exists() and not Path("/var/lib/x").exists()


async def test_unknown_process_and_shell(world: World):
    u = world.url()
    await world.bad("GET", u + "/processes/p-nope", 404, "p-nope", kind="ProcessNotFound")
    await world.bad("POST", u + "/processes/p-nope/kill", 404, "p-nope", kind="ProcessNotFound")
    await world.bad(
        "POST",
        u + "/shells/sh-nope/run",
        404,
        "sh-nope",
        kind="ProcessNotFound",
        json={"command": "true"},
    )
    await world.bad("DELETE", u + "/shells/sh-nope", 404, "sh-nope", kind="ProcessNotFound")
    await world.bad("GET", u + "/processes/p-nope", 422, "wait", params={"wait": -1})


async def test_process_of_another_sandbox(world: World):
    """A process id is only valid in the sandbox that started it."""
    r = await world.api.post(world.url(world.target) + "/processes", json={"cmd": ["sleep", "30"]})
    assert r.status_code == 201, r.text
    pid = r.json()["id"]
    try:
        await world.bad("GET", world.url(world.bystander) + f"/processes/{pid}", 404, pid)
        await world.bad("POST", world.url(world.bystander) + f"/processes/{pid}/kill", 404, pid)
    finally:
        r = await world.api.post(world.url() + f"/processes/{pid}/kill")
        assert r.status_code == 204, r.text
        r = await world.api.get(world.url() + f"/processes/{pid}", params={"wait": 10})
        assert r.status_code == 200 and not r.json()["running"], r.text


@pytest.mark.parametrize("sig", ["999", "0", "-9", "abc", "65"])
async def test_kill_bad_signal(world: World, sig: str):
    await world.bad(
        "POST", world.url() + "/processes/p-nope/kill", 422, "signal", params={"signal": sig}
    )


# ----------------------------------------------------------------------- exec
BAD_EXECS = [
    pytest.param({"cmd": []}, 422, ["cmd"], id="cmd-empty"),
    pytest.param({"cmd": [""]}, 422, ["cmd"], id="cmd-empty-arg"),
    pytest.param({"cmd": ["echo", "a\0b"]}, 422, ["cmd", "nul"], id="cmd-nul"),
    pytest.param({"cmd": "echo hi"}, 422, ["cmd"], id="cmd-string"),
    pytest.param({"cmd": [1, 2]}, 422, ["cmd"], id="cmd-ints"),
    pytest.param({}, 422, ["cmd"], id="no-cmd"),
    pytest.param({"cmd": ["true"], "cwd": "tmp"}, 422, ["cwd"], id="cwd-relative"),
    pytest.param({"cmd": ["true"], "cwd": "/no/such/dir"}, (200, 400), [], id="cwd-missing"),
    pytest.param({"cmd": ["true"], "timeout": -1}, 422, ["timeout"], id="timeout-negative"),
    pytest.param({"cmd": ["true"], "timeout": 0}, 422, ["timeout"], id="timeout-zero"),
    pytest.param({"cmd": ["true"], "timeout": 1e12}, 422, ["timeout"], id="timeout-huge"),
    pytest.param(
        {"cmd": ["true"], "output_limit": 10**12}, 422, ["output_limit"], id="output-huge"
    ),
    pytest.param(
        {"cmd": ["true"], "output_limit": "2GiB"}, 422, ["output_limit"], id="output-2gib"
    ),
    pytest.param(
        {"cmd": ["true"], "output_limit": -1}, 422, ["output_limit"], id="output-negative"
    ),
    pytest.param(
        {"cmd": ["true"], "user": "nosuchuser"}, 400, ["user", "nosuchuser"], id="user-unknown"
    ),
    pytest.param(
        {"cmd": ["true"], "user": "root:nosuchgroup"}, 400, ["nosuchgroup"], id="group-unknown"
    ),
    pytest.param({"cmd": ["true"], "user": "99999999"}, 400, ["user"], id="uid-huge"),
    pytest.param({"cmd": ["true"], "user": "-1"}, 400, ["user"], id="uid-negative"),
    pytest.param({"cmd": ["true"], "env": {"A=B": "1"}}, 422, ["env"], id="env-eq"),
    pytest.param({"cmd": ["true"], "env": {"A": "\0"}}, 422, ["env"], id="env-nul"),
    pytest.param(
        {"cmd": ["true"], "stdin": "***not base64***"}, 422, ["stdin"], id="stdin-not-b64"
    ),
    pytest.param({"cmd": ["true"], "shell": True}, 422, ["shell"], id="extra-field"),
    pytest.param({"cmd": ["true"], "timeout": "inf"}, 422, ["timeout"], id="timeout-inf"),
    pytest.param(
        {"cmd": ["true"], "output_limit": "9" * 400}, 422, ["output_limit"], id="output-digits"
    ),
]


@pytest.mark.parametrize(("req", "status", "names"), BAD_EXECS)
@pytest.mark.parametrize("route", ["/exec", "/exec/stream", "/processes"])
async def test_bad_exec(
    world: World, route: str, req: dict[str, Any], status: Any, names: list[str]
):
    if req.get("cwd") == "/no/such/dir":
        # not a malformed request: the command fails to start inside, like a shell's cd
        r = await world.api.post(world.url() + route, json=req)
        assert r.status_code in (200, 201, 400), r.text
        await world.unharmed()
        return
    await world.bad("POST", world.url() + route, status, *names, json=req)


async def test_exec_malformed_body(world: World):
    h = {"content-type": "application/json"}
    for content in (b"nope", b"[]", b"", b'{"cmd": ["true"]'):
        await world.bad("POST", world.url() + "/exec", 422, "body", content=content, headers=h)
    await world.bad(
        "POST",
        world.url() + "/exec",
        422,
        "output_limit",
        headers=h,
        content=b'{"cmd": ["true"], "output_limit": 1e400}',
    )


@pytest.mark.parametrize("route", ["/exec", "/exec/stream"])
async def test_exec_huge_stdin(world: World, route: str):
    """50 MB of stdin is refused with a 4xx or run to its end; the node stays up."""
    size = 50 << 20
    req = {"cmd": ["wc", "-c"], "stdin": base64.b64encode(b"\xa5" * size).decode(), "timeout": 120}
    r = await world.api.post(world.url() + route, json=req)
    if r.status_code == 200:
        if route == "/exec":
            out = r.json()
        else:
            import json

            out = json.loads(r.text.splitlines()[-1]).get("result")
            assert out is not None, r.text[-500:]
            chunks = [json.loads(ln) for ln in r.text.splitlines()[:-1]]
            out["stdout"] = base64.b64encode(
                b"".join(base64.b64decode(c["data"]) for c in chunks if c["stream"] == "stdout")
            ).decode()
        assert out["exit_code"] == 0, out
        assert base64.b64decode(out["stdout"]).strip() == str(size).encode()
    else:
        assert 400 <= r.status_code < 500, r.text[:500]
        assert "stdin" in r.json()["error"]["message"].lower()
    await world.unharmed()


async def test_shell_bad(world: World):
    u = world.url()
    await world.bad("POST", u + "/shells", (400, 422), "cwd", json={"cwd": "relative"})
    await world.bad("POST", u + "/shells", (400, 422), "env", json={"env": {"A=B": "x"}})
    await world.bad("POST", u + "/shells", 422, "colour", json={"colour": 1})


# ----------------------------------------------------------------------- files
@pytest.mark.parametrize(
    ("path", "status", "names"),
    [
        pytest.param("etc/x", 400, ["etc/x", "absolute"], id="relative"),
        pytest.param("", 400, ["absolute"], id="empty"),
        pytest.param("/etc/x\0y", 400, ["nul"], id="nul"),
        pytest.param("/" + "a" * 5000, 400, ["longer than"], id="5000-chars"),
        pytest.param("/" + "b" * 300, 400, ["longer than 255"], id="long-name"),
        pytest.param("/", 400, ["/"], id="root"),
        pytest.param("/tmp/..", 400, [".."], id="dotdot-name"),
        pytest.param("/etc/", 400, ["/etc"], id="trailing-slash"),
    ],
)
async def test_bad_write_path(world: World, path: str, status: int, names: list[str]):
    await world.bad(
        "PUT", world.url() + "/files", status, *names, params={"path": path}, content=b"x"
    )


@pytest.mark.parametrize(
    ("path", "names"),
    [
        pytest.param("etc/passwd", ["etc/passwd"], id="relative"),
        pytest.param("/etc/pa\0sswd", ["nul"], id="nul"),
        pytest.param("/" + "a" * 5000, ["longer than"], id="5000-chars"),
    ],
)
@pytest.mark.parametrize("route", ["/files", "/files/list", "/files/stat", "/files/tar"])
async def test_bad_read_path(world: World, route: str, path: str, names: list[str]):
    await world.bad("GET", world.url() + route, 400, *names, params={"path": path})


async def test_missing_or_bad_query(world: World):
    u = world.url()
    await world.bad("GET", u + "/files", 422, "path")
    await world.bad("PUT", u + "/files", 422, "path", content=b"x")
    await world.bad(
        "GET", u + "/files", 422, "offset", params={"path": "/etc/passwd", "offset": -1}
    )
    await world.bad(
        "GET", u + "/files", 422, "length", params={"path": "/etc/passwd", "length": "lots"}
    )
    await world.bad(
        "PUT", u + "/files", 422, "mode", params={"path": "/tmp/m", "mode": 99999}, content=b"x"
    )
    await world.bad("POST", u + "/files/mkdir", 422, "mode", params={"path": "/tmp/m", "mode": -1})
    await world.bad("GET", "/v1/sandboxes", 400, "label", params={"label": "novalue"})
    await world.bad("GET", "/v1/events", 400, "after", params={"after": "12"})
    await world.bad("GET", "/v1/events", 400, "limit", params={"limit": 0})
    await world.bad("GET", u + "/events", 400, "after", params={"after": "c1.garbage!"})
    await world.bad("GET", u + "/files", 404, "/no/such", params={"path": "/no/such"})
    await world.bad("GET", u + "/files", 400, "/etc", params={"path": "/etc"})


async def test_bad_remove_and_mkdir(world: World):
    u = world.url()
    await world.bad("DELETE", u + "/files", 400, "/", params={"path": "/", "recursive": "true"})
    await world.bad("DELETE", u + "/files", 400, "..", params={"path": "/..", "recursive": "true"})
    await world.bad(
        "DELETE", u + "/files", 400, "..", params={"path": "/tmp/../..", "recursive": "true"}
    )
    await world.bad("DELETE", u + "/files", 400, "relative", params={"path": "relative"})
    await world.bad("DELETE", u + "/files", 404, "/no/such", params={"path": "/no/such"})
    await world.bad("DELETE", u + "/files", 400, "/etc", params={"path": "/etc"})
    await world.bad(
        "DELETE", u + "/files", 422, "recursive", params={"path": "/tmp/x", "recursive": "maybe"}
    )
    await world.bad("POST", u + "/files/mkdir", 400, "rel", params={"path": "rel/dir"})
    await world.bad("POST", u + "/files/mkdir", 400, "nul", params={"path": "/tmp/a\0b"})
    await world.bad(
        "POST",
        u + "/files/mkdir",
        404,
        "/no/such",
        params={"path": "/no/such/dir", "parents": "false"},
    )
    await world.bad(
        "POST", u + "/files/mkdir", (400, 409), "/etc/passwd", params={"path": "/etc/passwd/sub"}
    )


async def test_bad_image_requests(world: World):
    before = (await world.api.get("/v1/images")).json()
    await world.bad("GET", "/v1/images/no/such", 404, "no/such", kind="ImageNotFound")
    await world.bad("DELETE", "/v1/images/no/such", 404, "no/such", kind="ImageNotFound")
    await world.bad("GET", "/v1/images/..%2f..%2fetc%2fpasswd", (400, 404), "etc/passwd")
    await world.bad(
        "POST",
        "/v1/images",
        (400, 404, 422),
        "sha256:00",
        json={"name": "test/bad-compose", "layers": ["sha256:00"]},
    )
    await world.bad(
        "POST",
        "/v1/images",
        404,
        "sha256:" + "0" * 64,
        json={"name": "test/bad-compose", "layers": ["sha256:" + "0" * 64]},
    )
    await world.bad(
        "POST", "/v1/images", 422, "layers", json={"name": "test/bad-compose", "layers": []}
    )
    layer = before[0]["layers"][0]
    await world.bad(
        "POST", "/v1/images", (400, 422), "../x", json={"name": "../x", "layers": [layer]}
    )
    assert (await world.api.get("/v1/images")).json() == before


async def test_no_route_and_bad_method(world: World):
    await world.bad("GET", "/v1/nothing-here", 404, "/v1/nothing-here")
    await world.bad("PATCH", "/v1/sandboxes", 405, "PATCH")
    await world.bad("POST", world.url() + "/files/list", 405, "POST", params={"path": "/"})


async def test_dotdot_stays_inside(world: World):
    """``..`` and symlinks to ``/`` are clamped at the sandbox root: writes land in the
    sandbox's /etc, reads never see the host's files."""
    marker = f"corral-bad-{secrets.token_hex(4)}"
    host_marker = Path("/tmp") / marker
    host_marker.write_text("host secret\n")
    u = world.url()
    try:
        r = await world.exec(
            world.target,
            ["sh", "-c", "busybox ln -s / /tmp/hostroot && busybox ln -s ../../../../.. /tmp/up"],
        )
        assert r["exit_code"] == 0, r
        writes = [
            "/../../etc/" + marker,
            "/work/../../../etc/" + marker + "-b",
            "/tmp/hostroot/etc/" + marker + "-c",
            "/tmp/up/etc/" + marker + "-d",
            "/tmp/hostroot/../../etc/" + marker + "-e",
        ]
        for path in writes:
            r = await world.api.put(u + "/files", params={"path": path}, content=b"inside\n")
            assert r.status_code == 204, (path, r.text)
        for suffix in ("", "-b", "-c", "-d", "-e"):
            assert not Path("/etc", marker + suffix).exists(), "a host file was written"
            r = await world.exec(world.target, ["cat", f"/etc/{marker}{suffix}"])
            assert base64.b64decode(r["stdout"]) == b"inside\n", (suffix, r)
        for path in (
            f"/../../../tmp/{marker}",
            f"/tmp/hostroot/tmp/{marker}",
            f"/tmp/up/tmp/{marker}",
            "/../../proc/1/environ",
        ):
            # /proc: absent from a host-mounted overlay (404), or the guest's own /proc
            # mount, never crossed (400 PathRefused: the launcher's root, through its init).
            want = (400, 404) if "/proc/" in path else 404
            err = await world.bad("GET", u + "/files", want, params={"path": path})
            assert "host secret" not in err["message"]
        # the sandbox's /tmp/hostroot is a link, not the host root: listing it shows the
        # sandbox's own root
        r = await world.api.get(u + "/files/list", params={"path": "/tmp/hostroot/tmp"})
        assert r.status_code == 200 and marker not in r.text, r.text
        # append through a final symlink is refused rather than followed
        r = await world.exec(world.target, ["busybox", "ln", "-s", "/etc/passwd", "/tmp/pw"])
        await world.bad(
            "PUT",
            u + "/files",
            400,
            "/tmp/pw",
            kind="PathRefused",
            params={"path": "/tmp/pw", "append": "true"},
            content=b"evil\n",
        )
    finally:
        host_marker.unlink(missing_ok=True)
        await world.exec(
            world.target, ["sh", "-c", f"rm -f /etc/{marker}* /tmp/hostroot /tmp/up /tmp/pw"]
        )
    assert Path("/etc/passwd").read_bytes().find(b"evil") < 0


async def test_special_files_refused(world: World):
    """Reading a device node or a fifo in the sandbox's tree is refused, never opened (a
    fifo would block the node, a device could be a host disk)."""
    u = world.url()
    r = await world.exec(world.target, ["busybox", "mkfifo", "/tmp/fifo"])
    assert r["exit_code"] == 0, r
    # A device node as an image layer could carry it: made here through the host view
    # (the host mount, or, for a launched sandbox, its init's root).
    rootfs = world.node.backend.rootfs(world.target)
    if not rootfs.is_dir():
        rootfs = Path(f"/proc/{world.node.backend.init_pid(world.target)}/root")
    os.mknod(rootfs / "tmp" / "zero", 0o666 | 0o020000, os.makedev(1, 5))
    os.mknod(rootfs / "tmp" / "sda", 0o666 | 0o060000, os.makedev(8, 0))
    try:
        for name in ("fifo", "zero", "sda"):
            await world.bad(
                "GET",
                u + "/files",
                400,
                f"/tmp/{name}",
                kind="PathRefused",
                params={"path": f"/tmp/{name}"},
            )
            await world.bad(
                "PUT",
                u + "/files",
                400,
                f"/tmp/{name}",
                kind="PathRefused",
                params={"path": f"/tmp/{name}", "append": "true"},
                content=b"x",
            )
            await world.bad(
                "GET",
                u + "/files/tar",
                400,
                f"/tmp/{name}",
                kind="PathRefused",
                params={"path": f"/tmp/{name}"},
            )
        # a link to a device is followed inside the sandbox only, and still refused
        await world.exec(world.target, ["busybox", "ln", "-s", "/tmp/zero", "/tmp/zlink"])
        await world.bad(
            "GET",
            u + "/files",
            400,
            "/tmp/zlink",
            kind="PathRefused",
            params={"path": "/tmp/zlink"},
        )
        # /dev inside is the runtime's mount, not part of the tree the node reads
        await world.bad("GET", u + "/files", (400, 404), "/dev/zero", params={"path": "/dev/zero"})
    finally:
        await world.exec(
            world.target, ["rm", "-f", "/tmp/fifo", "/tmp/zero", "/tmp/sda", "/tmp/zlink"]
        )


def _tar(*members: tuple[str, bytes | None, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            if kind == tarfile.SYMTYPE:
                info.type, info.linkname = tarfile.SYMTYPE, data.decode()
                tf.addfile(info)
            elif kind is not None:
                info.type = kind
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize(
    ("data", "status", "names"),
    [
        pytest.param(b"this is not a tar archive\n" * 200, 400, ["tar"], id="garbage"),
        pytest.param(bytes(range(256)) * 64, 400, ["tar"], id="bytes"),
        pytest.param(b"\x1f\x8b\x08\x00garbage", 400, ["tar"], id="bad-gzip"),
        pytest.param(b"BZh9garbage", 400, ["tar"], id="bad-bzip2"),
        pytest.param(_tar(("ok", None, b"1"))[:700], 400, ["tar"], id="truncated"),
        pytest.param(_tar(("../escape", None, b"x")), 400, ["..", "escape"], id="dotdot"),
        pytest.param(_tar(("/abs", None, b"x")), 400, ["/abs"], id="absolute"),
        pytest.param(_tar(("dev", tarfile.CHRTYPE, b"")), 400, ["dev"], id="device"),
        pytest.param(_tar(("f", tarfile.FIFOTYPE, b"")), 400, ["f"], id="fifo"),
    ],
)
async def test_bad_tar_upload(world: World, data: bytes, status: int, names: list[str]):
    u = world.url()
    dest = f"/tmp/up-{secrets.token_hex(3)}"
    r = await world.api.post(u + "/files/mkdir", params={"path": dest})
    assert r.status_code == 204, r.text
    await world.bad("PUT", u + "/files/tar", status, *names, params={"path": dest}, content=data)
    assert not Path("/tmp/escape").exists() and not Path("/abs").exists()
    r = await world.exec(
        world.target,
        ["sh", "-c", f"ls -A {dest}; ls /tmp/escape /escape 2>/dev/null; rm -rf " + dest],
    )
    assert base64.b64decode(r["stdout"]) in (b"", b"ok\n"), r


async def test_body_over_limit(world: World):
    """A write over the app's max_body is a 413, by Content-Length or while streamed, and
    leaves no file behind."""
    from corral.api.app import create_app

    transport = httpx.ASGITransport(app=create_app(world.node, max_body=1024))
    u = world.url()
    async with httpx.AsyncClient(transport=transport, base_url="http://corral.test") as small:
        await world.bad(
            "PUT",
            u + "/files",
            413,
            "1024",
            api=small,
            params={"path": "/tmp/big"},
            content=b"x" * 4096,
        )

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(8):
                yield b"y" * 512

        await world.bad(
            "PUT",
            u + "/files",
            413,
            "1024",
            api=small,
            params={"path": "/tmp/big2"},
            content=chunks(),
        )
        await world.bad(
            "PUT",
            u + "/files/tar",
            413,
            "1024",
            api=small,
            params={"path": "/tmp"},
            content=b"\0" * 10240,
        )
        await world.bad(
            "POST",
            "/v1/sandboxes",
            413,
            "1024",
            api=small,
            json={
                **GOOD_SPEC,
                "labels": {
                    "k": "v" * 200,
                    "l": "v" * 200,
                    "m": "v" * 200,
                    "n": "v" * 200,
                    "o": "v" * 200,
                },
            },
        )
        r = await small.put(u + "/files", params={"path": "/tmp/small"}, content=b"fits")
        assert r.status_code == 204, r.text
    r = await world.exec(
        world.target, ["sh", "-c", "ls /tmp/big /tmp/big2 2>&1; cat /tmp/small; rm -f /tmp/small"]
    )
    out = base64.b64decode(r["stdout"])
    assert out.count(b"No such file") == 2 and out.endswith(b"fits"), out


# ----------------------------------------------------------------------- after all
# Run by the ``world`` fixture after the module's last test (a finalizer, not a test
# whose name sorts last).
async def _node_fine_after_all(world: World) -> None:
    """The node still answers; destroying both sandboxes through the API works."""
    r = await world.api.get("/v1/node")
    assert r.status_code == 200 and r.json()["sandboxes"] == 2, r.text
    assert (await world.api.get("/v1/healthz")).json() == {"ok": True}
    for sid in (world.target, world.bystander):
        r = await world.api.delete(world.url(sid))
        assert r.status_code == 204, r.text
    r = await world.api.get("/v1/node")
    assert r.status_code == 200 and r.json()["sandboxes"] == 0, r.text


def _nothing_left() -> None:
    """After the node closed, nothing of it is left on the host."""
    from corral.host import leaks

    shutil.rmtree(RUN, ignore_errors=True)
    found = leaks.scan(STATE, RUN, subtree=SUBTREE, netns_prefix=f"corral-test{TAG}-bad-")
    assert leaks.total(found) == 0, found
