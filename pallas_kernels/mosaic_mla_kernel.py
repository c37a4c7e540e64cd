"""The Mosaic GPU (Hopper) kernel of the MLA absorbed paged decode: one split of one
request's 64-row query tile against a range of its latent KV blocks. The wrapper around it
(split count, operands, the split combine) is ``mosaic_mla``.

Layout of the work:

* Grid ``(num_splits, batch, row tiles)``. One CTA takes 64 query rows of one
  request and one contiguous range of its KV blocks (``block_n = 64`` tokens: one
  TMA box of ``[64, W]``, or one per page for smaller pages).
* A **producer** warpgroup streams the blocks by TMA into a two-slot ring.
* Warpgroup 0 (**softmax**) computes ``S = Q K^T`` (``wgmma`` over the 576
  columns), the online softmax in base 2, writes ``P`` (bf16/f16) and the row
  rescale factor to shared memory, and accumulates ``P @ V[:, :256]``.
  Warpgroup 1 accumulates ``P @ V[:, 256:]`` from the shared ``P``: the
  ``64 x 512`` f32 accumulator is split across the two warpgroups (128 registers
  each). Warpgroup 0's ``Q K^T`` of block ``i + 1`` overlaps warpgroup 1's
  ``P @ V`` of block ``i``.
* Masked keys contribute nothing, whatever they hold: on the blocks that hold a
  request's last keys (``L - q_len + 1`` and later, the ones some row does not
  see) warpgroup 0 replaces, after its ``Q K^T``, the V entries of keys past the
  length and the non-finite V entries by 0 in shared memory, so ``P = 0`` times
  them is 0. A row that does see a non-finite V entry still comes out NaN: the
  value columns are score columns too, so its score is NaN. Every other block is
  used as loaded.
* Each split writes its normalised partial output and base-2 LSE;
  ``combine.combine_splits`` merges them and applies ``kv_scale`` to the output.
* **FP8 latent cache** (``cfg.fp8``). The query comes in e4m3: quantised by the
  wrapper with one power-of-two scale per row (``cfg.row_scales``: the kernel
  multiplies each row's scores by the score scale over that row's scale), or by the
  caller (no row scales). The TMA lands e4m3 tiles in a ring of
  ``land_stages`` slots (half a 2-byte tile each), and warpgroup 0's ``Q K^T`` is an
  e4m3 ``wgmma`` on the landed tile itself. ``P V`` needs 16-bit V (e4m3 ``wgmma``
  takes no MN-major B, and V as stored is one), so the producer warpgroup also
  upcasts: block by block it writes the landed tile's 512 value columns into one f16
  V slot, once both warpgroups' ``P V`` of the block before is done, and cleans an
  edge block's V there. The GPU converts e4m3 to f16 only (not to bf16), so P, V and
  the partial outputs are f16; the combine writes q's dtype. P has one tile of its
  own, published by warpgroup 0 while its ``P V`` runs (the V slot holding the block
  means warpgroup 1 is done with the last P); the output leaves through the V slot.
  The three warpgroups' register counts sum to three times the launch's: a
  ``set_max_registers`` increase only takes what the decreases gave back.
* **FP8 with V^T in registers** (``cfg.v_regs``, which ``mosaic_mla`` takes where a row
  tile has at most 32 query rows). The landed e4m3 tile serves both MMAs and there is no V
  slot: each warpgroup reads its value columns of the block through a transposed view of
  the tile into registers (``[64, 64]`` chunks of ``V^T``) as soon as the block lands,
  upcasts them there, and after the softmax accumulates ``O^T = V^T P^T`` with ``V^T`` as
  ``wgmma``'s register operand and ``P^T`` a transposed view of one of two P slots, so the
  query rows are that MMA's N (``n_cols``). Warpgroup 0 (``Q K^T``, the softmax) keeps the
  first ``v_split`` value columns and warpgroup 1 the rest; the slot is free once both
  have read it. An edge block's V is cleaned in registers. Each warpgroup's ``O^T`` leaves
  through its own ``[64, 64]`` staging tile, transposed back on the way in.

Named regions (``jax.named_scope``: ``feed_*``, ``wg0_*``, ``wg1_*``) mark each
warpgroup's waits and work; they cost nothing unless the kernel is built with the Mosaic
GPU profiler on (``CompilerParams(profile_space=..., profile_dir=...)``), which then
records when each region starts and ends in every warpgroup.

Register layouts: every register value derives its layout from an annotated source
(the ``wgmma`` accumulator, a ``layout_cast``, or an iota built with a layout), and no
two iotas of one shape and dimension are cast to different layouts: Mosaic GPU runs
``canonicalize,cse`` before its layout inference, which merges identical ops, and a
value cast to two layouts (or an iota whose uses fold away) leaves the search with
no solution.

The f32 oracle is ``jattn.reference.mla_decode``. Under the Mosaic GPU interpreter (CPU
tests) the matmuls are plain dots on the shared-memory tiles; the rest is the kernel
that runs on the GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn.pallas_kernels.mosaic_common import (
    cast_layout,
    drain_free_barriers,
    load_layout,
    plgpu_kernel,
    split_blocks,
    swizzle_transforms,
    tile_iota,
    unless_empty_split,
    vec_iota,
)
from jattn.pallas_kernels.mosaic_mla_config import (
    BLOCK_N,
    FP8_LAND_STAGES,
    NUM_STAGES,
    REGISTERS,
    REGISTERS_FP8,
    MLADecodeConfig,
)

__all__ = ["BLOCK_N", "FP8_LAND_STAGES", "NUM_STAGES", "MLADecodeConfig", "run"]

_LOG2E = math.log2(math.e)


def _kernel(
    cfg: MLADecodeConfig,
    dtype,
    # inputs
    page_table_ref,  # i32[bs, max_pages]
    lens_ref,  # i32[bs] (balanced: i32[bs + 1], the split size last)
    scale_ref,  # f32[1]: score scale (softmax_scale * kv_scale); None when cfg.score_scale is
    qs_ref,  # row_scales: f32[bs, m_tiles * 64], each query row's factor (1 / its scale); else None
    q_ref,  # [bs, m_rows8, W] (FP8: e4m3)
    kv_ref,  # [num_pages, page_size, W]
    # outputs
    o_ref,  # [splits, bs, m_rows8, R] (normalised per split)
    lse_ref,  # f32[splits, bs, m_rows8] (base 2)
    # scratch
    q_smem,  # [64, W] (bf16/f16: the output tile reuses its first R columns)
    kv_smem,  # [S, BN, W]
    row_smem,  # f32[3, 64]: the rescale factor of each P slot (FP8 upcast: one), then the final 1 / l
    lse_smem,  # f32[64]
    kv_bar,
    kv_free,  # per slot: the slot may be refilled (FP8 upcast: warpgroup 0's Q K^T has read it)
    q_bar,
    p_ready,  # per P slot (FP8 upcast: one): warpgroup 0 has written the block's P and rescale factor
    fin,  # warpgroup 0 is done with Q (the output may overwrite it) and wrote 1 / l
    fp8_scratch,  # FP8 upcast: (qs_smem f32[64], v_smem [BN, R], p_smem [64, BN], v_ready, v_free);
    # with v_regs: (qs_smem, stage_smem [2, 64, 64], p_smem [2, 64, BN], p_free)
):
    BN, S, H, HALF, R = BLOCK_N, cfg.stages, cfg.num_heads, cfg.half, cfg.rank
    split = lax.axis_index("split")
    b = lax.axis_index("b")
    mt = lax.axis_index("mt")
    wg = lax.axis_index("wg")
    interp = cfg.interpret
    seq_len = lens_ref[b]
    per = lens_ref[lens_ref.shape[0] - 1] if cfg.balanced else None  # the call's split size
    lo, count = split_blocks(seq_len, BN, cfg.num_splits, split, per)
    # the first key that some query row of the request does not see (causal drafts)
    first_partial = seq_len - cfg.q_len + 1 if cfg.is_causal else seq_len

    def full_blocks():
        """Blocks wholly before it: used as loaded; the (at most two) later ones are edge blocks."""
        return jnp.clip(lax.div(first_partial, jnp.int32(BN)) - lo, 0, count)

    v_regs = cfg.v_regs
    if v_regs:
        qs_smem, stage_smem, p_smem, p_free = fp8_scratch
        v_smem = v_ready = v_free = None
    elif cfg.fp8:
        qs_smem, v_smem, p_smem, v_ready, v_free = fp8_scratch
    regs = REGISTERS_FP8 if cfg.upcast else REGISTERS

    def p_tile(slot):
        """Where a block's P lives. bf16/f16: the ring slot's last 64 columns (the rope
        part of K, which only Q K^T reads), so P is double-buffered with the ring. FP8:
        one [64, 64] tile of its own, written once the V slot holds the block (so once
        warpgroup 1's P V of the block before has read the last P)."""
        if cfg.fp8:
            return p_smem
        return kv_smem.at[slot, :, pl.ds(R, BN)]

    def v_tile(slot, col0):
        """V[:, col0:col0 + HALF] of a block: the ring slot, or FP8 the one upcast V slot."""
        if cfg.fp8:
            return v_smem.at[:, pl.ds(col0, HALF)]
        return kv_smem.at[slot, :, pl.ds(col0, HALF)]

    out_smem = v_smem if cfg.fp8 else q_smem  # the output tile: free once the last P V has run

    def clean(v_ref, k0):
        """An edge block's V entries of keys past the length, and non-finite ones, become 0
        (``v_ref``: the block's ``[BN, R]`` value columns in 2-byte floats)."""
        keyrow = tile_iota((64, BN), 0, interpret=interp) + k0
        inside = keyrow < seq_len
        for c in range(0, R, 64):
            piece = v_ref.at[:, pl.ds(c, 64)]
            v = piece[...]
            piece[...] = jnp.where(inside & (v - v == 0), v, jnp.zeros(v.shape, v.dtype))

    def _feed_fp8(fetch):
        """FP8: this warpgroup also upcasts. It keeps the landing ring full and, block by
        block, writes the landed tile's value columns into the V slot in f16 (exact: every
        e4m3 value is an f16 value), edge blocks cleaned, once both warpgroups'
        P V of the block before is done. Warpgroup 0's Q K^T reads the e4m3 tile itself."""
        n_full = full_blocks()
        for j in range(S):

            @pl.when(count > j)
            def _():
                fetch(j, lo + j)

        @pl.loop(0, count)
        def _feed(i):
            slot = lax.rem(i, jnp.int32(S))
            with jax.named_scope("feed_wait_landed"):
                plgpu.barrier_wait(kv_bar.at[slot])

            @pl.when(i > 0)
            def _():
                with jax.named_scope("feed_wait_v_free"):
                    plgpu.barrier_wait(v_free.at[0])

            with jax.named_scope("feed_upcast"):
                for c in range(0, R, 64):
                    v_smem.at[:, pl.ds(c, 64)][...] = kv_smem.at[slot, :, pl.ds(c, 64)][...].astype(dtype)

                @pl.when(i >= n_full)
                def _():
                    clean(v_smem, (lo + i) * BN)

                plgpu.commit_smem()  # also a warpgroup barrier: every thread's reads of the slot are done
            plgpu.barrier_arrive(v_ready.at[0])

            @pl.when(i + S < count)
            def _():
                with jax.named_scope("feed_wait_slot"):
                    plgpu.barrier_wait(kv_free.at[slot])
                fetch(slot, lo + i + S)

        if interp:
            drain_free_barriers(count, S, kv_free)
            drain_free_barriers(count, 1, v_free)

    @pl.when(wg == 2)
    def _producer():
        if not interp:
            plgpu.set_max_registers(regs[2], action="decrease")

        def fetch(slot, blk):
            ps = cfg.page_size
            if cfg.pieces == 1:
                per_page = ps // BN
                pidx = jnp.minimum(lax.div(blk, jnp.int32(per_page)), cfg.max_pages - 1)
                page = jnp.clip(page_table_ref[b, pidx], 0, cfg.num_pages - 1)
                row = lax.rem(blk, jnp.int32(per_page)) * BN
                plgpu.copy_gmem_to_smem(kv_ref.at[page, pl.ds(row, BN)], kv_smem.at[slot], kv_bar.at[slot])
                return
            for j in range(cfg.pieces):
                pidx = jnp.minimum(blk * cfg.pieces + j, cfg.max_pages - 1)
                page = jnp.clip(page_table_ref[b, pidx], 0, cfg.num_pages - 1)
                plgpu.copy_gmem_to_smem(kv_ref.at[page], kv_smem.at[slot, pl.ds(j * ps, ps)], kv_bar.at[slot])

        if cfg.upcast:
            _feed_fp8(fetch)
            return

        @pl.loop(0, count)
        def _fetch(i):
            slot = lax.rem(i, jnp.int32(S))

            @pl.when(i >= S)
            def _():
                plgpu.barrier_wait(kv_free.at[slot])

            fetch(slot, lo + i)

        if interp:
            drain_free_barriers(count, S, kv_free)

    def per_tile(fn):
        """``fn(rows)`` with this tile's rows that are read and written: 64, or the last
        tile's :attr:`MLADecodeConfig.last_rows8` (a static count under each branch)."""
        if cfg.m_tiles == 1:
            fn(cfg.last_rows8)
        else:
            pl.when(mt < cfg.m_tiles - 1)(functools.partial(fn, 64))
            pl.when(mt == cfg.m_tiles - 1)(functools.partial(fn, cfg.last_rows8))

    def store_output(fn):
        """:func:`per_tile` for the output's stores (:func:`unless_empty_split`: the splits
        a short request leaves empty write their 64 LSE values, not the output's rows)."""
        unless_empty_split(lambda: per_tile(fn), count, cfg.num_splits)

    def cast(x, layout):
        return cast_layout(x, layout, interpret=interp)

    def load_rows(ref):
        """A [64] f32 vector from shared memory in the accumulator's row layout."""
        return load_layout(ref, plgpu.Layout.WGMMA.reduce(1), interpret=interp)

    def pv(acc, p, v, after_issue=lambda: None):
        """acc + P @ v (``v``: a [BN, HALF] value tile); ``after_issue()`` runs while the
        MMA is in flight."""
        if interp:
            p = p if isinstance(p, jax.Array) else p[...]
            acc = acc + jnp.dot(p, v[...], preferred_element_type=jnp.float32)
            after_issue()
            return acc

        def body(acc_ref):
            plgpu.wgmma(acc_ref, p, v)
            after_issue()

        return pl.run_state(body)(plgpu.ACC.init(acc))

    N, C0 = cfg.n_cols, cfg.v_split

    def load_cols(ref):
        """An [N] f32 vector from shared memory in the accumulator's column layout (``v_regs``:
        the query rows are the columns of ``O^T``)."""
        return load_layout(ref, plgpu.Layout.WGMMA.reduce(0), interpret=interp)

    def load_vt(slot, col0, k0, edge: bool):
        """``v_regs``: ``V^T[col0:col0 + 64]`` of the block in ``slot`` (``[64, BN]``), read
        from the landed e4m3 tile into registers through a transposed view and upcast
        there; on an edge block keys past the length and non-finite entries become 0."""
        tile = kv_smem.at[slot, :, pl.ds(col0, 64)]
        if interp:
            v = tile[...].astype(dtype).T
        else:
            v = load_layout(tile.T, plgpu.Layout.WGMMA_TRANSPOSED, interpret=False, optimized=True)
            v = plgpu.layout_cast(v.astype(dtype), plgpu.Layout.WGMMA)
        if edge:
            key = tile_iota((64, BN), 1, interpret=interp) + k0
            v = jnp.where((key < seq_len) & (v - v == 0), v, jnp.zeros(v.shape, v.dtype))
        return v

    def pvt(accs, vs, ps, alpha):
        """``v_regs``: the ``O^T`` chunks ``[64, N]`` times ``alpha`` (per column) plus
        ``V^T P^T``, ``vs`` being the chunks' ``V^T`` in registers and ``P^T`` P slot ``ps``
        through a transposed view."""
        accs = [a * lax.broadcast_in_dim(alpha, a.shape, [1]) for a in accs]
        p_ref = p_smem.at[ps, pl.ds(0, N)]
        if interp:
            p = p_ref[...]
            return [a + jnp.dot(v, p.T, preferred_element_type=jnp.float32) for a, v in zip(accs, vs)]

        def body(acc_refs):
            for acc_ref, v in zip(acc_refs, vs):
                plgpu.wgmma(acc_ref, v, p_ref.T)

        return list(pl.run_state(body)(tuple(plgpu.ACC.init(a) for a in accs)))

    def write_out_t(accs, inv, col0, stage):
        """``v_regs``: this warpgroup's ``O^T`` chunks, normalised per column, transposed
        back into ``O`` through ``stage`` (``[64, 64]``, a transposed view of its first
        N rows) and to GMEM in [8, 64] boxes of the real rows."""
        for c, a in enumerate(accs):
            o = (a * lax.broadcast_in_dim(inv, a.shape, [1])).astype(dtype)
            if c:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            if interp:
                stage.at[pl.ds(0, N)][...] = o.T
            else:
                ot = plgpu.layout_cast(o, plgpu.Layout.WGMMA_TRANSPOSED)
                stage.at[pl.ds(0, N)].T[...] = ot
            plgpu.commit_smem()

            def store(rows, c=c):
                for r in range(0, rows, 8):
                    plgpu.copy_smem_to_gmem(
                        stage.at[pl.ds(r, 8)], o_ref.at[split, b, pl.ds(mt * 64 + r, 8), pl.ds(col0 + 64 * c, 64)]
                    )

            store_output(store)

    def write_out(acc, inv, col0):
        """This warpgroup's normalised half of the output through the output tile (Q's
        shared memory, or FP8 the V slot: free by now), to GMEM in [8, 64] boxes (a
        column slice of the tiled tile is not one contiguous TMA source). Only the boxes
        holding a real row are written: with 16 heads and one query token a tile has 16
        real rows of 64."""
        out_smem.at[:, pl.ds(col0, HALF)][...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()

        def store(rows):
            for r in range(0, rows, 8):
                for c in range(col0, col0 + HALF, 64):
                    plgpu.copy_smem_to_gmem(
                        out_smem.at[pl.ds(r, 8), pl.ds(c, 64)], o_ref.at[split, b, pl.ds(mt * 64 + r, 8), pl.ds(c, 64)]
                    )

        store_output(store)

    def acc_init(cols=HALF):
        """A warpgroup's zero output: ``[64, HALF]``, or with ``v_regs`` the ``O^T`` chunks of
        its ``cols`` value columns."""
        if v_regs:
            return [cast(jnp.full((64, N), 0.0, jnp.float32), plgpu.Layout.WGMMA) for _ in range(cols // 64)]
        return cast(jnp.full((64, HALF), 0.0, jnp.float32), plgpu.Layout.WGMMA)

    @pl.when(wg == 0)
    def _softmax_wg():
        if not interp:
            plgpu.set_max_registers(regs[0], action="increase")

        # Only the real query rows are loaded (q is padded to a multiple of 8 rows, not
        # 64); the tile's other rows hold whatever the shared memory held. Rows are
        # independent through Q K^T, the softmax and P @ V, and those rows are not written.
        def load_q(rows):
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(mt * 64, rows)], q_smem.at[pl.ds(0, rows)], q_bar.at[0])

        per_tile(load_q)
        if cfg.row_scales:  # all 64 (a copy of fewer than 128 bytes is refused)
            plgpu.copy_gmem_to_smem(qs_ref.at[b, pl.ds(mt * 64, 64)], qs_smem, q_bar.at[0])
        plgpu.barrier_wait(q_bar.at[0])
        xscale = (scale_ref[0] if cfg.score_scale is None else cfg.score_scale) * _LOG2E
        # FP8: each row's score factor, the score scale over the row's quantisation scale; kept
        # as a row vector (a few registers), broadcast over the block's keys where it is used
        xrows = load_rows(qs_smem) * xscale if cfg.row_scales else None
        if cfg.is_causal:
            rows = vec_iota(64, 0, interpret=interp) + mt * 64  # request row i * H + h
            row_q = lax.div(rows, jnp.int32(H))  # its query index i
            # the last key each row sees (padding rows: the last key of the request)
            limit = jnp.minimum(seq_len - cfg.q_len + row_q, seq_len - 1)
        else:
            # Every row sees every key. A scalar limit, not a row vector that folds to one:
            # an iota left with no use that fixes its layout fails layout inference.
            limit = seq_len - 1

        def qk(slot):
            k = kv_smem.at[slot]
            if interp:
                q, kk = q_smem[...], k[...]
                if cfg.fp8:
                    q, kk = q.astype(jnp.float32), kk.astype(jnp.float32)
                return lax.dot_general(q, kk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

            def scope(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k.T)
                return acc_ref[...]

            return pl.run_scoped(scope, plgpu.ACC((64, BN), jnp.float32))

        def step(i, carry, edge: bool):
            """Block ``lo + i``. An ``edge`` block holds keys some row does not see (past
            the length, or a later draft token): masked and cleaned; the others are
            used as loaded."""
            acc, m_i, l_i = carry
            slot = lax.rem(i, jnp.int32(S))
            blk = lo + i
            k0 = blk * BN
            with jax.named_scope("wg0_wait_landed"):
                plgpu.barrier_wait(kv_bar.at[slot])
            if cfg.fp8:
                with jax.named_scope("wg0_qk"):
                    x = qk(slot)
                    x = x * (xscale if xrows is None else lax.broadcast_in_dim(xrows, x.shape, [0]))
                if not v_regs:
                    plgpu.barrier_arrive(kv_free.at[slot])  # the upcast of its V is the feeder's
                else:  # V^T read before the softmax, held in registers through it
                    with jax.named_scope("wg0_load_v"):
                        vs = [load_vt(slot, c, k0, edge) for c in range(0, C0, 64)]
                    plgpu.barrier_arrive(kv_free.at[slot])
            else:
                with jax.named_scope("wg0_qk"):
                    x = qk(slot) * xscale
            if edge:
                # built as a tile, not a [64] vector broadcast: a [64] column iota is the same
                # op as the row iota above, so CSE would merge them before layout inference,
                # which then finds no layout for the one value cast to both
                cols = tile_iota((64, BN), 1, interpret=interp) + k0
                ok = cols <= (lax.broadcast_in_dim(limit, (64, BN), [0]) if cfg.is_causal else limit)
                x = jnp.where(ok, x, -jnp.inf)
            m_new = jnp.maximum(m_i, x.max(axis=1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m_i - m_use)
            p = jnp.exp2(x - lax.broadcast_in_dim(m_use, x.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            if edge and not cfg.fp8:
                clean(kv_smem.at[slot], k0)  # made visible to warpgroup 1 by the commit below
            p16 = p.astype(dtype)
            if v_regs:  # P slot i % 2 is free once warpgroup 1's P V of block i - 2 is done
                ps = lax.rem(i, jnp.int32(2))

                @pl.when(i >= 2)
                def _():
                    with jax.named_scope("wg0_wait_p_free"):
                        plgpu.barrier_wait(p_free.at[ps])

                p_smem.at[ps][...] = p16
                row_smem[ps] = alpha
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready.at[ps])
                with jax.named_scope("wg0_pv"):
                    acc = pvt(acc, vs, ps, load_cols(row_smem.at[ps, pl.ds(0, N)]))
                return acc, m_new, l_i

            def publish():  # P and the rescale factor, for warpgroup 1
                p_tile(slot)[...] = p16
                row_smem[0 if cfg.fp8 else slot] = alpha
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready.at[0 if cfg.fp8 else slot])

            if cfg.fp8:  # the one P tile is free once the V slot holds this block
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                with jax.named_scope("wg0_wait_v"):
                    plgpu.barrier_wait(v_ready.at[0])
                with jax.named_scope("wg0_pv"):
                    acc = pv(acc, p16, v_tile(slot, 0), after_issue=publish)
                plgpu.barrier_arrive(v_free.at[0])
                return acc, m_new, l_i
            publish()
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            with jax.named_scope("wg0_pv"):
                acc = pv(acc, p16, v_tile(slot, 0))
            plgpu.barrier_arrive(kv_free.at[slot])
            return acc, m_new, l_i

        m_i = cast(jnp.full((64,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = cast(jnp.full((64,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = acc_init(C0)
        n_full = full_blocks()
        carry = lax.fori_loop(0, n_full, functools.partial(step, edge=False), (acc, m_i, l_i))
        acc, m_i, l_i = lax.fori_loop(n_full, count, functools.partial(step, edge=True), carry)
        if v_regs and interp:
            drain_free_barriers(count, 2, p_free)

        empty = l_i == 0.0
        inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l_i))
        row_smem[2] = inv
        lse_smem[...] = jnp.where(empty, -jnp.inf, jnp.where(empty, 0.0, m_i) + jnp.log2(jnp.where(empty, 1.0, l_i)))
        plgpu.commit_smem()
        plgpu.barrier_arrive(fin.at[0])
        per_tile(
            lambda rows: plgpu.copy_smem_to_gmem(
                lse_smem.at[pl.ds(0, rows)], lse_ref.at[split, b, pl.ds(mt * 64, rows)]
            )
        )
        if v_regs:
            write_out_t(acc, load_cols(row_smem.at[2, pl.ds(0, N)]), 0, stage_smem.at[0])
        else:
            write_out(acc, inv, 0)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _value_wg():
        if not interp:
            plgpu.set_max_registers(regs[1], action="increase")

        def step(i, acc):
            slot = lax.rem(i, jnp.int32(S))
            ps = 0 if cfg.fp8 else slot
            with jax.named_scope("wg1_wait_v"):
                plgpu.barrier_wait(v_ready.at[0] if cfg.fp8 else kv_bar.at[slot])
            with jax.named_scope("wg1_wait_p"):
                plgpu.barrier_wait(p_ready.at[ps])
            alpha = load_rows(row_smem.at[ps])
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            with jax.named_scope("wg1_pv"):
                acc = pv(acc, p_tile(slot), v_tile(slot, HALF))
            plgpu.barrier_arrive(v_free.at[0] if cfg.fp8 else kv_free.at[slot])
            return acc

        def step_t(i, acc, edge: bool):
            """``v_regs``: block ``lo + i``'s ``O^T`` chunks of the value columns C0 on."""
            slot = lax.rem(i, jnp.int32(S))
            ps = lax.rem(i, jnp.int32(2))
            k0 = (lo + i) * BN
            with jax.named_scope("wg1_wait_v"):
                plgpu.barrier_wait(kv_bar.at[slot])
            with jax.named_scope("wg1_load_v"):  # while warpgroup 0 computes P
                vs = [load_vt(slot, c, k0, edge) for c in range(C0, R, 64)]
            plgpu.barrier_arrive(kv_free.at[slot])
            with jax.named_scope("wg1_wait_p"):
                plgpu.barrier_wait(p_ready.at[ps])
            with jax.named_scope("wg1_pv"):
                acc = pvt(acc, vs, ps, load_cols(row_smem.at[ps, pl.ds(0, N)]))
            plgpu.barrier_arrive(p_free.at[ps])
            return acc

        if v_regs:
            n_full = full_blocks()
            acc = lax.fori_loop(0, n_full, functools.partial(step_t, edge=False), acc_init(R - C0))
            acc = lax.fori_loop(n_full, count, functools.partial(step_t, edge=True), acc)
            plgpu.barrier_wait(fin.at[0])
            write_out_t(acc, load_cols(row_smem.at[2, pl.ds(0, N)]), C0, stage_smem.at[1])
            plgpu.wait_smem_to_gmem(0)
            return

        acc = lax.fori_loop(0, count, step, acc_init())
        plgpu.barrier_wait(fin.at[0])
        write_out(acc, load_rows(row_smem.at[2]), HALF)
        plgpu.wait_smem_to_gmem(0)


def run(cfg: MLADecodeConfig, dtype, page_table, lens, scale, qs, q, kv):
    """The kernel's partial outputs ``([splits, bs, m_rows8, R] in dtype, f32[splits, bs,
    m_rows8] base-2 LSE)``. ``scale``: f32[1] or None (``cfg.score_scale``); ``qs``: with
    ``cfg.row_scales`` only, f32[bs, m_tiles * 64] row factors of the e4m3 ``q``."""
    bs, rows = q.shape[0], cfg.m_rows8
    BN, S, W = BLOCK_N, cfg.stages, cfg.width
    out_type = (
        jax.ShapeDtypeStruct((cfg.num_splits, bs, rows, cfg.rank), dtype),
        jax.ShapeDtypeStruct((cfg.num_splits, bs, rows), jnp.float32),
    )
    tiles = [
        plgpu.SMEM((64, W), q.dtype, transforms=swizzle_transforms(q.dtype, W)),
        plgpu.SMEM((S, BN, W), kv.dtype, transforms=swizzle_transforms(kv.dtype, W)),
    ]
    rows_f32 = [plgpu.SMEM((3, 64), jnp.float32), plgpu.SMEM((64,), jnp.float32)]
    barriers = [
        plgpu.Barrier(num_arrivals=cfg.pieces, num_barriers=S),
        plgpu.Barrier(num_arrivals=1 if cfg.upcast else 2, num_barriers=S),
        plgpu.Barrier(num_arrivals=2 if cfg.row_scales else 1, num_barriers=1),
        plgpu.Barrier(num_arrivals=1, num_barriers=2),
        plgpu.Barrier(num_arrivals=1, num_barriers=1),
    ]
    if cfg.v_regs:  # output staging tiles (one per warpgroup), two P slots
        tiles += [
            plgpu.SMEM((2, 64, 64), dtype, transforms=swizzle_transforms(dtype, 64)),
            plgpu.SMEM((2, 64, BN), dtype, transforms=swizzle_transforms(dtype, BN)),
        ]
        rows_f32.append(plgpu.SMEM((64,), jnp.float32))
        barriers.append(plgpu.Barrier(num_arrivals=1, num_barriers=2))
    elif cfg.upcast:  # the swizzled tiles first: fewer alignment gaps (the FP8 build is near the limit)
        tiles += [
            plgpu.SMEM((BN, cfg.rank), dtype, transforms=swizzle_transforms(dtype, cfg.rank)),
            plgpu.SMEM((64, BN), dtype, transforms=swizzle_transforms(dtype, BN)),
        ]
        rows_f32.append(plgpu.SMEM((64,), jnp.float32))
        barriers += [plgpu.Barrier(num_arrivals=1, num_barriers=1), plgpu.Barrier(num_arrivals=2, num_barriers=1)]

    def entry(*refs):
        refs = list(refs)
        if scale is None:
            refs.insert(2, None)
        if qs is None:
            refs.insert(3, None)

        def body(*scratch):
            q_smem, kv_smem, *scratch = scratch
            v_smem, p_smem, *scratch = scratch if cfg.fp8 else (None, None, *scratch)
            row_smem, lse_smem, *scratch = scratch
            qs_smem, *bars = scratch if cfg.fp8 else (None, *scratch)
            fp8_scratch = (qs_smem, v_smem, p_smem, *bars[5:]) if cfg.fp8 else None  # v_smem: v_regs' staging
            _kernel(cfg, dtype, *refs, q_smem, kv_smem, row_smem, lse_smem, *bars[:5], fp8_scratch)

        pl.run_scoped(body, *tiles, *rows_f32, *barriers, collective_axes="wg")

    causal = "_causal" if cfg.is_causal else ""
    fp8 = ("_fp8_vregs" if cfg.v_regs else "_fp8") if cfg.fp8 else ""
    kernel = plgpu_kernel(
        entry,
        out_type,
        grid=(cfg.num_splits, bs, cfg.m_tiles),
        grid_names=("split", "b", "mt"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name=f"jattn_mla_decode_p{cfg.page_size}_q{cfg.q_len}{causal}{fp8}",
    )
    operands = [page_table, lens] + ([] if scale is None else [scale]) + ([] if qs is None else [qs])
    return kernel(*operands, q, kv)
