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

Two in-kernel forms are timed: "last" (the last split merges alone, as above) and
"slices" (every split signals each of its request's splits, waits for all of them and sums
its own 1/S of the rows of every partial: the reads stay spread over S CTAs as in the XLA
sum, and no launch is added; it relies on a request's splits being resident together,
which holds at batch 1 where the split count is at most the SM count).

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


MODES = ("parts", "last", "slices")


def build(batch: int, splits: int, mode: str):
    """``x f32[batch, splits, ROWS, COLS]`` -> the summed ``f32[batch, ROWS, COLS]`` of
    ``x[b, s] * (s + 1)``. ``mode``: "parts" writes the partials and sums them in XLA (the
    two-launch form); "last": the request's last split waits for the others and sums every
    partial alone; "slices": every split signals all of its request's splits, waits for all
    of them, then sums its own ``ROWS / splits`` rows of every partial (needs ``ROWS %
    splits == 0`` and the request's splits resident together)."""
    r = ROWS // splits

    def entry(x_ref, *outs):
        part_ref = outs[0]
        s, b = jax.lax.axis_index("s"), jax.lax.axis_index("b")

        def body(tile, acc, piece, piece_acc, bar):
            plgpu.copy_gmem_to_smem(x_ref.at[b, s], tile, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            tile[...] = tile[...] * (s + 1).astype(jnp.float32)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(tile, part_ref.at[b, s])
            plgpu.wait_smem_to_gmem(0)  # the partial has landed in GMEM, not only left SMEM
            if mode == "parts":
                return
            if mode == "slices":
                sem = pl.get_global(plgpu.SemaphoreType.REGULAR((batch, splits)))
                for j in range(splits):  # unrolled: a probe's splits are few
                    plgpu.semaphore_signal(sem.at[b, j], 1, memory_scope="gpu")
                plgpu.semaphore_wait(sem.at[b, s], splits, memory_scope="gpu")  # and back to 0
                rows = pl.ds(s * r, r)
                for j in range(splits):
                    plgpu.copy_gmem_to_smem(part_ref.at[b, j, rows], piece, bar.at[0])
                    plgpu.barrier_wait(bar.at[0])
                    piece_acc[...] = piece[...] if j == 0 else piece_acc[...] + piece[...]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(piece_acc, outs[1].at[b, rows])
                plgpu.wait_smem_to_gmem(0)
                return
            sem = pl.get_global(plgpu.SemaphoreType.REGULAR((batch,)))

            @pl.when(s < splits - 1)
            def _():
                plgpu.semaphore_signal(sem.at[b], 1, memory_scope="gpu")

            @pl.when(s == splits - 1)
            def _():
                plgpu.semaphore_wait(sem.at[b], splits - 1, memory_scope="gpu")  # and back to 0
                acc[...] = tile[...]
                for j in range(splits - 1):
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
            plgpu.SMEM((r, COLS), jnp.float32),
            plgpu.SMEM((r, COLS), jnp.float32),
            plgpu.Barrier(num_arrivals=1, num_barriers=1),
        )

    part = jax.ShapeDtypeStruct((batch, splits, ROWS, COLS), jnp.float32)
    merged = mode != "parts"
    out = (part, jax.ShapeDtypeStruct((batch, ROWS, COLS), jnp.float32)) if merged else (part,)
    name = f"probe_split_merge_{batch}x{splits}_{mode}"
    kernel = plgpu_kernel(entry, out, grid=(splits, batch), grid_names=("s", "b"), kernel_name=name)
    if merged:
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
            fns = {mode: jax.jit(build(batch, splits, mode)) for mode in MODES}
            x = jnp.zeros((batch, splits, ROWS, COLS), jnp.float32)
            if args.lower:
                for fn in fns.values():
                    fn.trace(x).lower(lowering_platforms=("cuda",))
                print(f"{name}: lowered")
                continue
            w = np.arange(1, splits + 1, dtype=np.float32)[None, :, None, None]
            worst = {mode: 0.0 for mode in MODES}
            for _ in range(args.calls):  # fresh data each call: stale partials give wrong sums
                xn = rng.standard_normal((batch, splits, ROWS, COLS)).astype(np.float32)
                want = (xn * w).sum(axis=1)
                for mode, fn in fns.items():
                    worst[mode] = max(worst[mode], float(np.abs(np.asarray(fn(jnp.asarray(xn))) - want).max()))
            x = jnp.asarray(rng.standard_normal((batch, splits, ROWS, COLS)), jnp.float32)
            cells = [
                f"{mode} {_per_call_us(fn, x):.2f} us/call ({'ok' if worst[mode] < 1e-3 else 'WRONG'}, "
                f"max err {worst[mode]:.1e})"
                for mode, fn in fns.items()
            ]
            print(f"{name} over {args.calls} calls: " + "; ".join(cells))
        except Exception as e:  # report and go on
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
