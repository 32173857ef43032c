"""``corral cluster ...`` and ``corral --node ray://auto ...`` against the test cluster."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from corral.cli.app import app
from corral.cluster.local import LocalRayCluster


def _run(*args: str) -> str:
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 0, r.output
    return r.stdout


def test_nodes_status_drain_and_sandbox_ls(raycorral: LocalRayCluster) -> None:
    rows = json.loads(_run("cluster", "nodes", "--json"))
    assert len(rows) == 3 and {r["state"] for r in rows} == {"up"}
    assert {r["labels"]["host"] for r in rows} == {"c0", "c1", "c2"}
    st = json.loads(_run("cluster", "status", "--json"))
    assert st["node_id"] == "cluster" and st["labels"]["nodes"] == "3"
    assert st["max_sandboxes"] == 3 * 64
    victim = rows[0]["node_id"]
    assert "is draining" in _run("cluster", "drain", victim)
    try:
        for _ in range(6):
            made = json.loads(
                _run(
                    "--node",
                    "ray://auto",
                    "--json",
                    "sandbox",
                    "create",
                    "test/busybox",
                    "--qos",
                    "latency",
                    "--label",
                    "t=cli",
                )
            )
            assert made["node_id"] != victim
    finally:
        _run("cluster", "drain", victim, "--undo")
    listed = json.loads(_run("--node", "ray://auto", "--json", "sandbox", "ls", "--label", "t=cli"))
    assert len(listed) == 6
    for sb in listed:
        _run("--node", "ray://auto", "sandbox", "rm", sb["id"])


def test_up_names_the_missing_resource_and_reuses_a_running_agent(
    raycorral: LocalRayCluster,
) -> None:
    r = CliRunner().invoke(app, ["cluster", "up", "--host", "c9"])
    assert r.exit_code != 0 and "corral-node-c9" in r.output
    assert "of host c1 serves http://" in _run("cluster", "up", "--host", "c1")
