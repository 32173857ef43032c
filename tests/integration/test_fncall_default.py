"""A fresh node runs ``client.fncall.run(language=...)`` once ``corral fncall setup`` has
built fncall/default; before, the error names that command."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import corral
from corral.backends.fncall.config import SETUP_IMAGE
from corral.images.store import LayerStore
from tests.conftest import TAG
from tests.integration.conftest import assert_no_leaks, node_config

STATE = Path(f"/var/lib/corral-test{TAG}-fndef")
RUN = Path(f"/run/corral-test{TAG}-fndef")
SUBTREE = f"corral-test{TAG}-fndef"
STORE = Path("/var/tmp/corral-test-store-fncall-default")
"""A store of its own: the shared test store must not gain fncall/default (other tests
would then get a default where they expect none)."""

CODE = {
    "python": "import sys; print(open('/etc/hostname').read().strip(), sys.stdin.read())",
    "bash": 'read x; echo "bash $x"',
    "c": '#include <stdio.h>\nint main(){char s[9];scanf("%8s",s);printf("c %s\\n",s);}',
    "cpp": '#include <iostream>\nint main(){std::string s;std::cin>>s;std::cout<<"cpp "<<s<<"\\n";}',
}


def _setup() -> subprocess.CompletedProcess[str]:
    code = "from corral.cli.app import main; main()"
    argv = [sys.executable, "-c", code, "fncall", "setup", "--store", str(STORE)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=1800)


async def test_fresh_node_default_image(images_ready: None) -> None:
    cfg = node_config(state_dir=STATE, run_dir=RUN, cgroup_subtree=SUBTREE, store=STORE)
    had = SETUP_IMAGE in {i.name for i in LayerStore(STORE).images()}
    if not had:  # before the setup: the error says what to run
        async with corral.AsyncClient(config=cfg) as c:
            with pytest.raises(corral.InvalidRequest, match="corral fncall setup"):
                await c.fncall.run(language="python", code="print(1)")
    r = _setup()
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("already" in r.stderr) == had, r.stderr[-3000:]
    try:
        async with corral.AsyncClient(config=cfg) as c:
            for lang, code in CODE.items():
                # generous wall time: a loaded CI host, and this only checks the output
                res = await c.fncall.run(
                    language=lang, code=code, stdin="hi\n", limits={"wall_time": 120}
                )
                assert res.status == "ok", (lang, res)
                # The image carries a neutral hostname, not the build host's.
                want = "sandbox hi\n\n" if lang == "python" else f"{lang} hi\n"
                assert res.stdout == want, (lang, res.stdout, res.stderr)
    finally:
        shutil.rmtree(RUN, ignore_errors=True)
    assert_no_leaks(STATE, RUN, SUBTREE)
    shutil.rmtree(STATE, ignore_errors=True)
