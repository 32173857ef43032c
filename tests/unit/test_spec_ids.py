"""Sandbox ids that name their node, event cursors, and the new spec fields."""

from __future__ import annotations

import base64
import json

import pytest
from pydantic import ValidationError

from corral.errors import InvalidRequest
from corral.ops import check_events_limit, cursor_positions, stamp_events
from corral.spec import (
    SANDBOX_ID_RE,
    Event,
    NodeStatus,
    PtyRequest,
    SandboxSpec,
    decode_cursor,
    encode_cursor,
    new_sandbox_id,
    parse_sandbox_id,
    sandbox_local,
)


def test_new_ids_carry_their_node_and_parse_back() -> None:
    ids = {new_sandbox_id("0a1b2c3d4e5f") for _ in range(200)}
    assert len(ids) == 200
    for sid in ids:
        assert SANDBOX_ID_RE.match(sid)
        local, node = parse_sandbox_id(sid)
        assert node == "0a1b2c3d4e5f" and len(local) == 12 and sandbox_local(sid) == local
        assert sid == f"sb-{local}-{node}"
    assert parse_sandbox_id("sb-abcdefghijkl-x") == ("abcdefghijkl", "x")


@pytest.mark.parametrize("node", ["", "A", "a-b", "a" * 17, "é", "a\n"])
def test_bad_node_ids_are_refused(node: str) -> None:
    with pytest.raises(ValueError, match="node id"):
        new_sandbox_id(node)


@pytest.mark.parametrize(
    "sid",
    [
        "sb-000000000000",  # the old format: no node
        "sb-abcdefghijkl-",
        "sb-ABCDEFGHIJKL-n1",
        "sb-abcdefghijk-n1",
        "sb-abcdefghijkl-" + "n" * 17,
        "xx-abcdefghijkl-n1",
        "sb-abcdefghijkl-n1\n",
        "",
    ],
)
def test_parse_refuses_what_is_not_an_id(sid: str) -> None:
    with pytest.raises(ValueError, match="not a sandbox id"):
        parse_sandbox_id(sid)


def test_parse_error_does_not_echo_a_huge_id() -> None:
    with pytest.raises(ValueError) as info:
        parse_sandbox_id("x" * 100_000)
    assert len(str(info.value)) < 300


def test_cursor_round_trip_is_opaque_and_url_safe() -> None:
    pos = {"n1": 7, "0a1b2c3d4e5f": 0, "z": 2**62}
    c = encode_cursor(pos)
    assert c.startswith("c1.") and "=" not in c and "+" not in c and "/" not in c
    assert decode_cursor(c) == pos
    assert encode_cursor({"b": 1, "a": 2}) == encode_cursor({"a": 2, "b": 1})  # canonical
    assert decode_cursor(encode_cursor({})) == {}


def _raw(obj: object) -> str:
    return "c1." + base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    ("cursor", "words"),
    [
        ("12", "not an events cursor"),
        ("c2.e30", "not an events cursor"),
        ("c1.!!!", "damaged"),
        ("c1.a", "damaged"),
        (_raw([1]), "not a node map"),
        (_raw({"n1": -1}), "not an event id"),
        (_raw({"n1": True}), "not an event id"),
        (_raw({"n1": 1.5}), "not an event id"),
        (_raw({"N1": 1}), "node id"),
        (_raw({f"n{i}": 1 for i in range(4097)}), "4096"),
        ("c1." + "W" * 2_000_000, "too long"),
    ],
)
def test_garbage_cursors_say_what_is_wrong(cursor: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        decode_cursor(cursor)
    with pytest.raises(InvalidRequest, match="^after: "):
        cursor_positions(cursor)


def test_ops_helpers() -> None:
    assert cursor_positions(None) == {} and cursor_positions("") == {}
    for bad in (0, 10001, True, 1.0):
        with pytest.raises(InvalidRequest, match="limit"):
            check_events_limit(bad)  # type: ignore[arg-type]
    assert check_events_limit(10000) == 10000
    evs = [Event(id=i, sandbox_id=None, time=0.0, kind="k") for i in (4, 9)]
    stamped = stamp_events(evs, "n1", {"n2": 3, "n1": 1})
    assert [e.node_id for e in stamped] == ["n1", "n1"]
    assert decode_cursor(stamped[0].cursor) == {"n1": 4, "n2": 3}
    assert decode_cursor(stamped[1].cursor) == {"n1": 9, "n2": 3}
    assert evs[0].cursor == ""  # the inputs are not changed


def test_backend_field_and_status_defaults() -> None:
    assert SandboxSpec(image="x").backend is None
    assert SandboxSpec(image="x", backend="microvm").backend == "microvm"
    for bad in ("", "Container", "1vm", "a" * 33, "vm!"):
        with pytest.raises(ValidationError):
            SandboxSpec(image="x", backend=bad)
    st = NodeStatus(
        node_id="n1",
        version="0",
        cgroup_mode="v2",
        sandboxes=0,
        running=0,
        state_dir="",
        store="",
        mounted_layers=0,
        mem_total=0,
        mem_available=0,
    )
    assert (st.default_backend, st.backends, st.labels, st.max_sandboxes) == (
        "container",
        [],
        {},
        0,
    )
    with pytest.raises(ValidationError):
        NodeStatus.model_validate({**st.model_dump(), "runtime": "crun"})  # moved to backends


def test_pty_request_validation() -> None:
    r = PtyRequest()
    assert (r.cmd, r.rows, r.cols, r.env, r.cwd, r.user) == (None, 24, 80, {}, None, None)
    for bad in (
        {"cmd": []},
        {"cmd": [""]},
        {"cmd": ["a\0b"]},
        {"rows": 0},
        {"cols": 65536},
        {"cwd": "relative"},
        {"env": {"A=B": "1"}},
    ):
        with pytest.raises(ValidationError):
            PtyRequest.model_validate(bad)
