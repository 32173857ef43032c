"""The contract of images as sandboxes see them (compose, env, workdir) and of forks.

Composing writes only a manifest naming layers already in the store (the real node's
store may be shared: the test removes its image again); a fork copies files, not
processes.
"""

from __future__ import annotations

from corral.errors import ImageNotFound, InvalidRequest, LayerNotFound
from corral.ops import NodeOps
from corral.spec import ForkRequest, SandboxInfo, SandboxSpec
from tests.contract.base import ContractBase, raises_exactly, run


class DerivedContract(ContractBase):
    async def test_composed_image_env_and_workdir(self, ops: NodeOps, run_label: str) -> None:
        base = await ops.image_get(self.image)
        assert base.name == self.image and base.layers
        assert self.image in {i.name for i in await ops.image_list()}
        name = f"contract/{run_label}"
        img = await ops.image_compose(
            name, base.layers, env={"IMG_VAR": "img", "OVERRIDDEN": "image"}, workdir="/tmp"
        )
        try:
            assert (img.name, img.layers, img.workdir) == (name, base.layers, "/tmp")
            assert (await ops.image_get(name)).digest == img.digest
            info = await ops.sandbox_create(
                SandboxSpec(
                    image=name,
                    env={"OVERRIDDEN": "spec"},
                    labels={"contract": run_label, "role": "image"},
                )
            )
            try:
                assert (info.image_digest, info.layers, info.image_env) == (
                    img.digest,
                    base.layers,
                    {"IMG_VAR": "img", "OVERRIDDEN": "image"},
                )
                assert info.spec.workdir == "/tmp"  # the image's, the spec named none
                r = await run(ops, info.id, "printenv", "IMG_VAR", "OVERRIDDEN")
                assert r.stdout == b"img\nspec\n"  # the spec's env over the image's
                assert (await run(ops, info.id, "pwd")).stdout == b"/tmp\n"
            finally:
                await ops.sandbox_destroy(info.id)
        finally:
            await ops.image_remove(name)
        with raises_exactly(ImageNotFound, match=name):
            await ops.image_get(name)
        with raises_exactly(ImageNotFound, match=name):
            await ops.image_remove(name)

    async def test_bad_compose_is_refused(self, ops: NodeOps, run_label: str) -> None:
        base = await ops.image_get(self.image)
        with raises_exactly(InvalidRequest, match="image name"):
            await ops.image_compose("Not A Name!", base.layers)
        with raises_exactly(InvalidRequest, match="layer"):
            await ops.image_compose(f"contract/{run_label}-empty", [])
        with raises_exactly(LayerNotFound, match="f" * 64):
            await ops.image_compose(f"contract/{run_label}-bad", ["sha256:" + "f" * 64])
        names = {i.name for i in await ops.image_list()}
        assert not {f"contract/{run_label}-empty", f"contract/{run_label}-bad"} & names

    async def test_fork_copies_files(self, ops: NodeOps, run_label: str, sb: SandboxInfo) -> None:
        await ops.file_write(sb.id, "/tmp/c-fork/f", b"parent's")
        job = {"contract": run_label, "role": "fork"}
        children = await ops.sandbox_fork(sb.id, ForkRequest(count=2, labels=job))
        try:
            assert len({c.id for c in children}) == 2 and sb.id not in {c.id for c in children}
            assert {(c.state, c.image_digest) for c in children} == {("running", sb.image_digest)}
            assert sorted(i.id for i in await ops.sandbox_list(job)) == sorted(
                c.id for c in children
            )
            assert children[0].spec.env == sb.spec.env  # inherited
            for c in children:
                assert await ops.file_read(c.id, "/tmp/c-fork/f") == b"parent's"
            await ops.file_write(children[0].id, "/tmp/c-fork/f", b"child's")
            assert await ops.file_read(children[1].id, "/tmp/c-fork/f") == b"parent's"
            assert await ops.file_read(sb.id, "/tmp/c-fork/f") == b"parent's"
        finally:
            for c in children:
                await ops.sandbox_destroy(c.id)
