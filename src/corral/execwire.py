"""The binary form of an exec answer, for clients that ask for it (the SDK does).

``POST /v1/sandboxes/{id}/exec`` answers JSON by default: an :class:`ExecResult` whose
``stdout``/``stderr`` are base64 strings. A client that sends ``Accept:`` :data:`MEDIA_TYPE`
gets the same result as bytes instead: the body is the result's JSON with both streams
empty (the *head*), then stdout's bytes, then stderr's, and the ``X-Corral-Exec`` header
gives the three lengths (``head=H, stdout=O, stderr=E``; the body is exactly H+O+E bytes).

Why: a command may return up to 64 MiB of each stream. In JSON that is 85 MiB of base64 the
node encodes (42 ms of CPU a 64 MiB stream) and writes, and the client then parses and
decodes (108 ms of CPU a 64 MiB answer, ``corral bench neighbours``' output flood: the
flood's clients took half of both CPUs). Raw, the node writes the bytes it read, and the
client slices them out of the body. Clients that do not ask (curl, the OpenAPI's
generated clients, schemathesis) get JSON as before.

Example::

    head, out, err = frame(result)            # the node: head, then out, then err
    header = framing_header(head, out, err)   # X-Corral-Exec
    result = parse(header, body)              # the client: an ExecResult again
"""

from __future__ import annotations

from corral.spec import ExecResult

__all__ = ["MEDIA_TYPE", "HEADER", "wants", "frame", "framing_header", "parse", "FramingError"]

MEDIA_TYPE = "application/vnd.corral.exec"
HEADER = "x-corral-exec"
_PARTS = ("head", "stdout", "stderr")


class FramingError(ValueError):
    """A binary exec answer whose framing does not add up."""


def wants(accept: str | None) -> bool:
    """Whether an ``Accept`` header lists :data:`MEDIA_TYPE` (parameters and case aside)."""
    if not accept:
        return False
    return any(part.split(";", 1)[0].strip().lower() == MEDIA_TYPE for part in accept.split(","))


def frame(res: ExecResult) -> tuple[bytes, bytes, bytes]:
    """The head (``res`` as JSON, both streams empty), stdout, stderr."""
    head = res.model_copy(update={"stdout": b"", "stderr": b""}).model_dump_json().encode()
    return head, res.stdout, res.stderr


def framing_header(head: bytes, stdout: bytes, stderr: bytes) -> str:
    """The ``X-Corral-Exec`` header's value for these three parts."""
    return f"head={len(head)}, stdout={len(stdout)}, stderr={len(stderr)}"


def parse(header: str | None, body: bytes) -> ExecResult:
    """The :class:`ExecResult` in a binary answer (``header``: its ``X-Corral-Exec``)."""
    if header is None:
        raise FramingError(f"a {MEDIA_TYPE} answer without its {HEADER} header")
    sizes: dict[str, int] = {}
    for item in header.split(","):
        key, eq, value = item.strip().partition("=")
        if not eq or key not in _PARTS or key in sizes or not value.isdigit():
            raise FramingError(f"{HEADER}: {header!r}: expected head=N, stdout=N, stderr=N")
        sizes[key] = int(value)
    if len(sizes) != len(_PARTS):
        raise FramingError(f"{HEADER}: {header!r}: expected head=N, stdout=N, stderr=N")
    h, o, e = (sizes[k] for k in _PARTS)
    if h + o + e != len(body):
        raise FramingError(f"{HEADER} says {h + o + e} bytes ({header}), the body has {len(body)}")
    res = ExecResult.model_validate_json(body[:h])
    if res.stdout or res.stderr:
        raise FramingError("the head of a binary exec answer carries output of its own")
    return res.model_copy(update={"stdout": body[h : h + o], "stderr": body[h + o :]})
