"""Capabilities given to a container sandbox's processes.

The guest is root inside its user namespace, so these capabilities only ever act on
objects owned by the sandbox's id range (host uid 100000 + 0..65535): a capability here
is never a capability over the host. They are still kept minimal, because each one widens
what a hostile guest can do to the kernel and to its own sandbox's plumbing (PID 1).

Bounding = effective = permitted = :data:`GUEST_CAPS`; inheritable and ambient are empty,
and ``no_new_privs`` is set, so neither setuid binaries nor file capabilities can add
anything on exec.

Example:
    >>> "CAP_SYS_ADMIN" in GUEST_CAPS
    False
    >>> hex(cap_mask(GUEST_CAPS))
    '0x4fb'
"""

from __future__ import annotations

__all__ = ["GUEST_CAPS", "CAP_NUMBERS", "cap_mask", "oci_capabilities"]

# Kernel capability numbers (include/uapi/linux/capability.h) of the ones we mention.
CAP_NUMBERS: dict[str, int] = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_DAC_READ_SEARCH": 2,
    "CAP_FOWNER": 3,
    "CAP_FSETID": 4,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
    "CAP_SETPCAP": 8,
    "CAP_NET_BIND_SERVICE": 10,
    "CAP_NET_RAW": 13,
    "CAP_SYS_CHROOT": 18,
    "CAP_SYS_PTRACE": 19,
    "CAP_SYS_ADMIN": 21,
    "CAP_MKNOD": 27,
    "CAP_AUDIT_WRITE": 29,
    "CAP_SETFCAP": 31,
}

# Docker's default set is CHOWN DAC_OVERRIDE FSETID FOWNER MKNOD NET_RAW SETGID SETUID
# SETFCAP SETPCAP NET_BIND_SERVICE SYS_CHROOT KILL AUDIT_WRITE. We keep what a root user
# installing packages (apt-get/dpkg, pip, npm) and corral-init need, and drop the rest:
GUEST_CAPS: tuple[str, ...] = (
    # dpkg/tar/pip restore file ownership (e.g. /var/cache/apt/archives/partial is _apt's).
    "CAP_CHOWN",
    # root writes and reads files whatever their mode (dpkg replacing 0444 files, /etc/shadow).
    "CAP_DAC_OVERRIDE",
    # chmod/utime/xattrs on files root does not own (tar -p, dpkg, cp -a).
    "CAP_FOWNER",
    # keep setuid/setgid bits on files while they are written or chowned (dpkg installing
    # /usr/bin/passwd); harmless under no_new_privs, but packages expect the bits to stick.
    "CAP_FSETID",
    # signal processes of other uids: apt kills its _apt-run methods, build tools kill workers.
    "CAP_KILL",
    # corral-init switches to the exec's uid/gid/groups; apt drops to _apt; su, runuser.
    "CAP_SETGID",
    "CAP_SETUID",
    # test servers on ports < 1024; only inside the sandbox's own network namespace.
    "CAP_NET_BIND_SERVICE",
)
# Dropped, and why:
#   MKNOD       device nodes cannot be used (devices cgroup; the kernel also requires MKNOD in
#               the initial user namespace) and should never appear in an upper layer the node
#               reads on the host side. FIFOs and sockets need no capability.
#   NET_RAW     raw/packet sockets: spoofing on the sandbox's veth, a long CVE history.
#   SETFCAP     file capabilities do nothing under no_new_privs; postinst scripts that call
#               setcap (iputils-ping) fall back to a setuid bit.
#   SETPCAP     only needed to shrink the bounding set, which is already minimal.
#   SYS_CHROOT  rarely needed by agent tasks; removes one classic escape building block.
#   AUDIT_WRITE audit is not namespaced: the capability is useless in a user namespace.
#   SYS_PTRACE, DAC_READ_SEARCH, SYS_ADMIN ... never: PID 1 holds the control socket.


def cap_mask(caps: tuple[str, ...] | list[str]) -> int:
    """Bit mask of ``caps`` as shown in /proc/<pid>/status (CapEff, CapBnd ...)."""
    mask = 0
    for cap in caps:
        mask |= 1 << CAP_NUMBERS[cap]
    return mask


def oci_capabilities(caps: tuple[str, ...] = GUEST_CAPS) -> dict[str, list[str]]:
    """The OCI ``process.capabilities`` object: ``caps`` in bounding/effective/permitted."""
    names = list(caps)
    return {
        "bounding": names,
        "effective": list(names),
        "permitted": list(names),
        "inheritable": [],
        "ambient": [],
    }
