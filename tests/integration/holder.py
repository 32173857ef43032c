"""The guest program the pause tests park: a process holding 64 MiB of random bytes, which
appends their sha256 to /tmp/sums at start and on SIGUSR1 (hashing reads every page of the
buffer, so a checksum after a resume proves the memory came back intact)."""

HOLDER = r"""
import hashlib, os, signal, time
buf = bytearray(os.urandom(64 << 20))
def report(*_):
    with open("/tmp/sums", "a") as f:
        f.write(hashlib.sha256(buf).hexdigest() + "\n")
signal.signal(signal.SIGUSR1, report)
open("/tmp/holder.pid", "w").write(str(os.getpid()))
report()
while True:
    time.sleep(3600)
"""
