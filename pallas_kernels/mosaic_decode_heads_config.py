"""The per-KV-head decode kernel's build configuration (:class:`HeadsConfig`), what it
serves (:func:`unsupported_reason`), and its launch choices (splits, CTAs, row tiles).
The kernel is in ``mosaic_decode_heads_kernel``, its entry point in ``mosaic_decode_heads``."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jattn.pallas_kernels.combine import NUM_SMS

__all__ = [
    "BLOCK",
    "HeadsConfig",
    "choose_num_splits",
    "item_width",
    "launch_ctas",
    "row_tiles",
    "unsupported_reason",
]

BLOCK = 64  # tokens per block
STAGES = 3  # ring slots, fewer where two CTAs would not fit an SM otherwise
# v_regs (no upcast tile): up to six slots, the bytes in flight of three 2-byte slots at
# 64-token blocks
STAGES_V_REGS = 6
# Two CTAs share an SM (two softmax chains in flight) when each takes at most half of the
# SM's registers and shared memory. ptxas launches a kernel with setmaxnreg at its
# largest count, so the compute warpgroup's count decides: 128 x 256 threads is half the
# register file.
_SMEM_PER_SM = 228 * 1024
_SMEM_RESERVED = 1024  # per CTA
_SMEM_HALF = _SMEM_PER_SM // 2 - _SMEM_RESERVED  # what each of two CTAs may take
_SMEM_SOLO = 227 * 1024 - _SMEM_RESERVED  # one CTA per SM
_PAIR_REGS = 128
_SOLO_REGS = 232


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
    head_dim: int
    group: int  # query heads per KV head
    kv_heads: int
    q_len: int
    is_causal: bool
    page_size: int
    num_pages: int
    max_pages: int
    num_splits: int
    batch: int
    ctas: int  # CTAs launched; each walks the items cta, cta + ctas, ... (see `items`)
    scale: float  # softmax scale times k_scale, built into the kernel
    fp8: bool  # FP8 e4m3 K/V, upcast by the compute warpgroup (V only with fp8_qk)
    interpret: bool
    latent: int = 0  # MLA: one latent KV head, V its first `latent` columns (0: MHA, V its own pool)
    row_tile: int = 0  # query rows per item (16 or 32, fewer than the rows); 0: all rows in one item
    block: int = BLOCK  # tokens per ring block: 64, or 128
    # FP8 only: the query in e4m3 (one power-of-two scale per item) and S^T = K Q^T by an
    # e4m3 wgmma on the landed K tile; only V is upcast
    fp8_qk: bool = False
    # fp8_qk only: V^T goes from the landed e4m3 V tile into registers (upcast there) as the
    # O^T MMA's A operand; no upcast tile
    v_regs: bool = False
    # MHA with 2-byte K/V or v_regs: block i + 1's S^T is issued before block i's softmax
    overlap: bool = False
    # balanced splits: the lengths operand ends with one more entry, a split size in blocks
    # every request of the call shares (combine.balanced_split_blocks), so a long request
    # takes more splits than a short one; else each request cuts its own blocks into
    # num_splits ranges
    balanced: bool = False

    @property
    def tiles(self) -> int:
        """Row tiles of a KV head's query rows: items that read the same K/V blocks."""
        return row_tiles(self.rows, self.row_tile)

    @property
    def v_dim(self) -> int:
        """Columns of V (and of the output)."""
        return self.latent or self.head_dim

    @property
    def rows(self) -> int:
        """Real query rows of a KV head."""
        return self.q_len * self.group

    @property
    def items(self) -> int:
        """Work items, one per (split, request, KV head, row tile)."""
        return self.num_splits * self.batch * self.kv_heads * self.tiles

    @property
    def piece_rows(self) -> int:
        """Tokens of one TMA box: the whole block, or a whole page smaller than it."""
        return min(self.block, self.page_size)

    @property
    def n(self) -> int:
        """The MMA's N: an item's rows padded to 16, 32 or 64 (its P^T rows are 2N bytes, a
        swizzle): the row tile, or all rows."""
        return item_width(self.rows, self.row_tile)

    def smem_bytes(self, stages: int) -> int:
        """Shared memory of one CTA: the K/V ring (one latent tile per slot for MLA), Q,
        P^T, one 64-row half of O^T (f32), the LSE row and, for FP8, the upcast tiles (K and
        V, V alone with ``fp8_qk``, none with ``v_regs``; a causal verify with ``v_regs`` keeps
        a ``[block]`` f32 row of per-key NaN flags), each at 1 KB alignment, plus 4 KB for the barriers
        and the cross-warp reduction's scratch."""
        kv = 1 if self.fp8 else 2
        tiles = 1 if self.latent else 2
        upcast = 0 if self.v_regs or not self.fp8 else 1 if self.fp8_qk else 2
        B, D = self.block, self.head_dim
        flags = B * 4 if self.v_regs and self.is_causal and self.q_len > 1 else 0  # v_regs: per-key NaN rows
        parts = [tiles * stages * B * D * kv, self.n * D * (1 if self.fp8_qk else 2), B * self.n * 2]
        parts += [64 * self.n * 4, self.n * 4] + [B * D * 2] * upcast + ([flags] if flags else [])
        return sum(-(-p // 1024) * 1024 for p in parts) + 4 * 1024

    @property
    def paired(self) -> bool:
        """Two CTAs per SM: 2-byte K/V or FP8 with ``fp8_qk`` (the K and V upcast needs the
        larger register budget), N <= 32 (a [64, N] accumulator pair, the sum tile and the
        scores fit 128 registers) and a ring of at least two slots within half the SM's
        shared memory."""
        return (not self.fp8 or self.fp8_qk) and self.n <= 32 and self.smem_bytes(2) <= _SMEM_HALF

    @property
    def stages(self) -> int:
        """Ring slots: the most (up to ``STAGES``, ``STAGES_V_REGS`` with ``v_regs``) that fit
        the CTA's share of the SM."""
        limit = _SMEM_HALF if self.paired else _SMEM_SOLO
        top = STAGES_V_REGS if self.v_regs else STAGES
        return max([s for s in range(2, top + 1) if self.smem_bytes(s) <= limit], default=2)


def unsupported_reason(q, k_cache, v_cache, page_table=None, cache_seqlens=None, *, max_seqlen_q=1, **kw):
    """None when this kernel can serve the call, else a one-line reason."""
    kv_ok = (q.dtype, jnp.dtype(jnp.float8_e4m3fn))
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_cache.dtype not in kv_ok or v_cache.dtype != k_cache.dtype:
        return f"dtypes q {q.dtype} / k {k_cache.dtype} / v {v_cache.dtype} (bf16 or f16 q; K/V q's dtype or FP8 e4m3)"
    _, ps, hkv, d = k_cache.shape
    if v_cache.shape != k_cache.shape:
        return "v_cache must have k_cache's shape"
    if q.ndim != 3 or q.shape[2] != d:
        return f"q {q.shape} must be [tokens, Hq, head_dim={d}]"
    if ps not in (16, 32, 64, 128):
        return f"page_size={ps} (16, 32, 64 or 128)"
    if d not in (64, 128):
        return f"head_dim={d} (64 or 128)"
    hq = q.shape[1]
    if hq % hkv:
        return f"{hq} query heads are not a multiple of {hkv} KV heads"
    if not 1 <= max_seqlen_q <= 8 or max_seqlen_q * (hq // hkv) > 64:
        return f"max_seqlen_q={max_seqlen_q} x group {hq // hkv} (at most 64 rows per KV head)"
    if kw.get("window_left", -1) != -1 or kw.get("logit_cap", 0.0) != 0.0 or kw.get("sinks") is not None:
        return "window_left, logit_cap and sinks are not supported"
    if q.shape[0] % max_seqlen_q:
        return f"q rows {q.shape[0]} not a multiple of max_seqlen_q={max_seqlen_q}"
    return None


def row_tiles(rows: int, row_tile: int) -> int:
    """Items per (split, request, KV head) for ``rows`` query rows in tiles of ``row_tile``
    (one where ``row_tile`` is 0 or covers the rows)."""
    return -(-rows // row_tile) if 0 < row_tile < rows else 1


def item_width(rows: int, row_tile: int) -> int:
    """An item's query rows padded to the MMA's N: ``row_tile`` where it splits the rows,
    else the rows padded to 16, 32 or 64."""
    return row_tile if row_tiles(rows, row_tile) > 1 else max(16, 1 << (rows - 1).bit_length())


def choose_num_splits(batch: int, kv_heads: int, width_tokens: int, tiles: int = 1, block: int = BLOCK) -> int:
    """Splits that give about two CTAs per SM (one wave where two fit an SM, two waves where
    one does), at most one per block of ``block`` tokens of a page table ``width_tokens``
    wide (columns * page size); ``tiles`` row tiles per KV head."""
    max_blocks = -(-width_tokens // block)
    programs = max(1, batch * kv_heads * tiles)
    return max(1, min(max_blocks, -(-2 * NUM_SMS // programs)))


def launch_ctas(cfg: HeadsConfig, num_ctas: int | None) -> int:
    """CTAs to launch for ``cfg``'s items: ``num_ctas`` when given (at most one per item),
    -1 for one per item, None for the SM slots (two CTAs per SM where ``cfg.paired``)."""
    if num_ctas == -1:
        return cfg.items
    if num_ctas is None:
        num_ctas = (2 if cfg.paired else 1) * NUM_SMS
    return max(1, min(num_ctas, cfg.items))
