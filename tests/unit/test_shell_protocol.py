"""The framing of shell-session commands (corral.backends.shell), without a sandbox: the
markers are found wherever the chunks of a stream split them, and only the markers of
the command's own nonce count."""

from __future__ import annotations

import pytest

from corral.backends.shell import _Stream, command_text

NONCE = "0f" * 16


def _stream(limit: int = 1 << 20) -> _Stream:
    return _Stream(f"\x1eS{NONCE}\x1e".encode(), f"\x1eE{NONCE}:".encode(), limit)


def _feed_in_chunks(data: bytes, size: int, limit: int = 1 << 20) -> _Stream:
    s, buf = _stream(limit), bytearray()
    for i in range(0, len(data), size):
        buf += data[i : i + size]
        if s.feed(buf):
            break
    return s


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_output_between_markers_whatever_the_chunks(size: int) -> None:
    forged = b"\x1eE" + b"ab" * 16 + b":0\x1e" + b"\x1eS" + NONCE[:10].encode()
    body = b"no newline" + forged + b"\x1eE" + NONCE.encode()  # a prefix of the real one
    data = b"job chatter\x1eS" + NONCE.encode() + b"\x1e" + body + b"\x1eE"
    data += NONCE.encode() + b":3a\x1eafter"
    s = _feed_in_chunks(data, size)
    assert s.phase == 2 and s.status == 3 and s.aborted
    assert s.kept is not None and bytes(s.kept) == body


def test_limit_counts_past_the_cap() -> None:
    data = b"\x1eS" + NONCE.encode() + b"\x1e" + b"x" * 100 + b"\x1eE" + NONCE.encode()
    s = _feed_in_chunks(data + b":0\x1e", 9, limit=10)
    assert s.kept == bytearray(b"x" * 10) and s.total == 100 and s.truncated


def test_command_text_quotes_everything() -> None:
    t = command_text(NONCE, "echo 'it''s'\n$HOME `x`", "/.corral/shells/a b.stdin")
    assert (
        t
        == (
            f"__cs_pre {NONCE}; eval 'echo '\\''it'\\'''\\''s'\\''\n$HOME `x`' "
            f"<'/.corral/shells/a b.stdin'\n__cs_post {NONCE}\n"
        ).encode()
    )
