"""The qgroup limit behind Limits.disk: the quota plus a bounded metadata allowance."""

from __future__ import annotations

from corral.host.btrfs import METADATA_ALLOWANCE_MAX, METADATA_ALLOWANCE_MIN, qgroup_limit

MIB, GIB = 1 << 20, 1 << 30


def test_allowance_is_a_quarter_within_bounds() -> None:
    assert qgroup_limit(16 * MIB) == 16 * MIB + METADATA_ALLOWANCE_MIN  # small: the minimum
    assert qgroup_limit(1 * GIB) == 1 * GIB + 256 * MIB  # a quarter
    assert qgroup_limit(64 * GIB) == 64 * GIB + METADATA_ALLOWANCE_MAX  # large: the cap
    for quota in (MIB, 300 * MIB, 3 * GIB, 100 * GIB):
        assert quota + METADATA_ALLOWANCE_MIN <= qgroup_limit(quota)
        assert qgroup_limit(quota) <= quota + METADATA_ALLOWANCE_MAX
