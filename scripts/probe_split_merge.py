"""Probe (not a test): can a Mosaic GPU kernel merge its own splits?

At batch 1 the split-KV decode kernels hand their partials to a second kernel (the split
combine), and that launch is a fixed cost of every call (docs/PERF.md, "Merging the splits
inside the decode kernel"). The in-kernel alternative: every split CTA writes its partial,
waits for the write to land and signals a per-request GMEM semaphore; the request's last
split waits until the others have signalled (the wait's decrement leaves the semaphore at 0
for the next call, since ``pl.get_global`` semaphores persist across launches), reads all
partials and writes the merged row. The last split waits for earlier ones only (the split
is the grid's fastest axis), so no CTA waits for one that cannot be scheduled.

This probe asks the three questions that decide it, with a stand-in for the partials
(each split writes ``x[b, s] * (s + 1)``, the merge sums them):

1. Does it compile (``pl.get_global`` semaphores, ``plgpu.semaphore_signal`` /
   ``semaphore_wait`` beside TMA stores and loads)?
2. Is it right every time: fresh random data on each of many calls (a stale partial read
   before its TMA store landed gives a wrong sum) and the semaphores back at 0 (a call that
   found them nonzero would merge too early)?
3. What does it cost against the same kernel writing partials plus an XLA sum (the
   two-launch form), per call, over many calls in one jit?

    python scripts/probe_split_merge.py            # on the GPU (gpu.sh)
    python scripts/probe_split_merge.py --lower    # CPU: lowering for cuda only
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn.pallas_kernels.mosaic_common import plgpu_kernel

ROWS, COLS = 32, 256  # one partial of 32 KB, as MLA at 16 heads (16 rows x 512 f32); a TMA box is <= 256 wide


def build(batch: int, splits: int, merge: bool):
    """``x f32[batch, splits, ROWS, COLS]`` -> with ``merge`` the summed ``f32[batch, ROWS,
    COLS]`` of ``x[b, s] * (s + 1)``, else the partials ``f32[batch, splits, ROWS, COLS]``."""

    def entry(x_ref, *outs):
        part_ref = outs[0]
        s, b = jax.lax.axis_index("s"), jax.lax.axis_index("b")

        def body(tile, acc, bar):
            plgpu.copy_gmem_to_smem(x_ref.at[b, s], tile, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            tile[...] = tile[...] * (s + 1).astype(jnp.float32)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(tile, part_ref.at[b, s])
            plgpu.wait_smem_to_gmem(0)  # the partial has landed in GMEM, not only left SMEM
            if not merge:
                return
            sem = pl.get_global(plgpu.SemaphoreType.REGULAR((batch,)))

            @pl.when(s < splits - 1)
            def _():
                plgpu.semaphore_signal(sem.at[b], 1, memory_scope="gpu")

            @pl.when(s == splits - 1)
            def _():
                plgpu.semaphore_wait(sem.at[b], splits - 1, memory_scope="gpu")  # and back to 0
                acc[...] = tile[...]
                for j in range(splits - 1):  # unrolled: a probe's splits are few
                    plgpu.copy_gmem_to_smem(part_ref.at[b, j], tile, bar.at[0])
                    plgpu.barrier_wait(bar.at[0])
                    acc[...] = acc[...] + tile[...]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(acc, outs[1].at[b])
                plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            body,
            plgpu.SMEM((ROWS, COLS), jnp.float32),
            plgpu.SMEM((ROWS, COLS), jnp.float32),
            plgpu.Barrier(num_arrivals=1, num_barriers=1),
        )

    part = jax.ShapeDtypeStruct((batch, splits, ROWS, COLS), jnp.float32)
    out = (part, jax.ShapeDtypeStruct((batch, ROWS, COLS), jnp.float32)) if merge else (part,)
    name = f"probe_split_merge_{batch}x{splits}_{'merge' if merge else 'parts'}"
    kernel = plgpu_kernel(entry, out, grid=(splits, batch), grid_names=("s", "b"), kernel_name=name)
    if merge:
        return lambda x: kernel(x)[1]
    return lambda x: kernel(x)[0].sum(axis=1)


def _per_call_us(fn, x, calls: int = 200) -> float:
    """GPU-bound time per call: ``calls`` dependent calls in one jit, best of three."""

    @jax.jit
    def many(x):
        def step(_, y):
            return x + 1e-30 * fn(y)[:, None, :1, :1]

        return jax.lax.fori_loop(0, calls, step, x)

    many(x).block_until_ready()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        many(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lower", action="store_true", help="only lower each variant for cuda (CPU)")
    ap.add_argument("--calls", type=int, default=50, help="calls of the correctness check per shape")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for batch, splits in ((1, 8), (1, 32), (4, 8), (64, 2)):
        name = f"batch {batch:3d} splits {splits:3d}"
        try:
            merged, parts = jax.jit(build(batch, splits, True)), jax.jit(build(batch, splits, False))
            x = jnp.zeros((batch, splits, ROWS, COLS), jnp.float32)
            if args.lower:
                for fn in (merged, parts):
                    fn.trace(x).lower(lowering_platforms=("cuda",))
                print(f"{name}: lowered")
                continue
            w = np.arange(1, splits + 1, dtype=np.float32)[None, :, None, None]
            worst = 0.0
            for _ in range(args.calls):  # fresh data each call: stale partials give wrong sums
                xn = rng.standard_normal((batch, splits, ROWS, COLS)).astype(np.float32)
                got = np.asarray(merged(jnp.asarray(xn)))
                worst = max(worst, float(np.abs(got - (xn * w).sum(axis=1)).max()))
            x = jnp.asarray(rng.standard_normal((batch, splits, ROWS, COLS)), jnp.float32)
            t_merge, t_parts = _per_call_us(merged, x), _per_call_us(parts, x)
            verdict = "ok" if worst < 1e-3 else "WRONG"
            print(
                f"{name}: {verdict} over {args.calls} calls (max err {worst:.1e}); "
                f"in-kernel merge {t_merge:.2f} us/call, partials + XLA sum {t_parts:.2f} us/call"
            )
        except Exception as e:  # report and go on
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
