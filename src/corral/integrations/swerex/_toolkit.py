"""The SWE-ReX toolkit image: a base image with a Python plus ``swe-rex`` in ``/opt/swerex``.

Built on the node's host from wheels the host's pip fetches (``build_pip``: offline
install in a chroot over the base, so the base's own Python and C library decide what
runs), once, then found in the layer store by name. The packages go to their own
directory, not the base's site-packages: the agent's Python and its packages stay as
the task image has them, and only the server's process puts ``/opt/swerex`` on its path.
"""

from __future__ import annotations

from rich.progress import Progress

from corral.errors import ImageNotFound
from corral.images.store import LayerStore
from corral.spec import ImageInfo

__all__ = ["SWEREX_REQUIREMENT", "TOOLKIT_DIR", "ensure_image", "server_command"]

SWEREX_REQUIREMENT = "swe-rex==1.4.0"
"""What the toolkit installs: the version this deployment speaks to."""
TOOLKIT_DIR = "/opt/swerex"
"""Where the toolkit's packages live in the image (``pip install --target``)."""


def server_command(token: str, port: int) -> list[str]:
    """``swerex-remote`` from the toolkit, on the sandbox's loopback only (the node's port
    proxy is the way in); the path is set inside the server's interpreter, so the shells
    it starts for the agent do not inherit it."""
    code = (
        f"import sys; sys.path.insert(0, {TOOLKIT_DIR!r}); "
        "sys.argv[0] = 'swerex-remote'; from swerex.server import main; main()"
    )
    return ["python3", "-c", code, "--host", "127.0.0.1", "--port", str(port),
            "--auth-token", token]  # fmt: skip


def ensure_image(
    store: LayerStore,
    base: str = "base/debian",
    name: str = "swerex/debian",
    progress: Progress | None = None,
) -> ImageInfo:
    """Image ``name`` = ``base``'s layers + the toolkit layer; built unless the store has
    it over the same base already. ``base`` needs python3 (3.10 or later) and pip."""
    from corral.images import build

    base_img = store.image(base)
    try:
        have: ImageInfo | None = store.image(name)
    except ImageNotFound:
        have = None
    if have is not None and have.layers[: len(base_img.layers)] == base_img.layers:
        return have
    layer = build.build_pip(
        store, base_img, [SWEREX_REQUIREMENT], target=TOOLKIT_DIR, progress=progress
    )
    store.put_image(
        name, [*base_img.layers, layer.digest], env=dict(base_img.env), workdir=base_img.workdir
    )
    return store.image(name)
