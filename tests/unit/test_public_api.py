"""``corral``'s public surface is exactly what ``__all__`` says, and importing it is light."""

from __future__ import annotations

import inspect
import subprocess
import sys

import corral
import corral.errors
import corral.sdk

PUBLIC = {
    "__version__",
    "AsyncClient",
    "Client",
    "Sandbox",
    "Shell",
    "Process",
    "Limits",
    "NetworkPolicy",
    "Desktop",
    "SandboxSpec",
    "SandboxInfo",
    "ExecResult",
    "ExecChunk",
    "ProcessInfo",
    "ImageInfo",
    "LayerInfo",
    "FileStat",
    "Event",
    "NodeStatus",
    "CallLimits",
    "CallRequest",
    "CallResult",
    "Case",
    "CaseResult",
    "CustomChecker",
    "JudgeResult",
    "CorralError",
    "InvalidRequest",
    "PathRefused",
    "NotFound",
    "SandboxNotFound",
    "JobNotFound",
    "ImageNotFound",
    "LayerNotFound",
    "ProcessNotFound",
    "Conflict",
    "CursorExpired",
    "CapacityError",
    "ScratchFull",
    "QuotaExceeded",
    "JobQuotaExceeded",
    "SandboxError",
    "BuildError",
    "LayerCorrupt",
    "StoreUnavailable",
    "HostError",
    "Unauthorized",
    "TransportError",
}


def test_all_is_exactly_the_public_surface() -> None:
    assert set(corral.__all__) == PUBLIC
    assert len(corral.__all__) == len(PUBLIC), "duplicates in __all__"
    for name in corral.__all__:
        assert hasattr(corral, name), name
    # nothing public that __all__ forgets: every non-underscore, non-module attribute is listed
    extra = {
        n for n, v in vars(corral).items() if not n.startswith("_") and not inspect.ismodule(v)
    } - PUBLIC
    assert extra == set(), f"public but not in __all__: {extra}"


def test_every_error_of_the_tree_is_exported() -> None:
    for name, cls in corral.errors.KINDS.items():
        assert getattr(corral, name) is cls
        assert issubclass(cls, corral.CorralError)


def test_sdk_all() -> None:
    assert set(corral.sdk.__all__) == {
        "AsyncClient",
        "Client",
        "Images",
        "Sandboxes",
        "Sandbox",
        "ExecStream",
        "Process",
        "Shell",
        "Files",
    }
    for name in corral.sdk.__all__:
        assert getattr(corral.sdk, name).__module__.startswith("corral.sdk._")


def test_public_names_have_docstrings() -> None:
    for name in ("AsyncClient", "Client", "Sandbox", "Shell", "Process"):
        assert inspect.getdoc(getattr(corral, name)), name
    for meth in ("exec", "exec_stream", "spawn", "shell", "destroy"):
        assert inspect.getdoc(getattr(corral.Sandbox, meth)) or meth == "destroy", meth


def test_version() -> None:
    assert isinstance(corral.__version__, str) and corral.__version__


def test_import_is_light() -> None:
    code = (
        "import sys, corral\n"
        "heavy = {'fastapi', 'uvicorn', 'starlette', 'httpx', 'corral.node', 'corral.api'}\n"
        "print(sorted(m for m in sys.modules if m in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
