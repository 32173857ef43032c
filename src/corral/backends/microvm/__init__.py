"""MicroVM sandboxes: QEMU ``-M microvm`` with a Debian kernel, the image's EROFS layers as
read-only disks, a writable disk in the sandbox's scratch subvolume, and corral-init as the
guest's PID 1 reached over a virtio-serial port (see :mod:`.backend`)."""
