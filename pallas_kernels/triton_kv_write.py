"""The KV-cache write (``set_kv_buffer``) in the Triton language, FP8 quantisation fused.

One program per (token, column block): it reads the token's slot from
``out_cache_loc`` and copies its K and V rows (``num_kv_heads * head_dim``
elements each) into the caches at that slot. For FP8 e4m3 caches the stored value
is ``clamp(x / scale, -448, 448)`` cast to e4m3 (the cast alone would not
saturate; a NaN is stored as the e4m3 NaN with its sign). Slots outside
``[0, num_slots)`` are dropped. :func:`set_kv_buffer`
launches it from JAX through jax-triton with the caches aliased to the outputs (in
place inside a ``jit`` that donates the caches; XLA copies them otherwise); ``jattn.bridge.triton_native``
launches the same source on a torch pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

try:  # the kernel source needs triton.language only when it is compiled or interpreted
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton not installed
    tl = None

from jattn.pallas_kernels import triton_glue
from jattn.pallas_kernels.triton_glue import device_fn

__all__ = ["set_kv_buffer", "unsupported_reason", "launch_params"]


@device_fn
def _store_nan_bytes(dst, xf, mask):
    """Stores the e4m3 NaN byte (``0x7F``, sign of ``xf``) at ``dst`` where ``xf`` (f32) is
    NaN within ``mask``; returns ``mask`` without those entries (for the value store)."""
    nan = (xf != xf) & mask
    sign = ((xf.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    tl.store(dst.to(tl.pointer_type(tl.uint8)), sign | 0x7F, mask=nan)
    return mask & ~nan


@device_fn
def store_row(dst, x, mask, scale, FP8: tl.constexpr):
    """Stores ``x`` at ``dst`` where ``mask``, in the cache's dtype. ``FP8``: the stored
    value is ``clamp(x / scale, -448, 448)`` (the e4m3 cast alone does not saturate, and
    the clamp would turn a NaN into +-448: a NaN is stored as the e4m3 NaN byte with its
    sign instead, as XLA's convert stores it). Otherwise ``x`` is cast (``scale`` unused)."""
    if FP8:
        xf = x.to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(xf, scale), -448.0), 448.0)
        mask = _store_nan_bytes(dst, xf, mask)
        tl.store(dst, y.to(dst.dtype.element_ty), mask=mask)
    else:
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


def _kv_write_kernel(
    k_ptr,  # [T, ROW_K] new K rows
    v_ptr,  # [T, ROW_V]
    loc_ptr,  # i32[T] slots
    scale_ptr,  # f32[2]: k_scale, v_scale (FP8 caches)
    kc_ptr,  # [NUM_SLOTS, ROW_K] the K cache (written in place)
    vc_ptr,  # [NUM_SLOTS, ROW_V]
    NUM_SLOTS: tl.constexpr,
    ROW_K: tl.constexpr,
    ROW_V: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    loc = tl.load(loc_ptr + t)
    ok = (loc >= 0) & (loc < NUM_SLOTS)
    slot = tl.where(ok, loc, 0).to(tl.int64)
    mk = c < tl.where(ok, ROW_K, 0)  # nothing for a dropped slot
    x = tl.load(k_ptr + t.to(tl.int64) * ROW_K + c, mask=mk, other=0.0)
    mv = c < tl.where(ok, ROW_V, 0)
    y = tl.load(v_ptr + t.to(tl.int64) * ROW_V + c, mask=mv, other=0.0)
    store_row(kc_ptr + slot * ROW_K + c, x, mk, tl.load(scale_ptr), FP8)
    store_row(vc_ptr + slot * ROW_V + c, y, mv, tl.load(scale_ptr + 1), FP8)


def unsupported_reason(k_cache, v_cache, out_cache_loc, k, v, **_) -> str | None:
    """None when the kernel can serve this ``set_kv_buffer`` call, else a one-line reason."""
    if k_cache.dtype != v_cache.dtype:
        return f"k_cache dtype {k_cache.dtype} differs from v_cache's {v_cache.dtype}"
    return triton_glue.fp8_reason(k_cache.dtype, k.dtype, v.dtype)


def launch_params(tokens: int, num_slots: int, row_k: int, row_v: int, fp8: bool):
    """``(grid, params)`` of a KV write, shared by the JAX and torch launches: one program
    per (token, column block), blocks of up to 1024 elements over the longer row; ``params``
    holds the constexprs and the launch's warps and stages. The latent write passes its row
    width as both rows and its own width constexprs beside these."""
    width = max(row_k, row_v)
    block = min(1024, 1 << max(4, (width - 1).bit_length()))
    params = dict(NUM_SLOTS=num_slots, BLOCK=block, FP8=fp8, num_warps=4, num_stages=1)
    return (tokens, -(-width // block)), params


@jax.jit
def _write(k_cache, v_cache, out_cache_loc, k, v, scales):
    from jattn.pallas_kernels import triton_glue

    num_pages, page, hkv, d = k_cache.shape
    dv = v_cache.shape[3]
    t = k.shape[0]
    grid, params = launch_params(t, num_pages * page, hkv * d, hkv * dv, jnp.dtype(k_cache.dtype).itemsize == 1)
    kc, vc = triton_glue.triton_call(
        _kv_write_kernel,
        k.reshape(t, hkv * d),
        v.reshape(t, hkv * dv),
        out_cache_loc.astype(jnp.int32),
        scales,
        k_cache.reshape(num_pages * page, hkv * d),
        v_cache.reshape(num_pages * page, hkv * dv),
        out_shape=(
            jax.ShapeDtypeStruct((num_pages * page, hkv * d), k_cache.dtype),
            jax.ShapeDtypeStruct((num_pages * page, hkv * dv), v_cache.dtype),
        ),
        input_output_aliases={4: 0, 5: 1},
        grid=grid,
        name="jattn_triton_kv_write",
        ROW_K=hkv * d,
        ROW_V=hkv * dv,
        **params,
    )
    return kc.reshape(k_cache.shape), vc.reshape(v_cache.shape)


def set_kv_buffer(k_cache, v_cache, out_cache_loc, k, v, *, k_scale=None, v_scale=None):
    """``jattn.set_kv_buffer`` through jax-triton (same arguments and result)."""
    scales = jnp.stack([jnp.asarray(1.0 if s is None else s, jnp.float32).reshape(()) for s in (k_scale, v_scale)])
    return _write(k_cache, v_cache, out_cache_loc, k, v, scales)
