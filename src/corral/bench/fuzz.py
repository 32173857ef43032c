"""``corral bench fuzz``: schemathesis against the node's own OpenAPI spec, over real HTTP,
with a real node, real images and real sandboxes behind it.

Random ids only ever reach the "not found" answers, so half of the generated cases get a
real sandbox id (and a real shell id, process id and image name) in their path, which
takes them through the node into runc, the files code, the shells and the snapshot path.
Before such a case the targets are made whole again (recreated if a case destroyed
them, resumed if one paused them), so later cases still go deep.

Every answer is checked for: no status >= 500, its status documented in the spec, its
content type documented, its body matching the documented schema. The node runs with a
small ``max_sandboxes`` so that a fuzzed ``fork(count=1000)`` meets the capacity answer
instead of filling the machine.

Example::

    result = await fuzz(BenchOptions(image="busybox"), cases=300, seed=0)
    assert result["server_errors"] == 0
"""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from corral.bench.leftovers import settled_scan
from corral.bench.scenarios import BenchOptions, say
from corral.errors import CorralError
from corral.host import leaks

__all__ = ["fuzz", "FuzzReport", "run_cases"]

_SKIP_PATHS = {"/v1/live"}
"""Server-sent events that never end: a fuzzer's request would hang until its timeout."""
_TIMEOUT = 60.0
"""Seconds a fuzzed request may take; one that takes longer is counted in ``timeouts``."""


@dataclass
class FuzzReport:
    """What a fuzz run found; ``failures`` keeps one example per (check, operation, status)."""

    cases: int = 0
    server_errors: int = 0
    schema_violations: int = 0
    undocumented_status: int = 0
    content_type_violations: int = 0
    timeouts: int = 0
    capacity_refusals: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    deep: int = 0
    failures: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "server_errors": self.server_errors,
            "schema_violations": self.schema_violations,
            "undocumented_status": self.undocumented_status,
            "content_type_violations": self.content_type_violations,
            "timeouts": self.timeouts,
            "capacity_refusals": self.capacity_refusals,
            "deep_cases": self.deep,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "failures": dict(list(self.failures.items())[:20]),
        }


class _Targets:
    """The real objects that cases are pointed at, kept alive over HTTP (from the fuzz
    thread: the node's event loop serves these requests while the thread waits)."""

    def __init__(self, base: str, token: str, image: str) -> None:
        import requests

        self.base = base + "/v1"
        self.image = image
        self.http = requests.Session()
        self.http.headers["authorization"] = f"Bearer {token}"
        self.sandbox = ""
        self.shell = ""
        self.process = ""
        self.shells = True

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        r = self.http.request(method, self.base + path, timeout=_TIMEOUT, **kw)
        return r

    def ensure(self) -> None:
        """One running sandbox with an open shell and a finished process."""
        r = self._call("GET", f"/sandboxes/{self.sandbox}") if self.sandbox else None
        state = r.json().get("state") if r is not None and r.status_code == 200 else None
        if state is None or state not in ("running", "paused"):
            spec = {"image": self.image, "labels": {"fuzz": "target"}}
            r = self._call("POST", "/sandboxes", json=spec)
            r.raise_for_status()
            self.sandbox = r.json()["id"]
            self.shell = self.process = ""
        elif state == "paused":
            self._call("POST", f"/sandboxes/{self.sandbox}/resume").raise_for_status()
        sb = f"/sandboxes/{self.sandbox}"
        if self.shells and (
            not self.shell
            or self._call(
                "POST", f"{sb}/shells/{self.shell}/run", json={"command": "true"}
            ).status_code
            != 200
        ):
            r = self._call("POST", f"{sb}/shells", json={})
            # a shell needs bash in the image: without it shell cases stay shallow
            self.shells = r.status_code == 201
            self.shell = r.json()["id"] if self.shells else ""
        if not self.process:
            r = self._call("POST", f"{sb}/processes", json={"cmd": ["true"]})
            r.raise_for_status()
            self.process = r.json()["id"]
            self._call("GET", f"{sb}/processes/{self.process}", params={"wait": 30})

    def point(self, case: Any) -> None:
        """Put the real ids into ``case``'s path (and the real image into a create)."""
        params = case.path_parameters if case.path_parameters is not None else {}
        if "sandbox_id" in params:
            params["sandbox_id"] = self.sandbox
        if "shell_id" in params:
            params["shell_id"] = self.shell
        if "process_id" in params:
            params["process_id"] = self.process
        if "name" in params and case.method == "GET":
            params["name"] = self.image
        if case.path == "/v1/sandboxes" and case.method == "POST" and isinstance(case.body, dict):
            case.body["image"] = self.image
            case.body["ttl"] = 600


