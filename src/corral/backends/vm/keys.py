"""Keys and pointer events as QMP ``input-send-event`` / ``send-key`` arguments.

Text is typed as key presses on a US layout (the guest X server's default): every ASCII
character maps to one QEMU key code, with shift where the layout needs it. Key combos
are ``+``-joined names (``ctrl+l``, ``alt+f4``, ``shift+tab``): modifiers, named keys
and single characters. Anything else is an InvalidRequest naming the character or name.
"""

from __future__ import annotations

import string

from corral.errors import InvalidRequest

__all__ = ["ABS_MAX", "abs_events", "button_events", "combo", "text_combos", "wheel_events"]

ABS_MAX = 0x7FFF
"""QEMU's absolute axis range: 0 .. ABS_MAX spans the whole screen."""

_PLAIN: dict[str, str] = {c: c for c in string.ascii_lowercase + string.digits}
_PLAIN.update(
    {
        " ": "spc",
        "\n": "ret",
        "\t": "tab",
        "-": "minus",
        "=": "equal",
        "[": "bracket_left",
        "]": "bracket_right",
        ";": "semicolon",
        "'": "apostrophe",
        "`": "grave_accent",
        "\\": "backslash",
        ",": "comma",
        ".": "dot",
        "/": "slash",
    }
)
_SHIFTED: dict[str, str] = {c.upper(): c for c in string.ascii_lowercase}
_SHIFTED.update(
    dict(zip("!@#$%^&*()", "1234567890", strict=True))
    | {
        "_": "minus",
        "+": "equal",
        "{": "bracket_left",
        "}": "bracket_right",
        ":": "semicolon",
        '"': "apostrophe",
        "~": "grave_accent",
        "|": "backslash",
        "<": "comma",
        ">": "dot",
        "?": "slash",
    }
)

_NAMES: dict[str, str] = {
    "ctrl": "ctrl",
    "control": "ctrl",
    "shift": "shift",
    "alt": "alt",
    "meta": "meta_l",
    "super": "meta_l",
    "win": "meta_l",
    "cmd": "meta_l",
    "enter": "ret",
    "return": "ret",
    "esc": "esc",
    "escape": "esc",
    "tab": "tab",
    "space": "spc",
    "backspace": "backspace",
    "delete": "delete",
    "del": "delete",
    "insert": "insert",
    "home": "home",
    "end": "end",
    "pageup": "pgup",
    "page_up": "pgup",
    "pagedown": "pgdn",
    "page_down": "pgdn",
    "up": "up",
    "down": "down",
    "left": "left",
    "right": "right",
    "menu": "menu",
    "plus": "equal",  # "ctrl+plus": the key that types "+" with shift
    **{f"f{i}": f"f{i}" for i in range(1, 13)},
}


def _qcode(name: str) -> dict[str, object]:
    return {"type": "qcode", "data": name}


def text_combos(text: str) -> list[list[dict[str, object]]]:
    """``text`` as key combos (each a ``send-key`` ``keys`` list), one per character."""
    out: list[list[dict[str, object]]] = []
    for ch in text:
        if ch in _PLAIN:
            out.append([_qcode(_PLAIN[ch])])
        elif ch in _SHIFTED:
            out.append([_qcode("shift"), _qcode(_SHIFTED[ch])])
        else:
            raise InvalidRequest(
                f"type: character {ch!r} cannot be typed on the VM's US keyboard "
                "(printable ASCII, newline and tab only)"
            )
    return out


def combo(keys: str) -> list[dict[str, object]]:
    """``"ctrl+shift+t"`` as one ``send-key`` ``keys`` list (pressed in order, released
    in reverse)."""
    if keys == "+":
        parts = ["+"]
    elif keys.endswith("++"):  # "ctrl++": ctrl and the "+" key
        parts = [*keys[:-2].split("+"), "+"]
    else:
        parts = keys.split("+")
    if any(not p for p in parts):
        raise InvalidRequest(f"key: {keys!r} is not a key combo like 'ctrl+l'")
    out: list[dict[str, object]] = []
    for p in parts:
        low = p.lower()
        if low in _NAMES:
            out.append(_qcode(_NAMES[low]))
        elif len(p) == 1 and p in _PLAIN:
            out.append(_qcode(_PLAIN[p]))
        elif len(p) == 1 and p in _SHIFTED:
            out += [_qcode("shift"), _qcode(_SHIFTED[p])]
        else:
            raise InvalidRequest(
                f"key: unknown key {p!r} in {keys!r} (names: ctrl, shift, alt, meta, enter, "
                "esc, tab, space, backspace, delete, home, end, pageup, pagedown, arrows, "
                "f1-f12, or one character)"
            )
    return out


def abs_events(x: int, y: int, width: int, height: int) -> list[dict[str, object]]:
    """A pointer move to pixel (x, y) of a ``width`` x ``height`` screen."""
    if not (0 <= x < width and 0 <= y < height):
        raise InvalidRequest(f"pointer: ({x}, {y}) is outside the {width}x{height} screen")
    sx = round(x * ABS_MAX / max(1, width - 1))
    sy = round(y * ABS_MAX / max(1, height - 1))
    return [
        {"type": "abs", "data": {"axis": "x", "value": sx}},
        {"type": "abs", "data": {"axis": "y", "value": sy}},
    ]


def button_events(button: str, down: bool) -> list[dict[str, object]]:
    if button not in ("left", "right", "middle"):
        raise InvalidRequest(f"button {button!r}: one of left, right, middle")
    return [{"type": "btn", "data": {"down": down, "button": button}}]


def wheel_events(dy: int, dx: int = 0) -> list[list[dict[str, object]]]:
    """Scroll clicks: ``dy`` > 0 scrolls down, < 0 up; ``dx`` > 0 right, < 0 left. One
    press+release per click (each its own batch, so the guest sees separate clicks)."""
    out: list[list[dict[str, object]]] = []
    for amount, pos, neg in ((dy, "wheel-down", "wheel-up"), (dx, "wheel-right", "wheel-left")):
        b = pos if amount > 0 else neg
        for _ in range(abs(amount)):
            out.append(
                [
                    {"type": "btn", "data": {"down": True, "button": b}},
                    {"type": "btn", "data": {"down": False, "button": b}},
                ]
            )
    return out
