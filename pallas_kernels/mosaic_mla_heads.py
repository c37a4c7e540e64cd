"""DeepSeek MLA absorbed paged decode with the latent rows as the MMA rows (Mosaic GPU, Hopper).

The per-KV-head decode kernel of ``mosaic_decode_heads`` in its MLA mode
(``HeadsConfig.latent``): the latent cache ``[pages, page_size, W]`` is its one KV head of
width ``W``, whose first ``kv_lora_rank`` columns are V, and a request's ``q_len * H`` query
rows (at most 32) are the MMA's N, so the tensor work per token is N / 64 of
``mosaic_mla``'s kernel, whose MMA rows are the query rows. ``mosaic_mla.mla_decode`` runs
it with ``keys_as_rows=True``; by default it runs its own kernel, which measured faster on
the H200 (docs/PERF.md).
"""

from __future__ import annotations

import jax.numpy as jnp

from jattn.pallas_kernels import mosaic_decode_heads, mosaic_mla

__all__ = ["mla_decode", "unsupported_reason"]


def unsupported_reason(q, kv_cache, *, kv_lora_rank, softmax_scale, kv_scale=1.0, max_seqlen_q=1, **_):
    """None when :func:`mla_decode` can serve this ``mla_decode_with_kvcache`` call, else a
    one-line reason."""
    if q.dtype not in (jnp.bfloat16, jnp.float16) or kv_cache.dtype != q.dtype:
        return f"dtypes q {q.dtype} / kv_cache {kv_cache.dtype} (bf16 or f16, the same)"
    if q.ndim != 3 or kv_cache.ndim != 3 or q.shape[2] != kv_cache.shape[2]:
        return f"q {q.shape} must be [tokens, H, width] over kv_cache [pages, page_size, width] {kv_cache.shape}"
    width, ps = kv_cache.shape[2], kv_cache.shape[1]
    if width % 64 or kv_lora_rank % 64 or not 0 < kv_lora_rank <= width:
        return f"latent width {width} / rank {kv_lora_rank} (multiples of 64)"
    if ps not in (16, 32, 64, 128):
        return f"page_size={ps} (16, 32, 64 or 128)"
    if not 1 <= max_seqlen_q <= 8 or max_seqlen_q * q.shape[1] > 32:
        return f"max_seqlen_q={max_seqlen_q} x {q.shape[1]} heads (at most 32 rows)"
    if q.shape[0] % max_seqlen_q:
        return f"q rows {q.shape[0]} not a multiple of max_seqlen_q={max_seqlen_q}"
    numbers = (int, float)
    if not isinstance(kv_scale, numbers) or not isinstance(softmax_scale, numbers):
        return "softmax_scale and kv_scale must be Python numbers (built into the kernel)"
    return None


def mla_decode(
    q,
    kv_cache,
    page_table,
    cache_seqlens,
    *,
    kv_lora_rank: int,
    softmax_scale: float,
    max_seqlen_q: int = 1,
    is_causal: bool = True,
    kv_scale: float = 1.0,
    return_lse: bool = False,
    num_splits: int | None = None,
):
    """MLA absorbed decode as ``jattn.ops.mla_decode_with_kvcache``: ``q [bs * max_seqlen_q,
    H, W]``, ``kv_cache [pages, page_size, W]``; returns ``[bs * max_seqlen_q, H,
    kv_lora_rank]`` in q's dtype (and with ``return_lse`` the natural-log LSE
    ``f32[bs * max_seqlen_q, H]``). ``num_splits``: None for ``mosaic_mla``'s choice (one
    CTA per SM, as here)."""
    from jattn.pallas_kernels.interpret import interpreting

    reason = unsupported_reason(
        q, kv_cache, kv_lora_rank=kv_lora_rank, softmax_scale=softmax_scale, kv_scale=kv_scale,
        max_seqlen_q=max_seqlen_q,
    )  # fmt: skip
    if reason:
        raise ValueError(f"mosaic_mla_heads.mla_decode: {reason}")
    num_pages, ps, width = kv_cache.shape
    bs, max_pages = page_table.shape
    if num_splits is None:
        num_splits = mosaic_mla.choose_num_splits(bs, 1, -(-(max_pages * ps) // mosaic_decode_heads.BLOCK))
    pool = kv_cache.reshape(num_pages, ps, 1, width)
    return mosaic_decode_heads.decode(
        q,
        pool,
        pool,
        page_table,
        cache_seqlens,
        softmax_scale=float(softmax_scale),
        k_scale=float(kv_scale),
        v_scale=float(kv_scale),
        max_seqlen_q=max_seqlen_q,
        is_causal=is_causal,
        return_lse=return_lse,
        num_splits=int(num_splits),
        num_ctas=-1,
        latent=int(kv_lora_rank),
        interpret=interpreting(),
    )
