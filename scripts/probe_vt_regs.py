"""Probe (not a test): can Mosaic GPU compute ``O^T = V^T P^T`` with ``V^T`` loaded from an e4m3
tile ``[tokens, width]`` (as the TMA lands it) into registers, upcast there to f16, and used as
``wgmma``'s register operand A, with ``P`` stored ``[rows, tokens]`` in f16 as B (through a
transposed view), and the f32 ``O^T`` stored back as f16 ``O`` through a transposed view?
Prints one line per variant: max error against numpy, or the failure.

    python scripts/probe_vt_regs.py [--optimized]   # run (GPU); --optimized: the load's
                                                    # bank-conflict-free transfer plan
    python scripts/probe_vt_regs.py --lower         # lower for cuda only (CPU)
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn.pallas_kernels.mosaic_common import plgpu_kernel

F8 = jnp.float8_e4m3fn
OPT = "--optimized" in sys.argv  # the load with a bank-conflict-free transfer plan
T, W, HALF = 64, 576, 256  # tokens per block, latent width, value columns per warpgroup


def build(n, col0, mode):
    tv = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))
    tp = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def entry(v_ref, p_ref, o_ref):
        def body(v_s, p_s, o_s, bar):
            plgpu.copy_gmem_to_smem(v_ref, v_s, bar.at[0])
            plgpu.copy_gmem_to_smem(p_ref, p_s, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            vt = v_s.at[:, pl.ds(col0, HALF)].T  # [HALF, T]
            if mode == "transposed":
                a = plgpu.load(vt, (), layout=plgpu.Layout.WGMMA_TRANSPOSED, optimized=OPT)
                a = plgpu.layout_cast(a.astype(jnp.float16), plgpu.Layout.WGMMA)
            else:  # "plain": WGMMA layout straight from the transposed view
                a = plgpu.load(vt, (), layout=plgpu.Layout.WGMMA, optimized=False).astype(jnp.float16)

            def scope(acc):
                plgpu.wgmma(acc, a, p_s.T)
                return acc[...]

            acc = pl.run_scoped(scope, plgpu.ACC((HALF, n), jnp.float32))
            # O = (O^T)^T in 2-byte floats: a transposed-layout value into a transposed view
            ot = plgpu.layout_cast(acc.astype(jnp.float16), plgpu.Layout.WGMMA_TRANSPOSED)
            o_s.T[...] = ot
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_ref)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            body,
            plgpu.SMEM((T, W), F8, transforms=tv),
            plgpu.SMEM((n, T), jnp.float16, transforms=tp),
            plgpu.SMEM((n, HALF), jnp.float16, transforms=tp),
            plgpu.Barrier(num_arrivals=2, num_barriers=1),
        )

    kw = {"interpret": True} if "--interpret" in sys.argv else {}
    return plgpu_kernel(entry, jax.ShapeDtypeStruct((n, HALF), jnp.float16), grid=(1,), grid_names=("i",), **kw)


def main():
    rng = np.random.default_rng(0)
    for mode in ("transposed",):
        for n, col0 in ((16, 0), (16, 256), (64, 256)):
            name = f"{mode} n={n} col0={col0}"
            v = jnp.asarray(rng.standard_normal((T, W)) * 2, jnp.float32).astype(F8)
            p = jnp.asarray(rng.random((n, T)), jnp.float32).astype(jnp.float16)
            f = jax.jit(build(n, col0, mode))
            try:
                if "--lower" in sys.argv:
                    f.trace(v, p).lower(lowering_platforms=("cuda",))
                    print(f"{name}: lowered")
                    continue
                got = np.asarray(f(v, p), np.float32)
                want = np.asarray(p, np.float32) @ np.asarray(v, np.float32)[:, col0 : col0 + HALF]
                print(f"{name}: ok, max |err| {np.abs(got - want).max():.3e} (max |want| {np.abs(want).max():.2f})")
            except Exception as e:  # report and go on
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