def run_cases(base: str, token: str, image: str, cases: int, seed: int) -> FuzzReport:
    """``cases`` generated requests spread over every operation of the spec at ``base``
    (blocking: call it from a thread while the node serves). Deterministic: hypothesis
    draws from ``seed`` with no example database."""
    import hypothesis
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.core.failures import FailureGroup
    from schemathesis.core.result import Err
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    auth = {"authorization": f"Bearer {token}"}
    spec = requests.get(f"{base}/openapi.json", headers=auth, timeout=_TIMEOUT)
    spec.raise_for_status()
    schema = schemathesis.openapi.from_dict(spec.json())
    schema.config.update(base_url=base)
    ops = []
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            raise CorralError(f"the node's own OpenAPI spec is invalid: {result.err()}")
        if result.ok().path not in _SKIP_PATHS:
            ops.append(result.ok())
    ops.sort(key=lambda o: (o.path, o.method))
    targets = _Targets(base, token, image)
    targets.ensure()
    report = FuzzReport()
    session = requests.Session()
    session.headers["authorization"] = f"Bearer {token}"
    checks = {
        not_a_server_error: "server_errors",
        status_code_conformance: "undocumented_status",
        content_type_conformance: "content_type_violations",
        response_schema_conformance: "schema_violations",
    }
    slots = [
        (op, mode) for op in ops for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    ]

    def one(case: Any) -> None:
        # every other case goes deep: hypothesis would draw a boolean False first
        if report.cases % 2 == 0:
            targets.ensure()
            targets.point(case)
            report.deep += 1
        report.cases += 1
        try:
            resp = case.call(session=session, timeout=_TIMEOUT)
        except requests.Timeout:
            report.timeouts += 1
            report.failures.setdefault(f"timeout {case.method} {case.path}", repr(case.body)[:300])
            return
        report.statuses[resp.status_code] += 1
        if resp.status_code == 503 and '"CapacityError"' in resp.text:
            # the bench node's own small max_sandboxes refusing a fuzzed fork(count=1000):
            # the documented answer to "no room", not a failure of the node
            report.capacity_refusals += 1
            return
        for check, counter in checks.items():
            try:
                case.validate_response(resp, checks=[check])
            except (AssertionError, FailureGroup) as exc:
                setattr(report, counter, getattr(report, counter) + 1)
                key = f"{counter} {case.method} {case.path} {resp.status_code}"
                report.failures.setdefault(key, f"{str(exc)[:400]} | {resp.text[:300]}")

    for i, (op, mode) in enumerate(slots):
        share = cases // len(slots) + (1 if i < cases % len(slots) else 0)
        if share == 0:
            continue

        @hypothesis.seed(seed)
        @settings(
            max_examples=share,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @hypothesis.given(case=op.as_strategy(generation_mode=mode))
        def test(case: Any) -> None:
            one(case)

        try:
            test()
        except hypothesis.errors.Unsatisfiable:
            continue  # a negative mode that cannot break this operation's schema
    return report


async def fuzz(opts: BenchOptions, cases: int, seed: int) -> dict[str, Any]:
    """Serve a bench node on loopback TCP, fuzz it with ``cases`` requests, then check it
    still answers and that destroying everything leaves nothing behind."""
    from corral.api.server import NodeServer
    from corral.bench.image import ensure_image
    from corral.images.store import LayerStore
    from corral.node import Node
    from corral.spec import ExecRequest, SandboxSpec

    image = await asyncio.to_thread(ensure_image, LayerStore(opts.store_dir), opts.image)
    config = opts.node_config().model_copy(update={"max_sandboxes": 24})
    node = await Node.open(config)
    token = secrets.token_hex(16)
    try:
        await node.gc(everything=True)
        async with NodeServer(node, host="127.0.0.1", port=0, token=token) as srv:
            say(f"fuzzing {srv.address} with {cases} cases (seed {seed})")
            report = await asyncio.to_thread(
                run_cases, srv.address, token, image.info.name, cases, seed
            )
        # healthy after: a new sandbox answers a command
        probe = await node.sandbox_create(SandboxSpec(image=image.info.name))
        r = await node.exec(probe.id, ExecRequest(cmd=["echo", "ok"]))
        healthy = r.exit_code == 0 and r.stdout == b"ok\n"
    finally:
        for info in await node.sandbox_list():
            await node.sandbox_destroy(info.id)
        await node.close()
    found = await settled_scan(opts)
    left = {k: len(v) for k, v in found.items() if v}
    return {
        "scenario": "fuzz",
        **report.as_dict(),
        "image": image.info.name,
        "seed": seed,
        "healthy_after": healthy,
        "leaks": left,
        "leaked_total": leaks.total(found),
    }
