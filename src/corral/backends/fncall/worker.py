"""The warm worker of an fncall pool sandbox (runs *inside* the sandbox, stdlib only).

The node starts it once per pool sandbox as a long-lived exec of corral-init
(``python3 -I -c <this source> <config json>``) and speaks a framed protocol over its
stdin/stdout: no process start per call on the node's side.

Frames, both ways: ``u32 length (BE)`` · ``u32 header length`` · JSON header · raw payload.
Requests carry ``code`` then ``stdin`` as payload (``code_len`` in the header); replies
carry stdout then stderr (``out_len``). Ops: ``run``, ``build`` (compile, keep the artifact
for the following ``run``s), ``ping``.

Each call runs in a freshly forked child (python: the warm interpreter with the configured
modules imported, code ``exec``'d in a new ``__main__``; other languages: ``execve`` of the
language's command), which before running the code:
  - starts a new session (its process group is what the worker kills),
  - gets its stdin from a memfd (or /dev/null) and stdout/stderr on pipes,
  - sets rlimits (CPU, FSIZE, CORE; NPROC once it is the call uid) from the call's limits,
  - drops to the unprivileged call uid (so it cannot signal, ptrace or write anything of
    the worker, which runs as root of the sandbox),
  - closes the protocol fds (the call cannot talk to the node).
After the call the worker kills whatever of the call uid is left (``kill(-1)`` from a
helper running as that uid, which also removes the call's SysV IPC objects) and wipes the
scratch dirs (tmpfs mounts, /dev/shm, /dev/mqueue; the root filesystem is read-only). The
node then checks from the host (cgroup, tmpfs usage) that the sandbox is clean, and
recycles it when it is not: the worker's own cleanup is a first pass, never the guarantee.
"""

import ctypes
import gc
import json
import os
import resource
import select
import signal
import stat
import struct
import sys
import time
import traceback

_HDR = struct.Struct(">I")
_CHUNK = 65536


def _read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        b = os.read(fd, n - len(buf))
        if not b:
            raise EOFError
        buf += b
    return bytes(buf)


def _read_frame(fd):
    (n,) = _HDR.unpack(_read_exact(fd, 4))
    data = _read_exact(fd, n)
    hlen = _HDR.unpack(data[:4])[0]
    return json.loads(data[4 : 4 + hlen]), data[4 + hlen :]


