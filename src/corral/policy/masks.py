"""Paths of /proc and /sys a container sandbox must not read or must not write.

The runtime (runc/crun) hides each of :data:`MASKED_PATHS` (``/dev/null`` bound over a file,
an empty read-only tmpfs over a directory) and bind-remounts each of :data:`READONLY_PATHS`
read-only. A path absent on the host kernel is skipped by the runtime.

Most files masked here are already unreadable to a user-namespaced root (they are mode 0400
owned by the initial namespace's root), but masking does not depend on that staying true:
it is a second layer, and it also hides the files from ``ls`` and guesswork.

Example:
    >>> "/proc/kcore" in MASKED_PATHS
    True
"""

from __future__ import annotations

__all__ = ["MASKED_PATHS", "READONLY_PATHS"]

MASKED_PATHS: tuple[str, ...] = (
    # Docker's default list.
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",  # physical memory image
    "/proc/keys",  # keys of every keyring the caller may view, kernel-wide
    "/proc/latency_stats",
    "/proc/timer_list",  # host timers with pids and functions
    "/proc/timer_stats",
    "/proc/sched_debug",  # every task on the host with its command
    "/proc/scsi",
    "/sys/firmware",  # ACPI tables, EFI variables, DMI
    "/sys/devices/virtual/powercap",  # RAPL energy counters: a power side channel
    # Added for corral: page-level views of host memory (row-hammer and side-channel aids).
    "/proc/kpagecgroup",
    "/proc/kpageflags",
    "/proc/kpagecount",
    # Kernel layout and configuration: precise exploit targeting.
    "/proc/kallsyms",
    "/proc/config.gz",
    "/proc/vmallocinfo",
    "/proc/slabinfo",  # heap-spray feedback
    "/proc/pagetypeinfo",
    "/proc/iomem",
    "/proc/ioports",
    "/proc/kmsg",  # kernel log of the whole host
    # Found by tests/redteam (proc_sys_walk): world-readable on the host and in Docker.
    # The host's boot command line (root device, hypervisor agent flags, sometimes tokens).
    "/proc/cmdline",
    # Physical address of the kernel's vmcoreinfo note: defeats physical KASLR.
    "/sys/kernel/vmcoreinfo",
    # Writing a letter here is a host-wide action (reboot, OOM kill, sync).
    "/proc/sysrq-trigger",
    # Only present if the host has them mounted inside sysfs and /sys is bound, not mounted.
    "/sys/kernel/debug",
    "/sys/kernel/tracing",
    "/sys/kernel/security",
    "/sys/fs/bpf",
    # Host-wide memory pressure knobs and page idle tracking (side channel).
    "/sys/kernel/mm/page_idle",
)

READONLY_PATHS: tuple[str, ...] = (
    # Docker's default list (it lists /proc/sysrq-trigger too; we mask it instead).
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",  # sysctls: only a few are namespaced; none are the guest's to change
)
# /sys itself is mounted read-only by the OCI config (see corral.backends.oci), so it is not
# repeated here: a read-only bind over a read-only sysfs would only add a mount.
