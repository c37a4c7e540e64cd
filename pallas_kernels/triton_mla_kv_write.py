"""The MLA latent-cache write (``set_mla_kv_buffer``) in the Triton language, FP8
quantisation fused.

One program per (token, column block) of the latent row ``[c_kv (R), k_pe (r)]``: it
reads the token's slot from ``out_cache_loc``, takes the row's columns from ``c_kv``
(the first ``R``) and ``k_pe`` (the rest) as they are, with no concatenated copy, and
stores them in the cache's dtype (``triton_kv_write.store_row``: for an FP8 e4m3 cache
``clamp(x / kv_scale, -448, 448)``, a NaN stored as the e4m3 NaN with its sign). Slots
outside ``[0, num_slots)`` are dropped. :func:`set_mla_kv_buffer` launches it from JAX
through jax-triton with the cache aliased to the output (in place inside a ``jit`` that
donates the cache; XLA copies it otherwise); ``jattn.bridge.triton_native`` launches the
same source on a torch latent pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

try:  # the kernel source needs triton.language only when it is compiled or interpreted
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton not installed
    tl = None

from jattn.pallas_kernels.triton_kv_write import launch_params, store_row

__all__ = ["set_mla_kv_buffer", "unsupported_reason"]


def _mla_kv_write_kernel(
    ckv_ptr,  # [T, R] the latent rows
    kpe_ptr,  # [T, RPE] the rope rows
    loc_ptr,  # i32[T] slots
    scale_ptr,  # f32[1]: kv_scale (FP8 caches)
    kv_ptr,  # [NUM_SLOTS, R + RPE] the latent cache (written in place)
    NUM_SLOTS: tl.constexpr,
    R: tl.constexpr,
    RPE: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    loc = tl.load(loc_ptr + t)
    ok = (loc >= 0) & (loc < NUM_SLOTS)
    slot = tl.where(ok, loc, 0).to(tl.int64)
    mask = c < tl.where(ok, R + RPE, 0)  # nothing for a dropped slot
    in_ckv = c < R
    x = tl.load(ckv_ptr + t * R + tl.minimum(c, R - 1), mask=mask & in_ckv, other=0.0).to(tl.float32)
    y = tl.load(kpe_ptr + t * RPE + tl.maximum(c - R, 0), mask=mask & (c >= R), other=0.0)
    row = tl.where(in_ckv, x, y.to(tl.float32))
    store_row(kv_ptr + slot * (R + RPE) + c, row, mask, tl.load(scale_ptr), FP8)


def unsupported_reason(kv_cache, out_cache_loc, c_kv, k_pe, **_) -> str | None:
    """None when the kernel can serve this ``set_mla_kv_buffer`` call, else a one-line reason."""
    from jattn.pallas_kernels import triton_glue

    return triton_glue.fp8_reason(kv_cache.dtype, c_kv.dtype, k_pe.dtype)


@jax.jit
def _write(kv_cache, out_cache_loc, c_kv, k_pe, scale):
    from jattn.pallas_kernels import triton_glue

    num_pages, page, w = kv_cache.shape
    t = out_cache_loc.shape[0]
    r, rpe = c_kv.shape[-1], k_pe.shape[-1]
    grid, params = launch_params(t, num_pages * page, w, w, jnp.dtype(kv_cache.dtype).itemsize == 1)
    (kv,) = triton_glue.triton_call(
        _mla_kv_write_kernel,
        c_kv.reshape(t, r),
        k_pe.reshape(t, rpe),
        out_cache_loc.astype(jnp.int32),
        scale,
        kv_cache.reshape(num_pages * page, w),
        out_shape=(jax.ShapeDtypeStruct((num_pages * page, w), kv_cache.dtype),),
        input_output_aliases={4: 0},
        grid=grid,
        name="jattn_triton_mla_kv_write",
        R=r,
        RPE=rpe,
        **params,
    )
    return kv.reshape(kv_cache.shape)


def set_mla_kv_buffer(kv_cache, out_cache_loc, c_kv, k_pe, *, kv_scale=None):
    """``jattn.set_mla_kv_buffer`` through jax-triton (same arguments and result)."""
    scale = jnp.asarray(1.0 if kv_scale is None else kv_scale, jnp.float32).reshape(1)
    return _write(kv_cache, out_cache_loc, c_kv, k_pe, scale)
