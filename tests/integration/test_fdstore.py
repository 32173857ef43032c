"""The seccomp fd holder (corral.host.fdstore) on its own: a real corral-fdstore process.

Pipes stand in for notification fds here (the holder treats every fd alike); the seccomp
path end to end is tests/redteam/test_seccomp_after_restart.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.host import fdstore, leaks
from corral.host.fdstore import FdStore
from tests.conftest import TAG

RUN = Path(f"/run/corral-test{TAG}-fdstore")
BIN = Path(f"/var/lib/corral-test{TAG}-fdstore-bin")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs as root (like the node)")


@pytest.fixture
def run_dir() -> Iterator[Path]:
    RUN.mkdir(parents=True, exist_ok=True)
    try:
        yield RUN
    finally:
        fdstore.end_stale(RUN)
        shutil.rmtree(RUN, ignore_errors=True)
        shutil.rmtree(BIN, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_fds_come_back_to_the_next_agent_and_the_holder_leaves_when_empty(run_dir: Path) -> None:
    store, handed = FdStore.open(run_dir, BIN)
    assert handed == {}
    pid = store.pid
    assert pid is not None and fdstore.is_holder(pid, run_dir)
    sock = run_dir / fdstore.SOCK_NAME
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert os.getsid(pid) == pid  # its own session: not the agent's process group
    assert leaks.fd_holders([run_dir]) == [f"{pid} {sock}"]
    r, w = os.pipe()
    store.put("sb-a", r)
    store.put("sb-a", w)
    r2, w2 = os.pipe()
    store.put("sb-b", r2)
    os.close(r), os.close(r2)
    store.close()  # it keeps fds: it stays
    time.sleep(0.2)
    assert _alive(pid)

    store, handed = FdStore.open(run_dir, BIN)  # "the next agent"
    assert store.pid == pid
    assert sorted(handed) == ["sb-a", "sb-b"] and len(handed["sb-a"]) == 2
    os.write(w2, b"same pipe")
    assert os.read(handed["sb-b"][0], 64) == b"same pipe"  # the very file, not a copy
    assert store.ping()
    store.drop("sb-a")
    assert store.held() == {"sb-b"}
    for fds in handed.values():
        for fd in fds:
            os.close(fd)
    store.drop("sb-b")
    os.close(w2)
    store.close()  # nothing kept: the holder exits and its files go
    assert not _alive(pid)
    assert not sock.exists() and not (run_dir / fdstore.PID_NAME).exists()
    assert leaks.fd_holders([run_dir]) == []


def test_an_unreachable_holder_is_ended_by_its_recorded_pid(run_dir: Path) -> None:
    store, _ = FdStore.open(run_dir, BIN)
    pid = store.pid
    assert pid is not None
    r, w = os.pipe()
    store.put("sb-a", r)
    os.close(r)
    store.close()
    (run_dir / fdstore.SOCK_NAME).unlink()  # e.g. the run dir was wiped: nobody can reach it
    store, handed = FdStore.open(run_dir, BIN)
    try:
        assert handed == {}
        assert not _alive(pid)  # ended, and a new holder took its place
        assert store.pid not in (None, pid) and fdstore.is_holder(store.pid, run_dir)
        # The pipe's read end is closed everywhere now: the old holder really let go.
        with pytest.raises(BrokenPipeError):
            os.write(w, b"x")
    finally:
        os.close(w)
        store.close()


def test_a_new_holder_is_recognised_as_soon_as_open_returns(run_dir: Path) -> None:
    # Right after posix_spawn the child's /proc/PID/cmdline can still read empty (its argv is
    # set after the exec has released the parent): open waits for the holder's answer, so
    # end_stale can always tell it is the holder. Several starts, since the window is short.
    for _ in range(20):
        store, _ = FdStore.open(run_dir, BIN)
        try:
            assert store.pid is not None and fdstore.holder_pid(run_dir) == store.pid
        finally:
            store.close()
        assert not _alive(store.pid)


def test_end_stale_checks_the_process_not_just_the_pid(run_dir: Path) -> None:
    # A pid file naming a process that is not a holder of this run dir: never signalled.
    victim = os.posix_spawn("/bin/sleep", ["sleep", "30"], {})
    try:
        start = fdstore._starttime(victim)
        (run_dir / fdstore.PID_NAME).write_text(f"{victim} {start}\n")
        assert fdstore.holder_pid(run_dir) is None
        assert fdstore.end_stale(run_dir) is None
        assert _alive(victim)
    finally:
        os.kill(victim, signal.SIGKILL)
        os.waitpid(victim, 0)


def test_only_its_own_uid_is_served(run_dir: Path) -> None:
    store, _ = FdStore.open(run_dir, BIN)
    try:
        store.close()  # empty: it exits; start one that keeps something for the check
        store, _ = FdStore.open(run_dir, BIN)
        r, w = os.pipe()
        store.put("sb-a", r)
        os.close(r)
        store.close()
        path = str(run_dir / fdstore.SOCK_NAME)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 1
            try:
                os.setresuid(65534, 65534, 65534)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                try:
                    s.connect(path)
                except PermissionError:
                    code = 0  # the 0600 socket: refused before the holder sees it
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        store, handed = FdStore.open(run_dir, BIN)
        assert list(handed) == ["sb-a"]
        for fd in handed["sb-a"]:
            os.close(fd)
        store.drop("sb-a")
    finally:
        os.close(w)
        store.close()
