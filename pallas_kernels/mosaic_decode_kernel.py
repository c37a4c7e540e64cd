"""The Mosaic GPU (Hopper) paged decode kernel: the split-KV body (:func:`_decode_kernel`)
and its launch (:func:`_run_kernel`: the TMA ring, barriers and shared-memory layout of a
:class:`~jattn.pallas_kernels.decode_tuning.DecodeConfig`), which writes each split's
normalised partial output and base-2 LSE. The layout of the work, the masking rules and
the entry point (``mha_decode``) are in :mod:`jattn.pallas_kernels.mosaic_decode`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn.pallas_kernels.decode_tuning import (
    DecodeConfig,
)
from jattn.pallas_kernels.mosaic_common import (
    cast_layout,
    drain_free_barriers,
    load_layout,
    plgpu_kernel,
    swizzle_transforms,
    unless_empty_split,
    vec_iota,
)

_LOG2E = math.log2(math.e)


# ---------------------------------------------------------------------------
# The kernel.
def _has_partial_columns(cfg: DecodeConfig) -> bool:
    """Whether some key is seen by some queries of a request and not by others (several
    queries per request with a causal mask or a window)."""
    return cfg.q_len > 1 and (cfg.is_causal or cfg.window_left >= 0)


def request_blocks(cfg: DecodeConfig, seq_len):
    """``(first, end)`` KV block a request of ``seq_len`` keys is read over: from the
    window's first block (0 without a window) to the block past its last key. Scalars in
    the kernel; arrays of lengths too (the balanced split size counts them the same way)."""
    btb = jnp.int32(cfg.bs.block_tokens * cfg.bs.pages_per_block)
    hi_blk = lax.div(seq_len + (btb - 1), btb)
    if cfg.window_left >= 0:
        lo_blk = lax.div(jnp.maximum(seq_len - cfg.q_len - cfg.window_left, 0), btb)
    else:
        lo_blk = jnp.int32(0)
    return lo_blk, hi_blk


def _decode_kernel(
    cfg: DecodeConfig,
    dtype,
    # inputs
    page_table_ref,  # i32[bs, max_pages]            GMEM
    lens_ref,  # i32[bs] (balanced: [bs + 1], the split size last) GMEM
    scale_ref,  # f32[1] score scale (sm_scale * k_scale)
    q_ref,  # [bs, m_pad, D]                GMEM
    k_ref,  # [num_pages, page_size*Hkv, D] GMEM
    v_ref,  # [num_pages, page_size*Hkv, D] GMEM
    # outputs
    o_ref,  # [splits, bs, o_rows, D] dtype (normalised)
    lse_ref,  # f32[splits, bs, m_tiles*64]  (log2 domain)
    # scratch
    q_smem,  # [C, 64, D] dtype (reused for the output tile)
    k_smem,  # [S, block_n, D]
    v_smem,  # [S, block_n, D]
    lse_smem,  # f32[C, 64]
    k_bar,
    v_bar,
    q_bar,
    k_free,
    v_free,
    edge_bar=None,  # partial columns, C > 1: the compute warpgroups meet on a boundary block
    flag_smem=None,  # partial columns: f32[C, block_n + 64], bad V rows then per-row poison
    kc_smem=None,  # FP8: f16 K upcast, [block_n, D] in-chain or [SC, block_n, D] converter ring
    vc_smem=None,  # FP8: f16 V upcast, same shape
    conv_bars=None,  # FP8 converter: (kc_bar, vc_bar, kc_free, vc_free), SC barriers each
):
    bs = cfg.bs
    C, S = bs.compute_wgs, bs.num_stages
    BT, N, D = bs.block_tokens, cfg.block_n, cfg.head_dim
    PPB, HKV = bs.pages_per_block, cfg.num_kv_heads
    BTB = BT * PPB  # tokens per block
    PR = BT * HKV  # rows per piece
    n = cfg.q_len
    ALIGN = 8 // math.gcd(HKV, 8)  # tokens per 8-row tile boundary

    split = lax.axis_index("split")
    b = lax.axis_index("batch")
    mg = lax.axis_index("mg")
    wg = lax.axis_index("wg")

    # Which KV blocks this CTA covers (same arithmetic in every warpgroup).
    seq_len = lens_ref[b]
    lo_blk, hi_blk = request_blocks(cfg, seq_len)
    num_blk = jnp.maximum(hi_blk - lo_blk, 0)
    if cfg.balanced:  # the call's split size, chosen from all the lengths, rides after them
        chunk = lens_ref[cfg.batch]
    else:
        chunk = lax.div(num_blk + (bs.num_splits - 1), jnp.int32(bs.num_splits))
    start = lo_blk + split * chunk
    count = jnp.maximum(jnp.minimum(start + chunk, hi_blk) - start, 0)

    # Piece j of block blk holds tokens [piece_start, piece_start + BT) of one page.
    # A piece that runs past token L is fetched shifted back so that it ends at L:
    # its box then holds only valid tokens, or rows before the page start, which
    # TMA fills with zeros (a piece wholly past L is all zeros), never the page's
    # unused tail, which may hold anything (NaN included). Rows before the
    # piece's first token are masked; they are finite (earlier tokens or 0).
    def piece_start(blk, j):
        return blk * BTB + j * BT

    def piece_src_row(blk, j, clamp=True):
        ps0 = piece_start(blk, j)
        shift = BT - jnp.clip(seq_len - ps0, 0, BT)
        if ALIGN > 1:  # whole 8-row tiles only: the box may end up to ALIGN-1 tokens past L
            shift = lax.div(shift, jnp.int32(ALIGN)) * ALIGN
        row = lax.rem(ps0, jnp.int32(cfg.page_size)) * HKV - shift * HKV
        if cfg.interpret and clamp:  # the interpreter raises on out-of-bounds TMA reads
            row = jnp.maximum(row, 0)
        return row

    def piece_first_token(blk, j):  # token held by the piece's first row
        ps0 = piece_start(blk, j)
        row0 = lax.rem(ps0, jnp.int32(cfg.page_size)) * HKV
        return ps0 - lax.div(row0 - piece_src_row(blk, j), jnp.int32(HKV))

    def col_parts(cols):
        """Piece (None with one piece per block), token offset in the piece, and KV
        head of each column (row of the KV tile)."""
        j = lax.div(cols, jnp.int32(PR)) if PPB > 1 else None
        rr = cols - j * PR if PPB > 1 else cols
        t_in = lax.div(rr, jnp.int32(HKV))
        return j, t_in, rr - t_in * HKV

    def col_clamped(blk, j):
        """Interpreter: whether each column's piece was fetched clamped at its page start
        (its box then holds page rows past the piece, where the GPU's holds zeros)."""
        clamped = piece_src_row(blk, 0, clamp=False) < 0
        for jj in range(1, PPB):
            clamped = jnp.where(j == jj, piece_src_row(blk, jj, clamp=False) < 0, clamped)
        return clamped

    def col_tokens(blk, j, t_in):
        """Token of each column of block ``blk``, and whether it is in range."""
        first = piece_first_token(blk, 0)
        lo = piece_start(blk, 0)
        for jj in range(1, PPB):
            first = jnp.where(j == jj, piece_first_token(blk, jj), first)
            lo = jnp.where(j == jj, piece_start(blk, jj), lo)
        tok = first + t_in
        return tok, (tok >= lo) & (tok < seq_len)

    # FP8 with a converter warpgroup: it upcasts each K and V tile of the FP8 ring into
    # an f16 ring of SC slots, so the compute warpgroups see the ring of 2-byte KV.
    SC = 0 if conv_bars is None else kc_smem.shape[0]

    @pl.when(wg == C)
    def _producer():
        if C > 1 or SC:
            plgpu.set_max_registers(40, action="decrease")

        @pl.loop(0, count)
        def _fetch(i):
            slot = lax.rem(i, jnp.int32(S))
            blk = start + i
            src = []
            for j in range(PPB):
                pidx = jnp.minimum(lax.div(piece_start(blk, j), jnp.int32(cfg.page_size)), cfg.max_pages - 1)
                page = jnp.clip(page_table_ref[b, pidx], 0, cfg.num_pages - 1)
                src.append((page, piece_src_row(blk, j)))

            def dst(ref, j):
                return ref.at[slot] if PPB == 1 else ref.at[slot, pl.ds(j * PR, PR)]

            @pl.when(i >= S)
            def _():
                plgpu.barrier_wait(k_free.at[slot])

            for j, (page, row) in enumerate(src):
                plgpu.copy_gmem_to_smem(k_ref.at[page, pl.ds(row, PR)], dst(k_smem, j), k_bar.at[slot])

            @pl.when(i >= S)
            def _():
                plgpu.barrier_wait(v_free.at[slot])

            for j, (page, row) in enumerate(src):
                plgpu.copy_gmem_to_smem(v_ref.at[page, pl.ds(row, PR)], dst(v_smem, j), v_bar.at[slot])

        if cfg.interpret:
            drain_free_barriers(count, S, k_free, v_free)

    if conv_bars is not None:
        kc_bar, vc_bar, kc_free, vc_free = conv_bars

        @pl.when(wg == C + 1)
        def _convert():
            @pl.loop(0, count)
            def _upcast(i):
                slot = lax.rem(i, jnp.int32(S))
                cs = lax.rem(i, jnp.int32(SC))
                for src, dst, full, free, cfull, cfree in (
                    (k_smem, kc_smem, k_bar, k_free, kc_bar, kc_free),
                    (v_smem, vc_smem, v_bar, v_free, vc_bar, vc_free),
                ):
                    plgpu.barrier_wait(full.at[slot])

                    @pl.when(i >= SC)
                    def _():
                        plgpu.barrier_wait(cfree.at[cs])

                    dst[cs] = src[slot].astype(dst.dtype)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(free.at[slot])
                    plgpu.barrier_arrive(cfull.at[cs])

            if cfg.interpret:
                drain_free_barriers(count, SC, kc_free, vc_free)

    @pl.when(wg < C)
    def _compute():
        if C > 1 or SC:
            plgpu.set_max_registers(232, action="increase")
        # The ring the compute reads: the TMA ring, or with a converter its f16 ring.
        if SC:
            RS, kr, vr, kb, vb, kf, vf = SC, kc_smem, vc_smem, kc_bar, vc_bar, kc_free, vc_free
        else:
            RS, kr, vr, kb, vb, kf, vf = S, k_smem, v_smem, k_bar, v_bar, k_free, v_free
        inline_upcast = kc_smem is not None and not SC
        mt = mg * C + wg
        qo_smem = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(
            q_ref.at[b, pl.ds(mt * 64, cfg.q_rows)],
            qo_smem.at[pl.ds(0, cfg.q_rows)] if cfg.q_rows != 64 else qo_smem,
            q_bar.at[wg],
        )
        scale = scale_ref[0]
        plgpu.barrier_wait(q_bar.at[wg])

        def cast(x, layout):  # layout hints mean nothing to the interpreter
            return cast_layout(x, layout, interpret=cfg.interpret)

        def iota(size, dim):
            """Row (dim 0: [64]) or column (dim 1: [N]) indices of the score tile, in
            the layouts that broadcast to it by reusing registers."""
            return vec_iota(size, dim, interpret=cfg.interpret)

        def rows2d(x):
            return lax.broadcast_in_dim(x, (64, N), [0])

        def load_rows(ref):
            """A [64] f32 row vector from shared memory, in the score tile's row layout."""
            return load_layout(ref, plgpu.Layout.WGMMA.reduce(1), interpret=cfg.interpret)

        def cols2d(x):
            return lax.broadcast_in_dim(x, (64, N), [1])

        m_i = cast(jnp.full((64,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = cast(jnp.full((64,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = cast(jnp.full((64, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        # Loop-invariant parts of the mask, computed once: the GQA head match of
        # every (query row, KV row) pair, and each column's token offset in its piece.
        grow = iota(64, 0) + mt * 64  # [64] per row
        qi = lax.div(grow, jnp.int32(cfg.num_q_heads))
        kvh = lax.div(grow - qi * cfg.num_q_heads, jnp.int32(cfg.group))
        qpos = seq_len - n + qi  # absolute position of each row's query
        col_j, col_t, col_head = col_parts(iota(N, 1))  # [N] per column
        head_ok = rows2d(kvh) == cols2d(col_head)
        # Score multiplier: softmax scale (k_scale folded in) and log2(e) in one.
        xscale = scale if cfg.logit_cap > 0 else scale * _LOG2E

        def token_ok(blk):
            """Token masks (range, causal, window) of one block's columns, [64, N]."""
            tok, ok = col_tokens(blk, col_j, col_t)  # [N]
            ok = cols2d(ok)
            if cfg.is_causal and n > 1:  # with one query, token < seq_len is the causal bound
                ok = ok & (cols2d(tok) <= rows2d(qpos))
            if cfg.window_left >= 0:
                ok = ok & (cols2d(tok) >= rows2d(qpos - cfg.window_left))
            return ok

        def k_tile_for(slot):
            """The K tile of a ring slot as the wgmma reads it (FP8 in-chain: upcast first)."""
            if not inline_upcast:
                return kr.at[slot]
            kc_smem[...] = k_smem[slot].astype(dtype)
            plgpu.commit_smem()
            return kc_smem

        def qk_sync(k_tile):
            """S = Q K^T for one K tile, waited for."""
            if cfg.interpret:
                # The interpreter's wgmma takes neither transposed B nor A in registers:
                # same product, computed from the shared-memory tiles with a plain dot.
                return lax.dot_general(
                    qo_smem[...], k_tile[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                )

            def scope(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem, k_tile.T)
                return acc_ref[...]

            return pl.run_scoped(scope, plgpu.ACC((64, N), jnp.float32))

        def softmax_step(s, blk, acc, m_i, l_i):
            """Scale, cap and mask one block's scores; online softmax in base 2."""
            x = s * xscale
            if cfg.logit_cap > 0:
                x = jnp.tanh(x * (1.0 / cfg.logit_cap)) * (cfg.logit_cap * _LOG2E)
            x = jnp.where(head_ok & token_ok(blk), x, -jnp.inf)
            m_new = jnp.maximum(m_i, x.max(axis=1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m_i - m_use)
            p = jnp.exp2(x - lax.broadcast_in_dim(m_use, x.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            return p.astype(dtype), acc, m_new, l_i

        # Boundary blocks (see the module docstring). `partial`: some column is masked for
        # some query rows only (draft tokens past a query's causal limit, a window's edge
        # with several queries); `clean`: a boundary block may hold a masked column whose V
        # is anything. One query, causal, no window: neither (the block of a request's
        # last, partial page holds only valid tokens, or zeros, or with kv heads not a
        # multiple of 8 a few rows of the page's tail, which are zeroed).
        partial = _has_partial_columns(cfg)
        clean = partial or cfg.window_left >= 0

        def edge_block(blk):
            """Whether block ``blk`` holds a column masked for some query row: past the
            length or a query's causal limit (the last blocks), or before some query's
            window (the window's first blocks). Every other block is visible to all rows."""
            causal_slack = n - 1 if cfg.is_causal else 0
            edge = blk * BTB + BTB > seq_len - causal_slack
            if cfg.window_left >= 0:
                edge = edge | (blk * BTB < seq_len - 1 - cfg.window_left)
            return edge

        def tile_row(blk, t, h):
            """The row of block ``blk``'s V tile that holds token ``t`` of KV head ``h``
            (for the piece that counts it), and whether the block holds it."""
            rel = t - blk * BTB
            p = jnp.clip(lax.div(jnp.maximum(rel, 0), jnp.int32(BT)), 0, PPB - 1)
            first = piece_first_token(blk, 0)
            for jj in range(1, PPB):
                first = jnp.where(p == jj, piece_first_token(blk, jj), first)
            row = p * PR + (t - first) * HKV + h
            ok = (rel >= 0) & (rel < BTB) & (t >= 0) & (row >= 0) & (row < N)
            return jnp.clip(row, 0, N - 1), ok

        # Partial columns: token seq_len + c (static c < 0) is seen by the queries i of
        # `seen` (static, from the masks of docs/SEMANTICS.md).
        partial_cols = []
        if partial:
            offs = [1 - n + j for j in range(n - 1)] if cfg.is_causal else []
            if cfg.window_left >= 0:
                offs += [-n - cfg.window_left + j for j in range(n - 1)]
            for c in sorted(set(offs)):
                seen = [
                    (not cfg.is_causal or c <= i - n) and (cfg.window_left < 0 or c >= i - n - cfg.window_left)
                    for i in range(n)
                ]
                if any(seen) and not all(seen):
                    partial_cols.append((c, seen))

        def clean_edge_tile(v_tile, blk):
            """A boundary block's V tile made safe to multiply by P: rows no query sees
            become 0, and rows some queries see but not all have their non-finite entries
            replaced by 0 (in shared memory), so a masked column (P = 0) adds exactly
            nothing. The queries that see such a row holding a non-finite V are recorded
            in ``flag_smem`` (they come out NaN). Rows every query sees are left as they
            are: a non-finite V there reaches every row by itself."""
            rows = iota(N, 0)  # [N]: the tile's rows, in the layout of its row vectors
            j_, t_in, _ = col_parts(rows)
            tok, vis_some = col_tokens(blk, j_, t_in)
            vis_all = vis_some
            if cfg.is_causal and n > 1:
                vis_all = vis_all & (tok <= seq_len - n)
            if cfg.window_left >= 0:
                vis_all = vis_all & (tok >= seq_len - 1 - cfg.window_left)
                vis_some = vis_some & (tok >= seq_len - n - cfg.window_left)
            v = v_tile[...]
            finite = v - v == 0
            if partial_cols:
                one, zero = jnp.ones(v.shape, v.dtype), jnp.zeros(v.shape, v.dtype)
                flag_smem[wg, pl.ds(0, N)] = jnp.where(finite, zero, one).max(axis=1).astype(jnp.float32)
                if edge_bar is not None:  # every warpgroup has read the tile before any rewrites it
                    plgpu.barrier_arrive(edge_bar)
                    plgpu.barrier_wait(edge_bar)

            def tile2d(x):
                return lax.broadcast_in_dim(x, (N, D), [0])

            keep = tile2d(vis_all) | (tile2d(vis_some) & finite)
            v_tile[...] = jnp.where(keep, v, jnp.zeros(v.shape, v.dtype))
            plgpu.commit_smem()
            if partial_cols:
                seen_bad = [jnp.float32(0.0)] * n  # per query of the request
                for c, seen in partial_cols:
                    bad = jnp.float32(0.0)
                    for h in range(HKV):
                        row, ok = tile_row(blk, seq_len + c, h)
                        bad = jnp.maximum(bad, jnp.where(ok, flag_smem[wg, row], 0.0))
                    seen_bad = [jnp.maximum(f, bad) if s_ else f for f, s_ in zip(seen_bad, seen)]
                row_flag = load_rows(flag_smem.at[wg, pl.ds(N, 64)])
                for i in range(n):
                    row_flag = jnp.where(qi == i, jnp.maximum(row_flag, seen_bad[i]), row_flag)
                flag_smem[wg, pl.ds(N, 64)] = row_flag

        def pv_step(acc, p16, slot, blk):
            """Wait for the block's V, acc += P @ V, free the V slot."""
            plgpu.barrier_wait(vb.at[slot])
            v_tile = vr.at[slot]
            if inline_upcast:
                vc_smem[...] = v_smem[slot].astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(v_free.at[slot])
                v_tile = vc_smem
            if clean:
                # A boundary block may hold masked columns whose V is anything: P is 0
                # there but 0 * NaN is not.
                pl.when(edge_block(blk))(lambda: clean_edge_tile(v_tile, blk))
            elif ALIGN > 1:
                # The last block may hold rows of the page's unused tail (anything, NaN
                # included): P is 0 there but 0 * NaN is not, so zero those V rows
                # (in the f16 upcast tile for FP8: no pointwise ops on 8-bit types).
                vt = v_tile

                @pl.when(blk * BTB + BTB > seq_len)
                def _():
                    # The mask per row of the tile, then broadcast, as clean_edge_tile
                    # builds it: built per element of [N, D] instead, the GPU compiler's
                    # layout inference gave up on this branch (one KV head, head_dim 64,
                    # 16-token pages: eight pieces per block, a where per piece).
                    _, vvalid = col_tokens(blk, *col_parts(iota(N, 0))[:2])
                    keep = lax.broadcast_in_dim(vvalid, (N, D), [0])
                    vt[...] = jnp.where(keep, vt[...], jnp.zeros((N, D), vt.dtype))
                    plgpu.commit_smem()

            if cfg.interpret:
                # A piece clamped at its page start (the interpreter's box, where the GPU's
                # starts before the page and TMA fills those rows with zeros) holds page
                # rows past the request's last token: zero those, and only those, so the
                # kernel's own tail handling is what keeps every other piece clean.
                j, t_in, _ = col_parts(lax.broadcasted_iota(jnp.int32, (N, D), 0))
                tok, _ = col_tokens(blk, j, t_in)
                tail = (tok >= seq_len) & col_clamped(blk, j)
                vblk = jnp.where(tail, jnp.zeros((N, D), v_tile.dtype), v_tile[...])
                acc = acc + jnp.dot(p16, vblk, preferred_element_type=jnp.float32)
            else:

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_tile)

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            if not inline_upcast:
                plgpu.barrier_arrive(vf.at[slot])
            return acc

        def body(i, carry):
            """One block, in order: wait K, S = Q K^T, softmax, wait V, acc += P V."""
            acc, m_i, l_i = carry
            slot = lax.rem(i, jnp.int32(RS))
            blk = start + i
            plgpu.barrier_wait(kb.at[slot])
            s = qk_sync(k_tile_for(slot))
            plgpu.barrier_arrive(kf.at[slot])
            p16, acc, m_new, l_i = softmax_step(s, blk, acc, m_i, l_i)
            acc = pv_step(acc, p16, slot, blk)
            return acc, m_new, l_i

        def body_overlap(i, carry):
            """Block i with the next block's Q K^T in flight on the tensor cores while
            this block's softmax runs (the scores of block i come in the carry)."""
            acc, m_i, l_i, s_cur = carry
            slot = lax.rem(i, jnp.int32(RS))
            blk = start + i
            has_next = i + 1 < count
            # Past the last block the product is redone on the last K tile (still in
            # its slot: nothing is loaded after it) and discarded.
            nslot = lax.rem(jnp.minimum(i + 1, count - 1), jnp.int32(RS))

            @pl.when(has_next)
            def _():
                plgpu.barrier_wait(kb.at[nslot])

            k_next = k_tile_for(nslot)
            if cfg.interpret:
                s_next = qk_sync(k_next)
                p16, acc, m_new, l_i = softmax_step(s_cur, blk, acc, m_i, l_i)
                acc = pv_step(acc, p16, slot, blk)
            else:

                def scope(s_ref):
                    plgpu.wgmma(s_ref, qo_smem, k_next.T)
                    p16, acc2, m_new, l_new = softmax_step(s_cur, blk, acc, m_i, l_i)
                    acc2 = pv_step(acc2, p16, slot, blk)  # waits for both wgmma groups
                    return acc2, m_new, l_new, s_ref[...]

                acc, m_new, l_i, s_next = pl.run_scoped(scope, plgpu.ACC((64, N), jnp.float32))

            @pl.when(has_next)
            def _():
                plgpu.barrier_arrive(kf.at[nslot])

            return acc, m_new, l_i, s_next

        if partial:  # per-row poison of clean_edge_tile: none yet
            flag_smem[wg, pl.ds(N, 64)] = cast(jnp.zeros((64,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        if cfg.overlap_qk and not inline_upcast:
            # Prologue: the first block's scores (a CTA with no blocks computes them on
            # an unloaded slot and never uses them).
            @pl.when(count > 0)
            def _():
                plgpu.barrier_wait(kb.at[0])

            s0 = qk_sync(k_tile_for(0))

            @pl.when(count > 0)
            def _():
                plgpu.barrier_arrive(kf.at[0])

            acc, m_i, l_i, _ = lax.fori_loop(0, count, body_overlap, (acc, m_i, l_i, s0))
        else:
            acc, m_i, l_i = lax.fori_loop(0, count, body, (acc, m_i, l_i))

        if partial:  # a query that sees a non-finite V zeroed in a boundary block: NaN
            plgpu.commit_smem()
            l_i = jnp.where(load_rows(flag_smem.at[wg, pl.ds(N, 64)]) > 0, jnp.nan, l_i)
        empty = l_i == 0.0
        inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l_i))
        acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
        lse = jnp.where(empty, -jnp.inf, m_i + jnp.log(jnp.where(empty, 1.0, l_i)) * _LOG2E)
        qo_smem[...] = acc.astype(dtype)
        lse_smem[wg] = lse
        plgpu.commit_smem()

        def store_output():
            if cfg.m_tiles == 1 and cfg.q_rows != 64:  # only the rows that hold queries
                plgpu.copy_smem_to_gmem(qo_smem.at[pl.ds(0, cfg.q_rows)], o_ref.at[split, b])
            else:
                plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[split, b, pl.ds(mt * 64, 64)])

        unless_empty_split(store_output, count, bs.num_splits)
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[split, b, pl.ds(mt * 64, 64)])
        plgpu.wait_smem_to_gmem(0)


def _run_kernel(cfg: DecodeConfig, dtype, page_table, lens, scale, q3, k2, v2):
    bs = cfg.bs
    C, S, N, D = bs.compute_wgs, bs.num_stages, cfg.block_n, cfg.head_dim
    m_pad = cfg.m_tiles * 64
    m_groups = cfg.m_tiles // C
    out_type = (
        jax.ShapeDtypeStruct((bs.num_splits, cfg.batch, cfg.o_rows, D), dtype),
        jax.ShapeDtypeStruct((bs.num_splits, cfg.batch, m_pad), jnp.float32),
    )
    tr = swizzle_transforms(dtype, D)
    kv_tr = swizzle_transforms(k2.dtype, D)
    fp8 = jnp.dtype(k2.dtype).itemsize == 1
    if fp8 and C != 1:
        raise NotImplementedError("FP8 KV uses one compute warpgroup")
    # FP8: f16 upcast tiles, a ring of SC slots filled by a converter warpgroup, or one
    # K and one V tile upcast by the compute warpgroup itself.
    SC = cfg.convert_stages if fp8 else 0
    upcast_shape = (SC, N, D) if SC else (N, D)
    extra = [plgpu.SMEM(upcast_shape, dtype, transforms=tr)] * 2 if fp8 else []
    conv = [plgpu.Barrier(num_barriers=SC)] * 2 + [plgpu.Barrier(num_arrivals=C, num_barriers=SC)] * 2 if SC else []
    free_arrivals = 1 if SC else C  # who frees a TMA ring slot: the converter or the compute
    # Queries that see some columns of a boundary block and not others: a flag scratch,
    # and with two compute warpgroups a barrier (see clean_edge_tile).
    partial = _has_partial_columns(cfg)
    n_bar = 1 if partial and C > 1 else 0
    flags = [plgpu.SMEM((C, N + 64), jnp.float32)] if partial else []

    def entry(pt_ref, lens_ref, scale_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
        def body(*scratch):
            named, rest = scratch[:9], list(scratch[9:])
            edge_bar = rest.pop(0) if n_bar else None
            flag_smem = rest.pop(0) if partial else None
            upcast = [rest.pop(0), rest.pop(0)] if fp8 else [None, None]
            conv_bars = tuple(rest) if SC else None
            _decode_kernel(
                cfg,
                dtype,
                pt_ref,
                lens_ref,
                scale_ref,
                q_ref,
                k_ref,
                v_ref,
                o_ref,
                lse_ref,
                *named,
                edge_bar,
                flag_smem,
                *upcast,
                conv_bars,
            )

        pl.run_scoped(
            body,
            plgpu.SMEM((C, 64, D), dtype, transforms=tr),
            plgpu.SMEM((S, N, D), k2.dtype, transforms=kv_tr),
            plgpu.SMEM((S, N, D), v2.dtype, transforms=kv_tr),
            plgpu.SMEM((C, 64), jnp.float32),
            plgpu.Barrier(num_arrivals=bs.pages_per_block, num_barriers=S),
            plgpu.Barrier(num_arrivals=bs.pages_per_block, num_barriers=S),
            plgpu.Barrier(num_barriers=C),
            plgpu.Barrier(num_arrivals=free_arrivals, num_barriers=S),
            plgpu.Barrier(num_arrivals=free_arrivals, num_barriers=S),
            *[plgpu.Barrier(num_arrivals=C)] * n_bar,
            *flags,
            *extra,
            *conv,
            collective_axes="wg",
        )

    name = (
        f"jattn_paged_decode_bt{bs.block_tokens}x{bs.pages_per_block}_n{N}_d{D}_s{S}_c{C}_splits{bs.num_splits}"
        + (f"_conv{SC}" if SC else "")
        + ("_bal" if cfg.balanced else "")
    )
    kernel = plgpu_kernel(
        entry,
        out_type,
        grid=(bs.num_splits, cfg.batch, m_groups),
        grid_names=("split", "batch", "mg"),
        num_threads=C + 1 + bool(SC),
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name=name,
    )
    return kernel(page_table, lens, scale, q3, k2, v2)
