"""Probe (not a test): the pieces of one per-KV-head decode block on Mosaic GPU.

The per-KV-head layout (docs/PERF.md, decode section, 2026-12-02 fourth session) computes,
for one block of 64 tokens of one KV head and that head's N query rows (N = 8, 16 or 32):

    S^T = K Q^T                    wgmma, M = 64 tokens, N query rows, K = head_dim
    m = max(S^T, axis=0)           a reduction over the rows of the WGMMA layout
    P^T = exp2(S^T - m)            broadcast back over axis 0
    O^T = V^T P^T                  wgmma, M = head_dim in two 64-row halves, K = 64 tokens

and the question is which forms Mosaic GPU compiles: P^T stored to shared memory as it is
(``[64, N]``, the B operand read MN-major; "matched": with the V tile at P^T's swizzle,
since one wgmma's operands must share it) or transposed (``[N, 64]``, read
K-major), and V^T as the A operand through a transposed view of the ``[64, head_dim]`` V
tile. Each
variant is one small kernel (one warpgroup, one block); it prints ``ok`` with the largest
error against numpy, or the error. ``--lower`` only lowers each for the cuda platform
(on a CPU: catches what the lowering refuses, not Mosaic's layout inference).

    python scripts/probe_head_tile.py            # on the GPU (gpu.sh)
    python scripts/probe_head_tile.py --lower    # CPU
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn.pallas_kernels.mosaic_common import plgpu_kernel, swizzle_transforms

D, T = 128, 64  # head_dim, tokens per block


def build(n: int, p_form: str):
    """``(k [T, D], v [T, D], q [n, D]) -> (o^T f32[D, n], l f32[n])``: one block's
    softmax (base 2, no scale) over the tokens for each query row, unnormalised O^T."""
    tr = v_tr = swizzle_transforms(jnp.bfloat16, D)
    if p_form == "as_is":  # P^T [T, n]: rows of n elements
        p_shape, p_tr = (T, n), swizzle_transforms(jnp.bfloat16, n)
    elif p_form == "matched":  # P^T [T, n], and the V tile at P^T's swizzle (2n bytes, >= 32)
        v_tr = p_tr = swizzle_transforms(jnp.bfloat16, n)
        p_shape = (T, n)
    else:  # "transposed": P [n, T], rows of T elements, written through a transposed view
        p_shape, p_tr = (n, T), swizzle_transforms(jnp.bfloat16, T)

    def entry(k_ref, v_ref, q_ref, o_ref, l_ref):
        def body(k_s, v_s, q_s, p_s, o_s, l_s, bar):
            for src, dst in ((k_ref, k_s), (v_ref, v_s), (q_ref, q_s)):
                plgpu.copy_gmem_to_smem(src, dst, bar.at[0])
            plgpu.barrier_wait(bar.at[0])

            def s_scope(acc):
                plgpu.wgmma(acc, k_s, q_s.T)
                return acc[...]

            st = pl.run_scoped(s_scope, plgpu.ACC((T, n), jnp.float32))
            m = jnp.max(st, axis=0)
            p = jnp.exp2(st - lax.broadcast_in_dim(m, st.shape, [1]))
            l_s[...] = jnp.sum(p, axis=0)
            if p_form in ("as_is", "matched"):
                p_s[...] = p.astype(jnp.bfloat16)
                p_b = p_s
            else:
                plgpu.transpose_ref(p_s, (1, 0))[...] = p.astype(jnp.bfloat16)
                p_b = p_s.T
            plgpu.commit_smem()
            for half in range(D // 64):
                vt = plgpu.transpose_ref(v_s.at[:, pl.ds(half * 64, 64)], (1, 0))  # [64 of D, T]

                def o_scope(acc, vt=vt):
                    plgpu.wgmma(acc, vt, p_b)
                    return acc[...]

                o_s.at[pl.ds(half * 64, 64)][...] = pl.run_scoped(o_scope, plgpu.ACC((64, n), jnp.float32))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_ref)
            plgpu.copy_smem_to_gmem(l_s, l_ref)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            body,
            plgpu.SMEM((T, D), jnp.bfloat16, transforms=tr),
            plgpu.SMEM((T, D), jnp.bfloat16, transforms=v_tr),
            plgpu.SMEM((n, D), jnp.bfloat16, transforms=tr),
            plgpu.SMEM(p_shape, jnp.bfloat16, transforms=p_tr),
            plgpu.SMEM((D, n), jnp.float32),
            plgpu.SMEM((n,), jnp.float32),
            plgpu.Barrier(num_arrivals=3, num_barriers=1),
        )

    out = (jax.ShapeDtypeStruct((D, n), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32))
    return plgpu_kernel(entry, out, grid=(1,), grid_names=("i",), kernel_name=f"probe_head_tile_{n}_{p_form}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lower", action="store_true", help="only lower each variant for cuda (CPU)")
    lower = ap.parse_args().lower
    rng = np.random.default_rng(0)
    for n in (8, 16, 32):
        k = jnp.asarray(rng.standard_normal((T, D)) * 0.2, jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
        q = jnp.asarray(rng.standard_normal((n, D)) * 0.2, jnp.bfloat16)
        for form in ("as_is", "matched", "transposed"):
            name = f"N={n:2d} P^T {form:10s}"
            try:
                fn = jax.jit(build(n, form))
                if lower:
                    fn.trace(k, v, q).lower(lowering_platforms=("cuda",))
                    print(f"{name}: lowered")
                    continue
                o_t, lsum = (np.asarray(a) for a in fn(k, v, q))
                kf, vf, qf = (np.asarray(a, np.float32) for a in (k, v, q))
                s_t = kf @ qf.T
                p_t = np.exp2(s_t - s_t.max(axis=0, keepdims=True))
                want_l = p_t.sum(axis=0)
                want_o = vf.T @ np.asarray(jnp.asarray(p_t, jnp.bfloat16), np.float32)
                print(
                    f"{name}: ok, |o^T| err {np.abs(o_t - want_o).max():.2e} (of {np.abs(want_o).max():.1f}), "
                    f"|l| err {np.abs(lsum - want_l).max():.2e}"
                )
            except Exception as e:  # report and go on
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
