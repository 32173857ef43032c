"""Debian base layers carry a neutral hostname, never the build host's."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from corral.images import build


def debian_tree(root: Path, hosts: str | None) -> Path:
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hostname").write_text(socket.gethostname() + "\n")  # as mmdebstrap copies
    (root / "etc" / "resolv.conf").write_text("nameserver 10.0.0.53\n")
    if hosts is not None:
        (root / "etc" / "hosts").write_text(hosts)
    return root


def test_build_host_name_is_replaced(tmp_path: Path) -> None:
    me = socket.gethostname()
    root = debian_tree(tmp_path, f"127.0.0.1 localhost\n127.0.1.1 {me}  # build host\n")
    build._clean_debian_tree(root)
    assert (root / "etc/hostname").read_text() == "sandbox\n"
    hosts = (root / "etc/hosts").read_text()
    assert hosts == build.NEUTRAL_HOSTS and me not in hosts.split()
    assert "localhost" in hosts and "sandbox" in hosts
    assert (root / "etc/resolv.conf").read_text() == build.RESOLV_CONF_PLACEHOLDER
    assert os.stat(root / "etc/hostname").st_mode & 0o777 == 0o644


def test_missing_hosts_is_written_and_a_neutral_one_kept(tmp_path: Path) -> None:
    root = debian_tree(tmp_path / "a", None)  # minbase: no netbase, no /etc/hosts
    build._clean_debian_tree(root)
    assert (root / "etc/hosts").read_text() == build.NEUTRAL_HOSTS
    own = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n"
    root = debian_tree(tmp_path / "b", own)
    build._clean_debian_tree(root)
    assert (root / "etc/hosts").read_text() == own


def test_symlinked_hostname_is_replaced_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text("host file\n")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hostname").symlink_to(outside)
    build._clean_debian_tree(root)
    assert outside.read_text() == "host file\n"
    assert (root / "etc/hostname").read_text() == "sandbox\n"
    assert not (root / "etc/hostname").is_symlink()
