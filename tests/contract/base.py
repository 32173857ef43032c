"""Fixtures and helpers every part of the contract shares.

An implementation's test module subclasses :class:`tests.contract.suite.OpsContract`, sets
``image`` (one with bash, coreutils and an ``/etc/passwd`` naming ``nobody``) and provides
an ``ops`` fixture of class scope or wider. Sandboxes are few and shared: ``sb`` (one per
class) serves every test that does not change a sandbox's lifecycle state; the lifecycle
and pause tests make their own and destroy them.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import ClassVar

import pytest

from corral.errors import CorralError, SandboxNotFound
from corral.ops import NodeOps
from corral.spec import ExecRequest, ExecResult, Limits, SandboxInfo, SandboxSpec

__all__ = ["ContractBase", "raises_exactly", "run"]


@contextlib.contextmanager
def raises_exactly(cls: type[CorralError], match: str | None = None) -> Iterator[object]:
    """Like ``pytest.raises``, but a subclass of ``cls`` does not count: both sides must
    raise the same class, since clients branch on it (a wire kind is the class name)."""
    with pytest.raises(CorralError, match=match) as info:
        yield info
    assert type(info.value) is cls, f"raised {type(info.value).__name__}: {info.value}"


async def run(ops: NodeOps, sandbox_id: str, *cmd: str, **kw: object) -> ExecResult:
    """``exec`` of ``cmd`` (one string: ``sh -c`` it) with the ExecRequest fields in ``kw``."""
    argv = ["sh", "-c", cmd[0]] if len(cmd) == 1 and " " in cmd[0] else list(cmd)
    return await ops.exec(sandbox_id, ExecRequest(cmd=argv, **kw))  # type: ignore[arg-type]


class ContractBase:
    image: ClassVar[str]
    """An image of the implementation under test (bash, coreutils, ``nobody``)."""

    @pytest.fixture(scope="class")
    @classmethod
    def run_label(cls) -> str:
        """A label value unique to this run: label queries see only this run's sandboxes."""
        return "c" + secrets.token_hex(5)

    @pytest.fixture(scope="class")
    @classmethod
    async def sb(cls, ops: NodeOps, run_label: str) -> AsyncIterator[SandboxInfo]:
        """The shared sandbox: labels ``contract=<run>, role=shared``, env ``SPEC_VAR`` and
        ``OVERRIDDEN``, workdir ``/tmp``, output limit 64 KiB, qos ``latency``."""
        info = await ops.sandbox_create(
            SandboxSpec(
                image=cls.image,
                labels={"contract": run_label, "role": "shared"},
                env={"SPEC_VAR": "from-spec", "OVERRIDDEN": "spec"},
                workdir="/tmp",
                # Normal CPU weight: a best-effort sandbox waits for idle CPU, which a loaded
                # test machine may not have for a while (the timeout test needs its echo).
                qos="latency",
                limits=Limits(output=64 << 10),
            )
        )
        yield info
        with contextlib.suppress(SandboxNotFound):
            await ops.sandbox_destroy(info.id)

    async def new_sandbox(self, ops: NodeOps, run_label: str, role: str) -> SandboxInfo:
        """A sandbox of its own for a test that changes its state; the test destroys it."""
        return await ops.sandbox_create(
            SandboxSpec(image=self.image, labels={"contract": run_label, "role": role})
        )
