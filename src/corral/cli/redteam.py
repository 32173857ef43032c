"""``corral redteam``: run the red-team suite (tests/redteam) against a real node.

The suite is the pytest suite of the source checkout: each attack is one test, run by a
hostile guest in a real sandbox of an embedded node the suite starts. A small pytest plugin
records per attack whether it was blocked (the test passed, no canary leaked) and whether
the platform logged it (its ``@pytest.mark.logs`` event checks passed; ``n/a`` when the
attack is not one the platform can observe, e.g. a read of a masked file).

With ``--json`` the last stdout line is
``{"scenario":"redteam","attacks":N,"blocked":N,"logged":N,"failures":[...]}`` where
``logged`` counts attacks whose event check passed or that have none.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from corral.cli._context import Globals, err, out
from corral.errors import CorralError

NOT_LOGGED = "NOT LOGGED"
"""The prefix tests/redteam/conftest.py gives a failed event check."""


@dataclass
class Attack:
    """One attack (test) and what became of it."""

    attack: str
    expects: list[str] = field(default_factory=list)
    """Event kinds the attack must leave (its ``logs`` markers)."""
    blocked: bool | None = None
    """None: did not run (skipped, or its setup failed)."""
    logged: bool | None = None
    """None: nothing to log (no ``logs`` marker) or not known (not blocked)."""
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.blocked is True and self.logged is not False


class _Recorder:
    """pytest plugin: one :class:`Attack` per test item."""

    def __init__(self) -> None:
        self.attacks: dict[str, Attack] = {}

    def pytest_collection_finish(self, session: Any) -> None:
        for item in session.items:  # after -k/-m deselection
            doc = (getattr(item, "obj", None).__doc__ or "") if hasattr(item, "obj") else ""
            if not doc:
                doc = getattr(item.module, "__doc__", "") or ""
            self.attacks[item.nodeid] = Attack(
                attack=_short(item.nodeid),
                expects=[str(m.args[0]) for m in item.iter_markers("logs")],
                detail=_first_sentence(doc),
            )

    def pytest_runtest_logreport(self, report: Any) -> None:
        a = self.attacks.get(report.nodeid)
        if a is None:
            return
        if report.skipped:
            a.blocked, a.detail = None, f"skipped: {_reason(report)}"
        elif report.when == "call":
            a.blocked = bool(report.passed)
            if report.failed:
                a.detail = _reason(report)
            elif a.expects:
                a.logged = True
        elif report.failed:
            text = _reason(report)
            if report.when == "teardown" and NOT_LOGGED in text:
                a.logged = False
            elif report.when == "teardown":
                a.blocked = False  # e.g. a canary found in the guest's output
            else:
                a.blocked = None
            a.detail = text


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.split())
    end = text.find(". ")
    text = text if end < 0 else text[: end + 1]
    return text if len(text) <= 140 else text[:140].rsplit(" ", 1)[0] + " ..."


def _short(nodeid: str) -> str:
    """``tests/redteam/test_x.py::test_y`` -> ``x::y``"""
    name = nodeid.split("tests/redteam/", 1)[-1].replace(".py::", "::")
    return "::".join(part.removeprefix("test_") for part in name.split("::"))


def _reason(report: Any) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    text = str(report.longreprtext or "")
    lines = [ln[2:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    lines = [ln for ln in lines if ln] or text.strip().splitlines()[-1:] or [""]
    return lines[0][:300]


def find_suite(start: Path | None = None) -> Path:
    """The ``tests/redteam`` directory of the source checkout holding ``start`` (default: the
    working directory), else of the checkout this package runs from."""
    candidates = [start or Path.cwd(), Path(__file__).resolve()]
    for c in candidates:
        for d in [c, *c.parents]:
            suite = d / "tests" / "redteam"
            if (suite / "conftest.py").is_file() and (d / "pyproject.toml").is_file():
                return suite
    raise CorralError(
        "corral redteam runs the red-team suite of a corral source checkout, and found no "
        "tests/redteam/ above the current directory or the installed package: run it from "
        "the repository root (git clone ...; cd corral; corral redteam)"
    )


def run_suite(suite: Path, extra: list[str]) -> tuple[int, list[Attack]]:
    """Run pytest on ``suite`` in this process; its own output goes to stderr."""
    try:
        import pytest
    except ImportError:
        raise CorralError(
            "corral redteam needs pytest (the dev extras: pip install -e '.[dev]')"
        ) from None

    rec = _Recorder()
    repo = suite.parent.parent
    args = [
        str(suite),
        "-q",
        "-p",
        "no:cacheprovider",
        f"--rootdir={repo}",
        "-c",
        str(repo / "pyproject.toml"),
        *extra,
    ]
    old = Path.cwd()
    os.chdir(repo)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            rc = pytest.main(args, plugins=[rec])
    finally:
        os.chdir(old)
    return int(rc), list(rec.attacks.values())


def _mark(v: bool | None, yes: str = "yes", none: str = "-") -> str:
    if v is None:
        return f"[yellow]{none}[/]"
    return f"[green]{yes}[/]" if v else "[bold red]NO[/]"


def table(attacks: list[Attack]) -> Table:
    t = Table(title="corral redteam", caption="blocked: the attack failed and the host is intact")
    t.add_column("attack", overflow="fold", ratio=3)
    t.add_column("blocked?", min_width=8)
    t.add_column("event logged?", min_width=13, overflow="fold")
    t.add_column("detail", overflow="fold", ratio=4)
    for a in attacks:
        logged = (
            _mark(a.logged, yes=", ".join(sorted(set(a.expects))), none="?")
            if a.expects and a.blocked
            else ("[dim]n/a[/]" if not a.expects else "[yellow]?[/]")
        )
        t.add_row(escape(a.attack), _mark(a.blocked), logged, escape(a.detail))
    return t


def redteam(
    ctx: typer.Context,
    json_out: Annotated[
        bool, typer.Option("--json", help="Last stdout line: one JSON object.")
    ] = False,
    select: Annotated[
        str | None, typer.Option("-k", help="Only attacks matching this pytest -k expression.")
    ] = None,
) -> None:
    """Run the red-team suite (tests/redteam) against a real embedded node: attack, blocked?,
    event logged?, detail. Needs root and a source checkout."""
    g: Globals = ctx.obj
    suite = find_suite()
    if os.geteuid() != 0:
        raise CorralError("corral redteam needs root: the attacks run in real sandboxes")
    rc, attacks = run_suite(suite, ["-k", select] if select else [])
    if rc not in (0, 1) and not attacks:
        raise CorralError(f"the red-team suite did not run (pytest exit status {rc})")
    failures = [
        {"attack": a.attack, "blocked": a.blocked, "logged": a.logged, "detail": a.detail}
        for a in attacks
        if not a.ok
    ]
    if json_out or g.json:
        err().print(table(attacks))
        result = {
            "scenario": "redteam",
            "attacks": len(attacks),
            "blocked": sum(a.blocked is True for a in attacks),
            "logged": sum(a.blocked is True and a.logged is not False for a in attacks),
            "observable": sum(bool(a.expects) for a in attacks),
            "failures": failures,
        }
        typer.echo(json.dumps(result, separators=(",", ":")))
    else:
        out().print(table(attacks))
        blocked = sum(a.blocked is True for a in attacks)
        out().print(f"{blocked}/{len(attacks)} blocked, {len(failures)} failing")
    if failures or rc != 0:
        raise typer.Exit(1)


__all__ = ["Attack", "find_suite", "run_suite", "redteam", "table"]