def _write_frame(fd, header, *payloads):
    h = json.dumps(header, separators=(",", ":")).encode()
    body = _HDR.pack(len(h)) + h + b"".join(payloads)
    data = _HDR.pack(len(body)) + body
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class Worker:
    def __init__(self, cfg):
        self.cfg = cfg
        self.uid = int(cfg["uid"])
        self.gid = int(cfg["gid"])
        self.dirs = list(cfg["dirs"])
        self.workdir = cfg["workdir"]
        self.langs = cfg["languages"]
        self.env = dict(cfg["env"])
        self.artifact = None  # (language, bytes) of the last build kept for "run"
        self.dirty = False  # something the cleanup could not remove: never serve again
        # The protocol moves to private fds; 0/1/2 become /dev/null so nothing written to
        # sys.stdout by accident (or by a pre-imported module) corrupts the channel, and
        # a forked child inherits no way to reach the node.
        self.pin = os.dup(0)
        self.pout = os.dup(1)
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1):  # 2 stays: the worker's own diagnostics reach the node's log
            os.dup2(null, fd)
        os.close(null)
        os.set_inheritable(self.pin, False)
        os.set_inheritable(self.pout, False)
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.poll = select.poll()
        # The worker's own environment becomes the calls' (python calls inherit it with
        # the fork, at no cost per call; exec'd ones get it explicitly).
        os.environ.clear()
        os.environ.update(self.env)

    # ---------------------------------------------------------------- main loop
    def serve(self):
        for mod in self.cfg.get("preimport", []):
            __import__(mod)
        import shutil  # noqa: F401  (used by the cleanup; imported once, here)
        import types  # noqa: F401

        _warm(self.libc)
        # Everything imported so far is permanent: the collector never walks it, so a
        # forked call does not copy-on-write the worker's whole heap when it collects.
        gc.collect()
        gc.freeze()
        _write_frame(self.pout, {"ready": True, "pid": os.getpid()})
        while True:
            try:
                req, payload = _read_frame(self.pin)
            except EOFError:
                return
            op = req.get("op")
            if op == "ping":
                _write_frame(self.pout, {"ok": True})
                continue
            code = payload[: req["code_len"]]
            stdin = payload[req["code_len"] :]
            try:
                reply, out, err = self.call(op, req, code, stdin)
            except Exception:
                reply, out, err = {"status": "error"}, b"", traceback.format_exc().encode()
            reply["out_len"] = len(out)
            if self.dirty:
                reply["dirty"] = True
            _write_frame(self.pout, reply, out, err)

    # ---------------------------------------------------------------- one call
    def call(self, op, req, code, stdin):
        lang = self.langs.get(req["language"])
        if lang is None:
            return {"status": "error"}, b"", b"unknown language"
        if op == "build":
            return self._build(req, lang, code)
        if lang.get("compile"):
            if not self.artifact or self.artifact[0] != req["language"]:
                return {"status": "error"}, b"", b"no build kept for this language"
            self._put(lang["artifact"], self.artifact[1], 0o755)
            argv = lang["run"]
        elif lang.get("kind") == "python":
            argv = None
        else:
            self._put(lang["source"], code, 0o644)
            argv = lang["run"]
        reply, out, err = self._run(req["limits"], argv, code, stdin)
        self._clean()
        return reply, out, err

    def _build(self, req, lang, code):
        self.artifact = None
        self._put(lang["source"], code, 0o644)
        reply, out, err = self._run(req["limits"], lang["compile"], b"", b"")
        if reply["status"] == "exited" and reply["code"] == 0:
            try:
                self.artifact = (req["language"], self._read_artifact(lang["artifact"]))
            except OSError as e:
                reply = {"status": "exited", "code": 1, "wall": reply["wall"]}
                err += f"corral: the compiler left no {lang['artifact']}: {e}\n".encode()
        self._clean()
        return reply, out, err

    def _read_artifact(self, name):
        # The compiler ran as the call uid and could have left a symlink (to a file only
        # root may read) or a FIFO (to hang the worker) instead of a program.
        path = os.path.join(self.workdir, name)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise OSError(f"{name} is not a plain file")
            chunks = []
            while True:
                b = os.read(fd, 1 << 20)
                if not b:
                    return b"".join(chunks)
                chunks.append(b)
        finally:
            os.close(fd)

    def _put(self, name, data, mode):
        path = os.path.join(self.workdir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
        try:
            os.write(fd, data) if data else None
            os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def _run(self, limits, argv, code, stdin):
        cap = int(limits["output"])
        if stdin:
            sfd = os.memfd_create("stdin", 0)
            os.write(sfd, stdin)
            os.lseek(sfd, 0, os.SEEK_SET)
        else:
            sfd = os.open("/dev/null", os.O_RDONLY)
        ro, wo = os.pipe()
        re_, we = os.pipe()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            self._child(limits, argv, code, sfd, wo, we, (ro, re_))
        os.close(sfd)
        os.close(wo)
        os.close(we)
        pidfd = os.pidfd_open(pid)
        deadline = start + float(limits["wall"])
        poll = self.poll
        streams = {ro: 0, re_: 1}
        for fd in (ro, re_, pidfd):
            poll.register(fd, select.POLLIN)
        bufs = [bytearray(), bytearray()]
        total = [0, 0]
        status = None
        exited_at = None
        wstatus = None
        try:
            while streams or exited_at is None:
                now = time.monotonic()
                if exited_at is not None:
                    # The child ended; background processes may hold the pipes: read what
                    # is there for a moment, then stop (the cleanup kills them).
                    left = exited_at + 0.05 - now
                    if left <= 0:
                        break
                else:
                    left = deadline - now
                    if left <= 0:
                        status = "timeout"
                        break
                for fd, _ in poll.poll(left * 1000 + 1):
                    if fd == pidfd:
                        _, wstatus = os.waitpid(pid, 0)
                        exited_at = time.monotonic()
                        poll.unregister(pidfd)
                        continue
                    b = os.read(fd, _CHUNK)
                    if not b:
                        poll.unregister(fd)
                        del streams[fd]
                        continue
                    i = streams[fd]
                    total[i] += len(b)
                    room = cap - len(bufs[i])
                    if room > 0:
                        bufs[i] += b[:room]
                    if total[i] > cap:
                        status = "output_limit"
                if status == "output_limit":
                    break
        finally:
            for fd in (*streams, pidfd):
                try:
                    poll.unregister(fd)
                except KeyError:
                    pass
            os.close(ro)
            os.close(re_)
        if wstatus is None:
            _killpg(pid)
            _, wstatus = os.waitpid(pid, 0)
        os.close(pidfd)
        wall = (exited_at or time.monotonic()) - start
        reply = {
            "status": status or ("exited" if os.WIFEXITED(wstatus) else "signaled"),
            "code": os.WEXITSTATUS(wstatus) if os.WIFEXITED(wstatus) else None,
            "signal": os.WTERMSIG(wstatus) if os.WIFSIGNALED(wstatus) else None,
            "wall": wall,
            "out_trunc": total[0] > cap,
            "err_trunc": total[1] > cap,
        }
        return reply, bytes(bufs[0]), bytes(bufs[1])

    def _child(self, limits, argv, code, memfd, wo, we, close):
        try:
            os.setsid()
            os.dup2(memfd, 0)
            os.dup2(wo, 1)
            os.dup2(we, 2)
            for fd in (memfd, wo, we, self.pin, self.pout, *close):
                os.close(fd)
            cpu = max(1, int(-(-float(limits["cpu"]) // 1)))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(limits["fsize"]),) * 2)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.setgroups([])
            os.setgid(self.gid)
            os.setuid(self.uid)
            # The uid change made the process non-dumpable (its /proc files root's):
            # the call owns itself again; the worker stays non-dumpable.
            self.libc.prctl(4, 1, 0, 0, 0)
            # As the call uid: RLIMIT_NPROC counts that uid's processes, which are the call's.
            resource.setrlimit(resource.RLIMIT_NPROC, (int(limits["nproc"]),) * 2)
            os.chdir(self.workdir)
            if argv is not None:
                signal.signal(signal.SIGPIPE, signal.SIG_DFL)
                os.execve(_which(argv[0], self.env), argv, self.env)
            self._python(code)
        except BaseException:
            try:
                os.write(2, traceback.format_exc().encode())
            finally:
                os._exit(126)

    def _python(self, code):
        import types

        main = types.ModuleType("__main__")
        main.__file__ = os.path.join(self.workdir, "main.py")
        sys.modules["__main__"] = main
        sys.argv = [main.__file__]
        rc = 0
        try:
            exec(compile(code, "main.py", "exec"), main.__dict__)
        except SystemExit as e:
            c = e.code
            if c is None:
                rc = 0
            elif isinstance(c, int):
                rc = c & 0xFF
            else:
                print(c, file=sys.stderr)
                rc = 1
        except BaseException:
            traceback.print_exc()
            rc = 1
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except BaseException:
                rc = rc or 1
        os._exit(rc)

    # ---------------------------------------------------------------- cleanup
    def _clean(self):
        ipc = self._ipc_ids()
        if ipc or self._leftovers():
            # A helper as the call uid kills every process of that uid (kill(-1) skips
            # only the sender), atomically with respect to the call forking more, then
            # removes the SysV IPC objects the call made: as their owner, since the
            # sandbox's root has no CAP_IPC_OWNER/CAP_SYS_ADMIN to remove others'.
            h = os.fork()
            if h == 0:
                try:
                    os.setgroups([])
                    os.setgid(self.gid)
                    os.setuid(self.uid)
                    for _ in range(50):
                        try:
                            os.kill(-1, signal.SIGKILL)
                        except ProcessLookupError:
                            break
                    for kind, i in ipc:
                        if kind == "shm":
                            self.libc.shmctl(i, 0, None)  # IPC_RMID
                        elif kind == "msg":
                            self.libc.msgctl(i, 0, None)
                        else:
                            self.libc.semctl(i, 0, 0)
                finally:
                    os._exit(0)
            os.waitpid(h, 0)
            if self._ipc_ids():
                self.dirty = True  # the node recycles the sandbox
        for d in self.dirs:
            _wipe(d)

    def _leftovers(self):
        me = os.getpid()
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) not in (1, me):
                return True
        return False

    def _ipc_ids(self):
        ids = []
        for kind in ("shm", "msg", "sem"):
            try:
                with open(f"/proc/sysvipc/{kind}", "rb") as f:
                    lines = f.read().splitlines()[1:]
            except OSError:
                continue
            ids.extend((kind, int(line.split()[1])) for line in lines if line.strip())
        return ids


_WARM_SOURCE = r"""
import sys
from os import path as _p
def f(a, *args, b=1, **kw):
    "doc"
    x = [i * 2 for i in range(a) if i % 3]
    y = {k: v for k, v in kw.items()}
    try:
        s = f"{a!r:>4} {b:.2f}" + "x" % ()
    except (ValueError, TypeError) as e:
        raise RuntimeError(str(e)) from None
    finally:
        pass
    while a > 0 and not x:
        a -= 1
    return lambda z: (x, y, s, z, a @ b if a else -b)
class C(object):
    n: int = 0
    async def g(self):
        async with self as c:
            async for i in c:
                yield await i
with open(__file__) as fh:
    data = fh.read().split()
for i, w in enumerate(sorted(set(data))):
    print(i, w, sep=" ", end="\n", file=sys.stderr)
if __name__ == "__main__":
    print(sum(map(int, input().split())))
"""


def _warm(libc):
    """Run, once in the worker, what every forked call would otherwise run first.

    A call's child starts as a copy-on-write image of the worker: each page it writes
    costs a fault and a page copy. The first ``compile()`` in a process sets up the
    parser's and compiler's state and grows the allocator's heap, which measured here
    cost a child ~200 of its ~400 faults and ~1.3 ms of its ~2.5 ms CPU; the first call
    of a ctypes function builds and caches its function object (~60 faults). Done here,
    the children share the result. Only this fixed source is compiled in the worker: the
    calls' own code is compiled in their children, never by the (privileged) worker.
    """
    try:
        for _ in range(3):
            compile(_WARM_SOURCE, "main.py", "exec")
        compile("print(1)", "main.py", "exec")
    except SyntaxError:  # a guest python too old for some of it: only slower calls
        pass
    libc.prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE: caches libc.prctl, warms the call path


def _killpg(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wipe(d):
    try:
        entries = list(os.scandir(d))
    except OSError:
        return
    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                import shutil

                shutil.rmtree(e.path, ignore_errors=True)
            else:
                os.unlink(e.path)
        except OSError:
            pass


def _which(name, env):
    if "/" in name:
        return name
    for d in env.get("PATH", "/usr/bin:/bin").split(":"):
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return name


def main():
    cfg = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no ptrace of the worker, ever
    Worker(cfg).serve()


if __name__ == "__main__":
    main()
