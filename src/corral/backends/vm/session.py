"""The X session of a desktop VM, started by the node through the guest agent.

corral-init stays PID 1 (exec and files work as in microVMs); once it answers, the node
runs :data:`START` with one exec (``sh -c START corral-desktop WIDTH HEIGHT``): it writes an
xorg.conf, starts Xorg (modesetting on the ``bochs`` DRM device), the openbox window
manager and an xterm, each in a session of its own (so the exec's end does not take
them along), and returns once the terminal has the keyboard focus (keys typed then
reach it; ``xdotool`` asks the window manager for it); on failure it exits non-zero with
the X server's last log lines. The image needs ``corral image build debian
--desktop`` (corral.images.build.DESKTOP_PACKAGES).

No udev runs in the guest, so the X server does not discover input devices by itself:
every ``/dev/input/event*`` (the virtio keyboard and tablet) gets an ``evdev``
InputDevice section, with hotplug off.
"""

from __future__ import annotations

__all__ = ["DIR", "START"]

DIR = "/tmp/.corral-desktop"
"""Where the session keeps its config, logs and readiness marker, in the guest."""

START = r"""
W=$1 H=$2 D=/tmp/.corral-desktop
export DISPLAY=:0 HOME=/root
mkdir -p "$D" /tmp/.X11-unix && chmod 1777 /tmp/.X11-unix || exit 1
fail() { echo "corral-desktop: $*"; tail -n 15 "$D/Xorg.log" 2>/dev/null; exit 1; }
command -v Xorg >/dev/null || fail "no Xorg in the image (build it with --desktop)"
# The guest boots with lo down; the browser's helpers (dillo's dpid) talk over it.
/.corral/busybox ip link set lo up 2>/dev/null
i=0
while [ ! -e /dev/dri/card0 ] || ! ls /dev/input/event* >/dev/null 2>&1; do
  i=$((i + 1)); [ $i -gt 300 ] && fail "no /dev/dri/card0 or /dev/input/event* (guest drivers)"
  sleep 0.1
done
{
  echo 'Section "ServerFlags"'
  for o in AutoAddDevices AutoEnableDevices; do echo "  Option \"$o\" \"false\""; done
  for o in BlankTime StandbyTime SuspendTime OffTime; do echo "  Option \"$o\" \"0\""; done
  echo 'EndSection'
  echo 'Section "Device"'
  echo '  Identifier "card"'
  echo '  Driver "modesetting"'
  echo '  Option "kmsdev" "/dev/dri/card0"'
  echo '  Option "AccelMethod" "none"'
  echo 'EndSection'
  echo 'Section "Monitor"'
  echo '  Identifier "monitor"'
  echo "  Option \"PreferredMode\" \"${W}x${H}\""
  echo 'EndSection'
  echo 'Section "Screen"'
  echo '  Identifier "screen"'
  echo '  Device "card"'
  echo '  Monitor "monitor"'
  echo '  DefaultDepth 24'
  echo 'EndSection'
  n=0
  for e in /dev/input/event*; do
    echo "Section \"InputDevice\""
    echo "  Identifier \"in$n\""
    echo "  Driver \"evdev\""
    echo "  Option \"Device\" \"$e\""
    echo 'EndSection'
    n=$((n + 1))
  done
  echo 'Section "ServerLayout"'
  echo '  Identifier "layout"'
  echo '  Screen "screen"'
  k=0
  while [ $k -lt $n ]; do echo "  InputDevice \"in$k\""; k=$((k + 1)); done
  echo 'EndSection'
} > "$D/xorg.conf"
setsid Xorg :0 -config "$D/xorg.conf" -nolisten tcp -noreset -ac -novtswitch vt1 \
  -logfile "$D/Xorg.log" </dev/null >"$D/Xorg.out" 2>&1 &
xpid=$!
i=0
until xdpyinfo >/dev/null 2>&1; do
  kill -0 $xpid 2>/dev/null || fail "Xorg exited"
  i=$((i + 1)); [ $i -gt 1200 ] && fail "Xorg did not answer within 120 s"
  sleep 0.1
done
xrandr -s "${W}x${H}" >/dev/null 2>&1
xsetroot -solid '#2e5a88'
setsid openbox </dev/null >"$D/openbox.log" 2>&1 &
i=0
until xprop -root _NET_SUPPORTING_WM_CHECK 2>/dev/null | grep -q "# 0x"; do
  i=$((i + 1)); [ $i -gt 1200 ] && fail "the window manager did not start within 120 s"
  sleep 0.1
done
rm -f "$D/xterm-ready"
setsid xterm -geometry 100x30+40+40 -e /bin/bash -c "touch $D/xterm-ready; exec /bin/bash" \
  </dev/null >"$D/xterm.log" 2>&1 &
i=0
until [ -e "$D/xterm-ready" ]; do
  i=$((i + 1)); [ $i -gt 1200 ] && fail "xterm did not start within 120 s"
  sleep 0.1
done
# Ready once the terminal has the focus: typed keys go to the focused window, and keys
# sent before that would be lost. The window manager may still be starting (it loads its
# theme and menus after it announced itself), so ask it again until it has done so.
wid=$(timeout 120 xdotool search --sync --class xterm | head -n 1)
[ -n "$wid" ] || fail "no xterm window"
i=0
until [ "$(xdotool getactivewindow 2>/dev/null)" = "$wid" ]; do
  i=$((i + 1)); [ $i -gt 120 ] && fail "the window manager did not focus the terminal in 120 s"
  xdotool windowactivate "$wid" >/dev/null 2>&1
  sleep 1
done
xdpyinfo | grep dimensions
"""
"""The session start script (``$1`` width, ``$2`` height); see the module docstring."""
