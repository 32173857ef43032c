"""Test hosts for network tests, each in its own network namespace (no internet needed).

``TestHosts`` creates, and removes on exit:
  * ``pkgs.test`` (10.250.1.2): a PyPI-style simple index over HTTP with one small wheel
    (``tinypkg``) built here, and a bulk file for throughput measurements;
  * ``npm.test`` (10.250.2.2): another HTTP server (a different body);
  * a DNS resolver (10.250.3.2) that knows both names (dnslib), logging every query it
    gets to a file, so a test can tell whether a sandbox's query reached it.
Each namespace hangs off the host by a veth ``ctn<TAG><i>`` (10.250.i.1 on the host side,
forwarding enabled on that interface only). Only these addresses are ever targeted.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from corral.bench.netns_host import NetnsHost, wait_port
from tests.conftest import TAG

PKGS_IP, NPM_IP, DNS_IP = "10.250.1.2", "10.250.2.2", "10.250.3.2"
NAMES = {"pkgs.test": PKGS_IP, "npm.test": NPM_IP}
BULK_SIZE = 64 << 20

_DNS_SERVER = r"""
import socket, sys
from dnslib import A, QTYPE, RCODE, RR, DNSRecord
names = dict(a.split("=") for a in sys.argv[2].split(","))
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 53))
log = open(sys.argv[3], "a", buffering=1)  # its existence says: bound, ready
while True:
    data, addr = s.recvfrom(4096)
    try:
        q = DNSRecord.parse(data)
    except Exception:
        continue
    name = str(q.q.qname).rstrip(".")
    log.write(f"{addr[0]} {name} {QTYPE.get(q.q.qtype)}\n")
    r = q.reply()
    if name in names and q.q.qtype == QTYPE.A:
        r.add_answer(RR(q.q.qname, QTYPE.A, rdata=A(names[name]), ttl=60))
    elif name not in names:
        r.header.rcode = RCODE.NXDOMAIN
    s.sendto(r.pack(), addr)
"""


def build_wheel(dst: Path, name: str = "tinypkg", version: str = "1.0") -> Path:
    """A minimal pure-Python wheel (PEP 427) whose module prints a marker."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"MARKER = 'installed-from-pkgs-test'\n__version__ = '{version}'\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: corral-tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    out = dst / f"{name}-{version}-py3-none-any.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for path, text in files.items():
            z.writestr(path, text)
    out.write_bytes(buf.getvalue())
    return out


class TestHosts:
    __test__ = False  # not a pytest class

    def __init__(self) -> None:
        self.prefix = f"corral-test{TAG}"
        self.hosts = {
            k: NetnsHost(
                ns=f"{self.prefix}-{k}",
                veth=f"ctn{TAG}{i}",
                host_ip=f"10.250.{i}.1",
                ip=f"10.250.{i}.2",
                default_route=True,
            )
            for i, k in enumerate(("pkgs", "npm", "dns"), 1)
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self.dir = Path(tempfile.mkdtemp(prefix="corral-nethosts-"))
        self.dns_log = self.dir / "dns.log"

    def __enter__(self) -> TestHosts:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        self.close(quiet=True)  # leftovers of a crashed run
        self.dir.mkdir(exist_ok=True)
        for host in self.hosts.values():
            host.up()
        # pkgs.test: /simple/tinypkg/ -> the wheel, /bulk -> BULK_SIZE bytes
        root = self.dir / "pkgs"
        (root / "simple" / "tinypkg").mkdir(parents=True)
        (root / "packages").mkdir()
        wheel = build_wheel(root / "packages")
        sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
        (root / "simple" / "index.html").write_text('<a href="tinypkg/">tinypkg</a>\n')
        (root / "simple" / "tinypkg" / "index.html").write_text(
            f'<a href="../../packages/{wheel.name}#sha256={sha}">{wheel.name}</a>\n'
        )
        with open(root / "bulk", "wb") as f:
            f.truncate(BULK_SIZE)
        npm = self.dir / "npm"
        npm.mkdir()
        (npm / "index.html").write_text("npm-test-secret\n")
        self.procs.append(self.hosts["pkgs"].serve_http(root))
        self.procs.append(self.hosts["npm"].serve_http(npm))
        script = self.dir / "dns.py"
        script.write_text(_DNS_SERVER)
        names = ",".join(f"{k}={v}" for k, v in NAMES.items())
        dns = [sys.executable, str(script), DNS_IP, names, str(self.dns_log)]
        self.procs.append(self.hosts["dns"].spawn(dns))
        for ip in (PKGS_IP, NPM_IP):
            if not wait_port(ip, 80):
                raise RuntimeError(f"test host {ip}:80 did not come up")
        deadline = time.monotonic() + 10
        while not self.dns_log.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the server creates its log once its socket is bound

    def dns_queries(self) -> list[str]:
        try:
            return self.dns_log.read_text().splitlines()
        except OSError:
            return []

    def close(self, quiet: bool = False) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.kill()
            with contextlib.suppress(Exception):
                p.wait(timeout=5)
        self.procs.clear()
        for host in self.hosts.values():
            host.down()
        if not quiet:
            shutil.rmtree(self.dir, ignore_errors=True)
        elif self.dir.exists():
            for child in self.dir.iterdir():
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink()


def network_config(**kw: object):  # type: ignore[no-untyped-def]
    """The node network of the tests: permissions for the test hosts only."""
    from corral.policy.network import NetworkConfig, Permission

    base: dict[str, object] = dict(
        subnet="10.212.0.0/22",
        upstream=[DNS_IP],
        uplinks=[],  # the test hosts' veths have forwarding on already
        deny_window=2.0,
        permissions={
            "pkgs": Permission(hosts=["pkgs.test"], ports=[80]),
            "npm": Permission(hosts=["npm.test", "*.npm.test"], ports=[80]),
            "pkgsip": Permission(cidrs=[f"{PKGS_IP}/32"], ports=[80]),
        },
    )
    base.update(kw)
    return NetworkConfig(**base)  # type: ignore[arg-type]


# busybox-static's wget crashes in static glibc's resolver: nslookup (its own DNS
# client) for the address, nc for the request.
_HTTP = r"""
B=/.corral/busybox
case "$1" in
  *[!0-9.]*) ip=$($B nslookup "$1" 2>/dev/null | $B awk '/^Address: /{print $2}' | $B tail -n1);;
  *) ip=$1;;
esac
[ -n "$ip" ] || { echo "no address for $1"; exit 4; }
printf 'GET %s HTTP/1.0\r\nHost: %s\r\n\r\n' "$2" "$1" | $B nc -w 3 "$ip" 80
"""


async def guest_http(node, sid: str, host: str, path: str = "/") -> tuple[bool, str]:  # type: ignore[no-untyped-def]
    """GET http://host/path from inside a VM guest (microVM or desktop VM), with the
    busybox corral puts at /.corral/busybox: (a response came, what came)."""
    from corral.spec import ExecRequest

    cmd = ["/.corral/busybox", "sh", "-c", _HTTP, "http", host, path]
    r = await node.exec(sid, ExecRequest(cmd=cmd, timeout=30))
    out = (r.stdout + r.stderr).decode(errors="replace")
    return r.exit_code == 0 and out.startswith("HTTP/"), out
