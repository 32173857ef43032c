"""Units of the port proxy's header rules and of the inotify event parsing/mapping."""

from __future__ import annotations

import struct

from corral.host import inotify as ino
from corral.integrations.e2b._portlink import passed_on
from corral.node.watch import kind_of


def test_node_token_never_passes_but_the_apps_own_credentials_do() -> None:
    headers = {
        "Authorization": "Bearer app",
        "X-API-Key": "sandbox-own",
        "X-Access-Token": "sandbox-own",
        "Connection": "keep-alive",
        "Accept": "*/*",
    }
    assert passed_on(headers, "node") == [
        ("Authorization", "Bearer app"),
        ("X-API-Key", "sandbox-own"),
        ("Accept", "*/*"),
    ]
    assert passed_on({"Authorization": "Bearer node", "X-API-Key": "node"}, "node") == []


def test_parse_inotify_events() -> None:
    def raw(wd: int, mask: int, name: bytes) -> bytes:
        padded = name + b"\0" * (16 - len(name)) if name else b""
        return struct.pack("iIII", wd, mask, 0, len(padded)) + padded

    buf = raw(1, ino.IN_CREATE, b"a.txt") + raw(2, ino.IN_IGNORED, b"")
    evs = list(ino.parse(buf))
    assert [(e.wd, e.mask, e.name) for e in evs] == [
        (1, ino.IN_CREATE, "a.txt"),
        (2, ino.IN_IGNORED, ""),
    ]


def test_event_kinds_follow_envd() -> None:
    assert kind_of(ino.IN_CREATE) == "create"
    assert kind_of(ino.IN_MOVED_TO) == "create"
    assert kind_of(ino.IN_MOVED_FROM) == "rename"
    assert kind_of(ino.IN_MODIFY) == "write"
    assert kind_of(ino.IN_DELETE | ino.IN_ISDIR) == "remove"
    assert kind_of(ino.IN_ATTRIB) == "chmod"
    assert kind_of(ino.IN_IGNORED) is None
