"""``bench ondemand --content``: what the bench's files hold (bench/ondemand.py)."""

from __future__ import annotations

import zlib

import pytest
from typer.testing import CliRunner

from corral.bench.ondemand import _Content
from corral.cli.app import app
from corral.errors import SandboxError


def test_random_content_does_not_compress_and_is_stored_uncompressed() -> None:
    c = _Content("random")
    a, b = c.take(64 << 10), c.take(64 << 10)
    assert len(a) == len(b) == 64 << 10 and a != b
    assert len(zlib.compress(a)) > len(a) * 0.99
    assert c.compress is None


def test_source_content_is_text_from_elsewhere_each_time() -> None:
    c = _Content("source")
    files = [c.take(128 << 10) for _ in range(50)]
    assert all(len(f) == 128 << 10 for f in files)
    assert len(set(files)) == 50, "every file starts elsewhere in the corpus"
    assert b"def " in files[0] or b"import " in files[0]
    assert len(zlib.compress(files[0])) < len(files[0]) // 2  # source text compresses
    assert c.compress == "lz4hc"
    # A take past the corpus's end wraps around instead of coming up short.
    assert len(c.take(len(c.corpus) + 10)) == len(c.corpus) + 10


def test_unknown_content_is_refused_by_name() -> None:
    with pytest.raises(SandboxError, match="'text' is not one of random, source"):
        _Content("text")
    r = CliRunner().invoke(app, ["bench", "ondemand", "--content", "text", "--json"])
    assert r.exit_code == 2
    assert "'text' is not one of random, source" in r.output


def test_module_text_is_hex_for_random_content_as_the_bench_always_wrote() -> None:
    t = _Content("random").text(8192)
    assert len(t) == 8192 and int(t, 16) >= 0  # hex digits only: the modules' old content
    assert len(_Content("source").text(8192)) == 8192
