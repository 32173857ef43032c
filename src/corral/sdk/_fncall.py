"""``client.fncall``: short calls in warm pool sandboxes (online-judge tasks, snippets).

Example:
    >>> r = await client.fncall.run(language="python", code="print(input()*2)",   # doctest: +SKIP
    ...                             stdin="ab\\n", limits=corral.CallLimits(cpu_time=1))
    >>> r.status, r.stdout                                                     # doctest: +SKIP
    ('ok', 'abab\\n')
    >>> v = await client.fncall.judge(language="cpp", code=src,                 # doctest: +SKIP
    ...                               tests=[corral.Case(stdin="1 2\\n", expected="3\\n")])
    >>> v.verdict                                                              # doctest: +SKIP
    'AC'
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from corral.sdk._sandbox import invalid_request
from corral.spec import (
    CallLimits,
    CallRequest,
    CallResult,
    Case,
    CustomChecker,
    JudgeRequest,
    JudgeResult,
)

if TYPE_CHECKING:
    from corral.sdk._client import AsyncClient

__all__ = ["FnCall"]

Progress = Callable[[int, int], None]
"""Called as ``progress(done, total)`` after each call of a ``map``."""


def _model(cls: type[Any], fields: dict[str, Any]) -> Any:
    try:
        return cls.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise invalid_request(exc) from None


class FnCall:
    """``client.fncall``: run, judge and map short calls (see ``corral.node.fncall``)."""

    __slots__ = ("_client",)

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def run(
        self,
        language: str,
        code: str,
        stdin: str = "",
        *,
        limits: CallLimits | Mapping[str, Any] | None = None,
        image: str | None = None,
    ) -> CallResult:
        """Run ``code`` once with ``stdin``; the result's ``status`` says how it ended
        (ok, runtime_error, timeout, memory_limit, output_limit, compile_error)."""
        req = _model(
            CallRequest,
            {"language": language, "code": code, "stdin": stdin, "limits": limits, "image": image},
        )
        return await (await self._client._get_ops()).fncall_run(req)

    async def judge(
        self,
        language: str,
        code: str,
        tests: Sequence[Case | Mapping[str, Any]],
        *,
        checker: str | CustomChecker | Mapping[str, Any] = "exact",
        tolerance: float | None = None,
        limits: CallLimits | Mapping[str, Any] | None = None,
        image: str | None = None,
        stop_on_failure: bool = False,
    ) -> JudgeResult:
        """Compile once (compiled languages), run every test case, check each output:
        verdicts AC, WA, TLE, MLE, RE, OLE, CE per case and overall.

        ``checker``: ``exact``, ``lines``, ``tokens``, ``float`` (with ``tolerance``) or a
        :class:`~corral.CustomChecker` program."""
        req = _model(
            JudgeRequest,
            {
                "language": language,
                "code": code,
                "tests": list(tests),
                "checker": checker,
                "tolerance": tolerance,
                "limits": limits,
                "image": image,
                "stop_on_failure": stop_on_failure,
            },
        )
        return await (await self._client._get_ops()).fncall_judge(req)

    async def map(
        self,
        calls: Iterable[CallRequest | Mapping[str, Any]],
        *,
        concurrency: int = 64,
        progress: bool | Progress = False,
        return_exceptions: bool = False,
    ) -> builtins.list[CallResult | BaseException]:
        """Run many calls, at most ``concurrency`` at a time; results in input order.

        ``progress``: True draws a progress bar on stderr; a callable gets
        ``(done, total)`` after each call. With ``return_exceptions`` a call that raises
        (bad request, node error) gives its exception in its slot instead of failing the
        batch."""
        if concurrency < 1:
            from corral.errors import InvalidRequest

            raise InvalidRequest(f"concurrency: must be at least 1, got {concurrency}")
        reqs = [c if isinstance(c, CallRequest) else _model(CallRequest, dict(c)) for c in calls]
        ops = await self._client._get_ops()
        sem = asyncio.Semaphore(concurrency)
        done = 0
        bar, report = _progress(progress, len(reqs))

        async def one(req: CallRequest) -> CallResult:
            nonlocal done
            async with sem:
                try:
                    return await ops.fncall_run(req)
                finally:
                    done += 1
                    report(done)

        try:
            out = await asyncio.gather(*(one(r) for r in reqs), return_exceptions=return_exceptions)
        finally:
            if bar is not None:
                bar.stop()
        return builtins.list(out)


def _progress(progress: bool | Progress, total: int) -> tuple[Any, Callable[[int], None]]:
    if callable(progress):
        fn = progress
        return None, lambda done: fn(done, total)
    if not progress:
        return None, lambda done: None
    from rich.console import Console
    from rich.progress import Progress as Bar

    bar = Bar(transient=True, console=Console(stderr=True))
    task = bar.add_task("fncall", total=total)
    bar.start()
    return bar, lambda done: bar.update(task, completed=done)
