"""Find a Debian mirror in the host's apt sources (never a hard-coded host name).

Reads one-line ``sources.list`` files and deb822 ``.sources`` files, as apt does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from corral.errors import BuildError

__all__ = ["AptSource", "read_sources", "find_mirror"]


@dataclass(frozen=True)
class AptSource:
    """One (type, URI, suite) entry of the host's apt configuration."""

    type: str
    uri: str
    suite: str
    components: tuple[str, ...]
    origin: str = ""
    """The file (and line) it came from, for messages."""
    options: dict[str, str] = field(default_factory=dict, compare=False, hash=False)


def _parse_one_line(text: str, origin: str) -> list[AptSource]:
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        kind, rest = parts[0], parts[1:]
        opts: dict[str, str] = {}
        if rest and rest[0].startswith("["):
            # Options "[ a=b c=d ]" may be split across tokens.
            opt_tokens = []
            while rest:
                tok = rest.pop(0)
                opt_tokens.append(tok)
                if tok.endswith("]"):
                    break
            for tok in " ".join(opt_tokens).strip("[] ").split():
                k, _, v = tok.partition("=")
                opts[k] = v
        if len(rest) < 2:
            continue
        uri, suite, comps = rest[0], rest[1], tuple(rest[2:])
        out.append(AptSource(kind, uri, suite, comps, f"{origin}:{n}", opts))
    return out


def _parse_deb822(text: str, origin: str) -> list[AptSource]:
    out = []
    stanzas: list[dict[str, str]] = []
    cur: dict[str, str] = {}
    key = ""
    for raw in text.splitlines() + [""]:
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if cur:
                stanzas.append(cur)
            cur, key = {}, ""
            continue
        if raw[0] in " \t" and key:
            cur[key] += " " + raw.strip()
            continue
        k, sep, v = raw.partition(":")
        if sep:
            key = k.strip().lower()
            cur[key] = v.strip()
    for i, st in enumerate(stanzas, 1):
        if st.get("enabled", "yes").lower() == "no":
            continue
        comps = tuple(st.get("components", "").split())
        for kind in st.get("types", "").split():
            for uri in st.get("uris", "").split():
                for suite in st.get("suites", "").split():
                    out.append(AptSource(kind, uri, suite, comps, f"{origin} stanza {i}", st))
    return out


def read_sources(apt_dir: Path = Path("/etc/apt")) -> list[AptSource]:
    """Every source entry under ``apt_dir`` (sources.list, sources.list.d/*.list|*.sources)."""
    files = [apt_dir / "sources.list"]
    d = apt_dir / "sources.list.d"
    if d.is_dir():
        files += sorted(p for p in d.iterdir() if p.suffix in (".list", ".sources"))
    out: list[AptSource] = []
    for p in files:
        try:
            text = p.read_text(errors="replace")
        except OSError:
            continue
        parse = _parse_deb822 if p.suffix == ".sources" else _parse_one_line
        out += parse(text, str(p))
    return out


def find_mirror(suite: str, apt_dir: Path = Path("/etc/apt")) -> str:
    """The URI of a Debian archive for ``suite`` in the host's apt sources.

    A candidate is a ``deb`` entry for exactly ``suite`` with the ``main`` component (so
    ``bookworm-security`` or a vendor's ``cloud-sdk-bookworm`` repository never match).
    Raises BuildError naming what was looked at when there is none.
    """
    sources = read_sources(apt_dir)
    for s in sources:
        if s.type == "deb" and s.suite == suite and "main" in s.components:
            return s.uri
    seen = ", ".join(sorted({f"{s.suite} ({s.origin})" for s in sources if s.type == "deb"}))
    raise BuildError(
        f"no Debian mirror for suite {suite!r} in the host's apt sources under {apt_dir} "
        f"(looked for a 'deb' entry with suite {suite!r} and component 'main'; found: "
        f"{seen or 'none'}); pass mirror= explicitly"
    )
