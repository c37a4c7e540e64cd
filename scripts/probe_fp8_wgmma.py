"""Probe (not a test): does Mosaic GPU's wgmma take FP8 e4m3 operands from shared memory,
K-major (Q K^T) and MN-major (P V with V as stored)? Prints one line per variant."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn.pallas_kernels.mosaic_common import plgpu_kernel, swizzle_transforms


def build(dt, a_shape, b_shape, n, b_transposed_view):
    if jnp.dtype(dt).itemsize == 1:  # 64-byte swizzle on both: 576 is not a multiple of 128 e4m3 columns
        ta = tb = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))
    else:
        ta, tb = swizzle_transforms(dt, a_shape[1]), swizzle_transforms(dt, b_shape[1])

    def entry(a_ref, b_ref, o_ref):
        def body(a_s, b_s, o_s, bar):
            plgpu.copy_gmem_to_smem(a_ref, a_s, bar.at[0])
            plgpu.copy_gmem_to_smem(b_ref, b_s, bar.at[0])
            plgpu.barrier_wait(bar.at[0])

            def scope(acc):
                plgpu.wgmma(acc, a_s, b_s.T if b_transposed_view else b_s)
                return acc[...]

            o_s[...] = pl.run_scoped(scope, plgpu.ACC((64, n), jnp.float32))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_ref)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            body,
            plgpu.SMEM(a_shape, dt, transforms=ta),
            plgpu.SMEM(b_shape, dt, transforms=tb),
            plgpu.SMEM((64, n), jnp.float32),
            plgpu.Barrier(num_arrivals=2, num_barriers=1),
        )

    return plgpu_kernel(entry, jax.ShapeDtypeStruct((64, n), jnp.float32), grid=(1,), grid_names=("i",))


def run(name, dt, a_shape, b_shape, n, b_transposed_view, want_fn):
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal(a_shape) * 0.5, jnp.float32).astype(dt)
    b = jnp.asarray(rng.standard_normal(b_shape) * 0.5, jnp.float32).astype(dt)
    try:
        got = np.asarray(jax.jit(build(dt, a_shape, b_shape, n, b_transposed_view))(a, b))
        want = want_fn(np.asarray(a, np.float32), np.asarray(b, np.float32))
        print(f"{name}: ok, max |err| {np.abs(got - want).max():.3e} (max |want| {np.abs(want).max():.2f})")
    except Exception as e:  # report and go on
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}")
    sys.stdout.flush()


f8 = jnp.float8_e4m3fn
# Q K^T: A = q [64, 576], B = k [64 keys, 576] read through .T (K-major for both)
qk = lambda a, b: a @ b.T  # noqa: E731
run("bf16 QK^T 64x576 . (64x576)^T", jnp.bfloat16, (64, 576), (64, 576), 64, True, qk)
run("e4m3 QK^T 64x576 . (64x576)^T", f8, (64, 576), (64, 576), 64, True, qk)
# P V: A = p [64, 64 keys], B = v [64 keys, 256] as stored (MN-major)
pv = lambda a, b: a @ b  # noqa: E731
run("bf16 PV 64x64 . 64x256 (MN-major B)", jnp.bfloat16, (64, 64), (64, 256), 256, False, pv)
run("e4m3 PV 64x64 . 64x256 (MN-major B)", f8, (64, 64), (64, 256), 256, False, pv)
