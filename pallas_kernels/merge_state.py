"""Fused merge of two partial attentions over disjoint keys (``attn_merge_state``).

The chunked prefix cache attends new tokens causally and each prefix chunk
non-causally, each with its natural-log LSE, and merges the pairs:

    m = max(lse_a, lse_b);  w_x = e^(lse_x - m)
    o = (w_a o_a + w_b o_b) / (w_a + w_b);  lse = m + log(w_a + w_b)

Both ``-inf`` gives ``o = 0, lse = -inf``.

:func:`merge_state` runs it as one Triton-language kernel through jax-triton
(``triton_glue``): one program per block of ``(token, head)`` rows that reads
both outputs and both LSEs once and writes each result once. Instructions sm80
has; any head width (the columns are padded to a power of two and masked).
``jattn.attn_merge_state`` uses it only when asked (``backend="triton"``): XLA's
own fusion of the same arithmetic streams at least as fast on the H200
(docs/PERF.md). Where jax-triton cannot run (CPU, the Mosaic GPU interpreter)
it is the XLA ops of ``jattn.reference.attn_merge_state``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

try:  # the kernel source needs triton.language only when it is compiled or interpreted
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton not installed: XLA merge only
    tl = None

__all__ = ["merge_state", "merge_launch_params"]

_ELEMS = 4096  # elements of one output a program loads (32 per thread at 4 warps)


def _merge_kernel(
    o_a_ptr,  # [R, D] (R = tokens * heads)
    lse_a_ptr,  # f32[R]
    o_b_ptr,  # [R, D]
    lse_b_ptr,  # f32[R]
    o_ptr,  # [R, D] out
    lse_ptr,  # f32[R] out
    R: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,  # D rounded up to a power of two
    BLOCK_R: tl.constexpr,
):
    """Rows ``[pid * BLOCK_R, (pid + 1) * BLOCK_R)`` of the flattened ``(token, head)`` axis."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, DP)
    row_ok = rows < R
    ok = row_ok[:, None] & (cols[None, :] < D)
    # int64 offsets: tokens * heads * D passes 2^31 at long contexts.
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    la = tl.load(lse_a_ptr + rows, mask=row_ok, other=float("-inf"))
    lb = tl.load(lse_b_ptr + rows, mask=row_ok, other=float("-inf"))
    oa = tl.load(o_a_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    ob = tl.load(o_b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    m = tl.maximum(la, lb)  # (a NaN side gives the other: NaN still reaches wa / wb below)
    empty = (la == float("-inf")) & (lb == float("-inf"))
    m = tl.where(empty, 0.0, m)
    wa = tl.exp(la - m)  # 0 for an empty side
    wb = tl.exp(lb - m)
    tot = tl.where(empty, 1.0, wa + wb)
    inv = tl.where(empty, 0.0, 1.0 / tot)
    out = (oa * (wa * inv)[:, None]) + (ob * (wb * inv)[:, None])
    out = tl.where(empty[:, None], 0.0, out)  # 0, not 0 * a non-finite o of an empty side
    tl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=ok)
    tl.store(lse_ptr + rows, tl.where(empty, float("-inf"), m + tl.log(tot)), mask=row_ok)


def merge_launch_params(rows: int, head_dim: int):
    """``(grid, constexprs)`` of :func:`_merge_kernel` for ``rows`` (token, head) rows."""
    dp = 1 << max(0, (head_dim - 1).bit_length())
    block_r = max(1, min(_ELEMS // dp, 1 << max(0, (rows - 1).bit_length())))
    return (-(-rows // block_r),), dict(R=rows, D=head_dim, DP=dp, BLOCK_R=block_r)


def _merge_triton(o_a, lse_a, o_b, lse_b):
    from jattn.pallas_kernels import triton_glue

    t, h, d = o_a.shape
    grid, params = merge_launch_params(t * h, d)
    o, lse = triton_glue.triton_call(
        _merge_kernel,
        o_a.reshape(t * h, d),
        lse_a.astype(jnp.float32).reshape(t * h),
        o_b.reshape(t * h, d),
        lse_b.astype(jnp.float32).reshape(t * h),
        out_shape=(
            jax.ShapeDtypeStruct((t * h, d), o_a.dtype),
            jax.ShapeDtypeStruct((t * h,), jnp.float32),
        ),
        grid=grid,
        name="jattn_merge_state",
        num_warps=4,
        num_stages=1,
        **params,
    )
    return o.reshape(t, h, d), lse.reshape(t, h)


def kernel_runs_here() -> bool:
    """True where :func:`merge_state` launches the Triton kernel (a GPU with jax-triton,
    not under the Mosaic GPU interpreter)."""
    from jattn.pallas_kernels import triton_glue
    from jattn.pallas_kernels.interpret import interpreting

    return not interpreting() and triton_glue.available()


def merge_state(o_a, lse_a, o_b, lse_b, *, use_kernel: bool = True):
    """``(o [T, H, D] in o_a's dtype, lse f32 [T, H])`` merged as the module docstring
    says; the Triton kernel where :func:`kernel_runs_here` and ``use_kernel`` (and there
    is something to merge), else XLA ops. ``o_b`` may have another float dtype than
    ``o_a`` (it is read as f32)."""
    if use_kernel and 0 not in o_a.shape and kernel_runs_here():
        return _merge_triton(o_a, lse_a, o_b, lse_b)
    from jattn import reference

    return reference.attn_merge_state(o_a, lse_a, o_b, lse_b)
