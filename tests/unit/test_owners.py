"""Owner uids of sandbox user namespaces: unique per host, released, re-claimable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from corral.errors import CapacityError
from corral.host.owners import OwnerUids, namespace_owner


def test_allocations_are_distinct_and_in_range(tmp_path: Path) -> None:
    o = OwnerUids(500000, 8, lock_file=tmp_path / "lock")
    got = {o.allocate() for _ in range(8)}
    assert got == set(range(500000, 500008))
    with pytest.raises(CapacityError, match="8 user namespace owner uids"):
        o.allocate()
    o.release(500003)
    assert o.allocate() == 500003
    o.close()


def test_two_nodes_never_share_an_owner(tmp_path: Path) -> None:
    """Host-wide: a second allocator (another node, even in the same process) skips the
    uids the first holds, and gets them once released or once the first closes."""
    a = OwnerUids(600000, 4, lock_file=tmp_path / "lock")
    b = OwnerUids(600000, 4, lock_file=tmp_path / "lock")
    mine = {a.allocate() for _ in range(3)}
    theirs = b.allocate()
    assert theirs not in mine
    with pytest.raises(CapacityError):
        b.allocate()
    assert not b.claim(next(iter(mine)))
    uid = next(iter(mine))
    a.release(uid)
    assert b.claim(uid)
    a.close()
    assert len({b.allocate(), b.allocate()}) == 2
    b.close()


def test_claim_outside_range_refused(tmp_path: Path) -> None:
    o = OwnerUids(700000, 4, lock_file=tmp_path / "lock")
    assert not o.claim(0) and not o.claim(700004)
    assert o.claim(700001) and o.claim(700001)  # idempotent
    assert o.held() == {700001}
    o.close()


def test_namespace_owner_of_this_process() -> None:
    assert namespace_owner(os.getpid()) == 0  # the initial namespace belongs to root
    assert namespace_owner(2**22 + 12345) is None


def test_config_keeps_owners_out_of_the_mapped_range() -> None:
    from pydantic import ValidationError

    from corral.backends.config import ContainerConfig
    from corral.node import NodeConfig

    cfg = NodeConfig()
    assert cfg.owner_first(cfg.backends[0]) == 165536
    with pytest.raises(ValidationError, match="overlap the mapped sandbox ids"):
        NodeConfig(backends=[{"kind": "container", "owner_uid": 150000}])
    small = ContainerConfig(owner_uid=20000, owner_uids=1000)
    assert NodeConfig(backends=[small]).owner_first(small) == 20000


def test_config_joins_the_node_made_user_namespace() -> None:
    from corral.backends import oci
    from corral.spec import Limits

    base = dict(
        rootfs=Path("/srv/sb/rootfs"),
        init_host_path=Path("/opt/init"),
        hostname="sandbox",
        cgroups_path="/corral/sb-x",
        limits=Limits(),
        userns_path=Path("/proc/self/fd/4"),
    )
    crun = oci.build_config(**base)  # type: ignore[arg-type]
    assert {"type": "user", "path": "/proc/self/fd/4"} in crun["linux"]["namespaces"]
    assert "uidMappings" not in crun["linux"] and oci.joins_userns(crun)
    runc = oci.build_config(**base, userns_mappings=True)  # type: ignore[arg-type]
    assert runc["linux"]["uidMappings"][0]["hostID"] == 100000 and oci.joins_userns(runc)
    # runc cannot join a host-owned netns from inside a joined userns: it makes its own
    netns = oci.build_config(**base, userns_mappings=True, net_ns="/run/netns/x")  # type: ignore[arg-type]
    assert not oci.joins_userns(netns)
    assert oci.take_rlimits(runc) and "rlimits" not in runc["process"]


def test_uids_are_spread_over_lock_shards(tmp_path: Path) -> None:
    """Each uid's lock lives in its shard's file, so another allocator sees it there."""
    from corral.host.owners import SHARDS

    a = OwnerUids(800000, SHARDS * 2, lock_file=tmp_path / "lock")
    held = {a.allocate() for _ in range(SHARDS * 2)}
    assert len(held) == SHARDS * 2
    assert len(list(tmp_path.glob("lock.*"))) == SHARDS
    b = OwnerUids(800000, SHARDS * 2, lock_file=tmp_path / "lock")
    assert not any(b.claim(u) for u in held)
    a.release(800000 + SHARDS + 1)
    assert b.claim(800000 + SHARDS + 1)
    a.close()
    b.close()
