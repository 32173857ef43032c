"""Built-in output checkers of ``fncall.judge`` and the verdict of a call.

Example:
    >>> check("tokens", "1  2\\n3\\n", "1 2 3")
    (True, '')
    >>> check("float", "0.3333334\\n", "0.333333", tolerance=1e-6)
    (True, '')
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable

from corral.errors import SandboxError
from corral.spec import (
    CallRequest,
    CallResult,
    Case,
    CaseResult,
    CustomChecker,
    JudgeRequest,
    JudgeResult,
    Verdict,
)

__all__ = ["check", "verdict_of", "judged"]


def verdict_of(result: CallResult) -> Verdict | None:
    """The verdict a call's status decides by itself; None: the checker decides."""
    return {
        "ok": None,
        "runtime_error": "RE",
        "timeout": "TLE",
        "memory_limit": "MLE",
        "output_limit": "OLE",
        "compile_error": "CE",
    }[result.status]  # type: ignore[return-value]


def check(kind: str, output: str, expected: str, *, tolerance: float = 1e-6) -> tuple[bool, str]:
    """(accepted, message) of a built-in checker."""
    if kind == "exact":
        return (output == expected, "" if output == expected else _first_diff(output, expected))
    if kind == "lines":
        a, b = _lines(output), _lines(expected)
        return (a == b, "" if a == b else _first_diff("\n".join(a), "\n".join(b)))
    if kind == "tokens":
        a, b = output.split(), expected.split()
        if a == b:
            return True, ""
        return False, _token_diff(a, b)
    if kind == "float":
        return _floats(output.split(), expected.split(), tolerance)
    raise ValueError(f"unknown checker {kind!r}")


def _lines(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _first_diff(a: str, b: str) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    line = a.count("\n", 0, n) + 1
    return f"output differs at line {line} (char {n}): got {a[n : n + 20]!r}, expected {b[n : n + 20]!r}"


def _token_diff(a: list[str], b: list[str]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"token {i + 1}: got {x[:40]!r}, expected {y[:40]!r}"
    return f"got {len(a)} tokens, expected {len(b)}"


def _floats(a: list[str], b: list[str], tol: float) -> tuple[bool, str]:
    if len(a) != len(b):
        return False, f"got {len(a)} tokens, expected {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False, f"token {i + 1}: got {x[:40]!r}, expected {y[:40]!r}"
        if math.isnan(fx) or math.isnan(fy):
            return False, f"token {i + 1}: got {x[:40]!r}, expected {y[:40]!r}"
        if abs(fx - fy) > tol * max(1.0, abs(fy)):
            return False, f"token {i + 1}: {x[:40]} differs from {y[:40]} by more than {tol:g}"
    return True, ""


RunCall = Callable[[CallRequest], Awaitable[CallResult]]


async def judged(req: JudgeRequest, results: list[CallResult], run: RunCall) -> JudgeResult:
    """The verdicts of a judge whose cases ran (``results``, in case order; fewer than
    the cases when it stopped early). ``run`` runs a custom checker as a call of its own,
    which must never be the submission's sandbox."""
    cases = list(await asyncio.gather(*(_case(req, c, r, run) for c, r in zip(req.tests, results))))
    failed = next((i for i, c in enumerate(cases) if c.verdict != "AC"), None)
    if failed is None:
        return JudgeResult(verdict="AC", cases=cases)
    if req.stop_on_failure:
        cases = cases[: failed + 1]
    return JudgeResult(verdict=cases[failed].verdict, cases=cases)


async def _case(req: JudgeRequest, case: Case, r: CallResult, run: RunCall) -> CaseResult:
    v = verdict_of(r)
    if v is not None:
        return CaseResult(verdict=v, result=r)
    if isinstance(req.checker, CustomChecker):
        c = req.checker
        stdin = json.dumps({"input": case.stdin, "expected": case.expected, "output": r.stdout})
        cr = await run(
            CallRequest(
                language=c.language, code=c.code, stdin=stdin, limits=c.limits, image=req.image
            )
        )
        if cr.status == "ok":
            return CaseResult(verdict="AC", result=r, message=cr.stdout[:4000])
        if cr.status == "runtime_error" and cr.exit_code is not None:
            return CaseResult(verdict="WA", result=r, message=cr.stdout[:4000])
        raise SandboxError(
            f"the custom checker failed ({cr.status}): {(cr.stderr or cr.stdout)[:2000]}"
        )
    ok, msg = check(req.checker, r.stdout, case.expected, tolerance=req.tolerance)
    return CaseResult(verdict="AC" if ok else "WA", result=r, message=msg)
