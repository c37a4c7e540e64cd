"""Probe (not a test): how fast a paged K/V pool streams one KV head at a time.

The per-KV-head decode layout (docs/PERF.md, decode section, 2026-12-02 fourth session)
reads a block as ``[tokens, head_dim]`` of ONE head: in the 2-D view ``[pages * page_size,
kv_heads * head_dim]`` of the pool that is a plain TMA box at column ``head * head_dim``
with row stride ``kv_heads * head_dim``. This kernel streams every request's K and V that
way and does nothing else: grid (splits, batch, kv heads), one warpgroup, a ring of
``stages`` slots of ``[block, head_dim]`` K and V tiles, every block waited on. It prints
the GPU time per call and TB/s of K+V bytes beside the copy rate, for blocks of 64 and 32
tokens (16 and 8 KB boxes at head_dim 128) and 2-4 stages.

    python scripts/probe_head_boxes.py            # on the GPU (gpu.sh)
    python scripts/probe_head_boxes.py --check    # CPU: the Mosaic GPU interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn.pallas_kernels.mosaic_common import plgpu_kernel, swizzle_transforms


@functools.partial(jax.jit, static_argnames=("page_size", "block", "stages", "splits", "kv_inner"))
def stream(x, k2d, v2d, table, lens, *, page_size, block, stages, splits, kv_inner=False):
    """Streams each (request, KV head)'s K and V blocks; returns f32[splits, bs, heads, 128]
    (zeros: the output exists so the call is not dead code). ``kv_inner``: the KV heads are
    the fastest grid axis (launched side by side), else the splits, then the requests."""
    bs, max_pages = table.shape
    d = 128
    heads = k2d.shape[1] // d
    per_page = page_size // block
    max_blocks = max_pages * per_page
    per_split = -(-max_blocks // splits)
    tr = swizzle_transforms(k2d.dtype, d)

    def entry(x_ref, k_ref, v_ref, table_ref, lens_ref, o_ref):
        s, b, h = lax.axis_index("s"), lax.axis_index("b"), lax.axis_index("h")
        n_blocks = lax.div(lens_ref[b] + block - 1, jnp.int32(block))
        lo = s * per_split
        count = jnp.clip(n_blocks - lo, 0, per_split)

        def body(k_s, v_s, o_s, full):
            def fetch(slot, blk):
                page = jnp.clip(table_ref[b, lax.div(blk, jnp.int32(per_page))], 0, k_ref.shape[0] // page_size - 1)
                row = page * page_size + lax.rem(blk, jnp.int32(per_page)) * block
                cols = pl.ds(h * d, d)
                plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(row, block), cols], k_s.at[slot], full.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[pl.ds(row, block), cols], v_s.at[slot], full.at[slot])

            for j in range(stages):

                @pl.when(count > j)
                def _():
                    fetch(j, lo + j)

            @pl.loop(0, count)
            def _(i):
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(full.at[slot])

                @pl.when(i + stages < count)
                def _():
                    fetch(slot, lo + i + stages)

            o_s[...] = jnp.zeros((128,), jnp.float32)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_ref.at[s, b, h])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            body,
            plgpu.SMEM((stages, block, d), k2d.dtype, transforms=tr),
            plgpu.SMEM((stages, block, d), k2d.dtype, transforms=tr),
            plgpu.SMEM((128,), jnp.float32),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        )

    kernel = plgpu_kernel(
        entry,
        jax.ShapeDtypeStruct((splits, bs, heads, 128), jnp.float32),
        grid=(heads, splits, bs) if kv_inner else (splits, bs, heads),
        grid_names=("h", "s", "b") if kv_inner else ("s", "b", "h"),
        kernel_name=f"probe_head_boxes_b{block}_s{stages}{'_h' if kv_inner else ''}",
    )
    return kernel(x, k2d, v2d, table, lens)


def check() -> None:
    """CPU: the interpreter runs the kernel on tiny shapes (every barrier phase observed)."""
    from jattn.pallas_kernels.interpret import gpu_interpret

    rng = np.random.default_rng(0)
    ps, heads, pages = 64, 2, 6
    k = jnp.asarray(rng.standard_normal((pages * ps, heads * 128)), jnp.float16)
    table = jnp.asarray([[3, 1, 4], [5, 2, 0]], jnp.int32)
    lens = jnp.asarray([150, 0], jnp.int32)
    with gpu_interpret():
        for block, stages, splits, inner in ((64, 2, 1, False), (32, 3, 2, True)):
            out = stream(
                jnp.zeros(8), k, k, table, lens, page_size=ps, block=block, stages=stages, splits=splits, kv_inner=inner
            )
            assert out.shape == (splits, 2, heads, 128) and not np.asarray(out).any()
    print("ok: interpreted")


def bench(bs: int = 64, length: int = 4096, configs=None) -> None:
    from jattn.bench import common

    heads, ps = 8, 64
    max_pages = length // ps
    page_bytes = ps * heads * 128 * 2
    num_pages = common.rotation_pages(bs * max_pages, page_bytes)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((num_pages * ps, heads * 128)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((num_pages * ps, heads * 128)), jnp.bfloat16)
    tables = jnp.asarray(common.random_page_tables(rng, 8, bs, max_pages, num_pages))
    lens = jnp.full((bs,), length, jnp.int32)
    x = jnp.zeros((128,), jnp.float32)
    nbytes = 2 * bs * length * heads * 128 * 2
    copy, how = common.copy_bandwidth()
    print(
        f"copy {copy / 1e12:.2f} TB/s ({how}); B{bs} L{length} {heads} KV heads d128 page {ps}, "
        f"K+V {nbytes / 1e9:.2f} GB"
    )
    configs = configs or [
        (b, s, sp, inner) for inner in (False, True) for b, s, sp in ((64, 2, 1), (64, 3, 1), (64, 3, 2), (32, 4, 1))
    ]
    for block, stages, splits, inner in configs:

        def step(i, x, k, v, tables, lens, block=block, stages=stages, splits=splits, inner=inner):
            # x + i: every call's operands differ, so XLA cannot merge two calls that share a
            # table (8 tables, more calls: merged calls made this probe print 7 TB/s)
            return stream(
                x + i,
                k,
                v,
                tables[i % 8],
                lens,
                page_size=ps,
                block=block,
                stages=stages,
                splits=splits,
                kv_inner=inner,
            )

        name = f"{'heads' if inner else 'splits'} first, block {block} stages {stages} splits {splits}"
        try:
            t = common.time_rotated(step, (x, k, v, tables, lens), device=True)
            sec = t.device_seconds or t.seconds
            print(f"{name}: {sec * 1e6:7.1f} us, {nbytes / sec / 1e12:.2f} TB/s")
        except Exception as e:  # report and go on
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="run the kernel under the Mosaic GPU interpreter")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--length", type=int, default=4096)
    a = ap.parse_args()
    check() if a.check else bench(a.batch, a.length)
