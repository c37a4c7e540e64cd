"""The per-KV-head paged decode kernel's body and launch (Mosaic GPU, Hopper); the jitted
call and the entry point are in ``mosaic_decode_heads``.

The layout. The pool ``[pages, page_size, kv_heads, head_dim]`` is read through its 2-D
view ``[pages * page_size, kv_heads * head_dim]``, in which one KV head's tokens of a page
are a plain TMA box ``[rows, head_dim]``. A block of 64 tokens is one box of a page of 64 or
128, or ``64 / page_size`` boxes of consecutive pages of 16 or 32 landing in one tile. A CTA
takes one (split, request, KV head); the head's ``q_len * group`` query rows (row
``i * group + j``: query token ``i``, query head ``h * group + j``), padded to ``N`` (16, 32
or 64), are the MMA's columns:

* ``S^T = K Q^T``: ``wgmma`` with the block's 64 tokens as rows (M = 64, N query rows),
  so the work per token is N / 64 of a kernel whose query rows are the MMA rows;
* the online softmax runs per column: its max reduces over the rows (keys) every block, its
  sums stay a ``[64, N]`` tile rescaled with the outputs and reduce once after the loop;
* ``O^T += V^T P^T``: ``P^T`` goes to shared memory as ``[64, N]`` and ``V^T`` is a
  transposed view of the ``[64, head_dim]`` V tile, in 64-row halves of ``head_dim`` issued
  as one ``wgmma`` group. The V tile and ``P^T`` share one swizzle (``2 N`` bytes), as one
  ``wgmma``'s operands must.

Masked keys contribute nothing: blocks that hold keys past the length, or keys some query
of a causal draft does not see, are masked in ``S^T``; their V rows past the length become
0, and non-finite V entries of keys some query does not see become 0 too, a query that
does see one being recorded and coming out NaN (the semantics of docs/SEMANTICS.md).

Occupancy. With 2-byte K/V and N <= 32 two CTAs share an SM (two softmax chains in flight):
the compute warpgroup asks for 128 registers (ptxas launches a kernel that uses setmaxnreg at
its largest count, so this count sets the occupancy), ``O^T`` leaves through one 64-row f32
staging tile, and the ring keeps three slots where they fit half the SM's shared memory, two
where they do not (``HeadsConfig.paired`` / ``stages``). FP8 and N = 64 run one CTA per SM at
232 registers.

Launch. A CTA walks the items ``cta, cta + ctas, ...`` (an item: one split of one request's
KV head, splits fastest), keeping one ring and its barrier phases across them, loading the
next item's Q as soon as the current item's last ``S^T`` has read Q, and reusing the
staging tiles once the last item's stores have read them. By default ``ctas`` is the item
count (one item per CTA); ``persistent=True`` launches one CTA per SM slot. With
``row_tile`` a KV head's query rows go in tiles of 16 or 32, each tile an item of its own,
the tiles of one split adjacent in the item order (they read the same K/V blocks).

MLA (``HeadsConfig.latent``; entry point ``mosaic_mla_heads.mla_decode``): the latent
cache ``[pages, page_size, W]`` is one KV head of width ``W`` (576) whose first ``latent``
(512) columns are V, and a request's ``q_len * H`` query rows (at most 32) are N. One ring
tile per slot serves as K (``S^T = K Q^T`` over all ``W`` columns) and, after that, as V
(``O^T`` in ``latent / 64`` row halves), so Q, the tile and ``P^T`` share the ``2 N``-byte
swizzle. Edge blocks zero the value columns of keys past the length and the non-finite ones
of keys some query does not see, 64 columns at a time; a query that sees a non-finite value
entry has a NaN score (the value columns are score columns), so no flag is needed. A 72 KB
tile per slot leaves room for two slots and one CTA per SM.

Each split writes ``O^T`` normalised over the split and the base-2 LSE;
``combine.combine_splits`` reads them in that layout (``combine.HeadsLayout``).
Bf16/f16 queries; K/V in the query's dtype or FP8 e4m3. FP8 tiles are upcast to f16 (the
query is cast to f16 too) by the compute warpgroup as it takes them, into one K and one V
tile: the MMA work per block is small here, so the upcast is the largest part of the chain.
With ``fp8_qk`` the query goes to e4m3 instead (one power-of-two scale per item, its factor
read by the consumer with the item) and ``S^T = K Q^T`` is an e4m3 ``wgmma`` on the landed
K tile, which frees the slot; only V is upcast, while that MMA runs, so the chain keeps one
upcast and two CTAs fit an SM. With ``v_regs`` as well, V is not upcast into a tile at
all: each 64-column piece of the landed e4m3 V tile is read transposed into registers,
upcast there and fed to the ``O^T`` MMA as its register operand ``V^T``, which leaves the
ring the upcast tile's room (up to six 64-token slots in half an SM). Edge blocks are
cleaned in registers; for a causal block of several queries the per-key NaN rows go
from ``V^T``'s key axis to the scores' through a ``[B]`` row in shared memory.
``block=128`` doubles the tokens per block (fewer per-block waits and cross-warp
reductions per key). ``k_scale`` is in the score scale; the combine applies ``v_scale``.
Page sizes 16 to 128, head_dim 64 or 128, no window, logit cap or sinks.
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
from jattn.pallas_kernels.mosaic_decode_heads_config import _PAIR_REGS, _SOLO_REGS, HeadsConfig

_LOG2E = math.log2(math.e)


def _kernel(cfg: HeadsConfig, dtype, page_table_ref, lens_ref, *refs):
    # fp8_qk: each item's query factor (1 / its e4m3 scale), f32[bs, kv_heads, tiles]
    qf_ref, refs = (refs[0], refs[1:]) if cfg.fp8_qk else (None, refs)
    q_ref, k_ref, v_ref, o_ref, lse_ref, *scratch = refs
    if cfg.latent:  # one latent tile per slot: V is its first `latent` columns
        q_s, k_s, p_s, o_s, l_s, kv_bar, kv_free, q_bar = scratch
        v_s, upcast = None, []
    else:
        q_s, k_s, v_s, p_s, o_s, l_s, *upcast, kv_bar, kv_free, q_bar = scratch
    # FP8: the tiles the MMAs read (fp8_qk: V only; S^T reads the landed e4m3 K tile;
    # v_regs: none, V^T goes to registers)
    kc_s, vc_s = ((None, *upcast) if cfg.fp8_qk else upcast) if cfg.fp8 and not cfg.v_regs else (None, None)
    # v_regs with a causal block of several queries: the edge block's per-key NaN rows, f32[B]
    kb_s = upcast[0] if cfg.v_regs and upcast else None
    D, N, S, G, B = cfg.head_dim, cfg.n, cfg.stages, cfg.group, cfg.block
    wg = lax.axis_index("wg")
    interp = cfg.interpret
    cta, P = lax.axis_index("cta"), cfg.ctas
    my_items = lax.div(cfg.items - cta + P - 1, jnp.int32(P))

    def item_of(k):
        """The ``k``-th item of this CTA: ``(split, request, KV head, row tile)``, row tiles
        fastest (the tiles of one split run side by side and share its K/V reads in L2),
        then splits."""
        item = cta + k * P
        tile = lax.rem(item, jnp.int32(cfg.tiles))
        item = lax.div(item, jnp.int32(cfg.tiles))
        split = lax.rem(item, jnp.int32(cfg.num_splits))
        rest = lax.div(item, jnp.int32(cfg.num_splits))
        return split, lax.rem(rest, jnp.int32(cfg.batch)), lax.div(rest, jnp.int32(cfg.batch)), tile

    def blocks_of(split, b):
        per = lens_ref[cfg.batch] if cfg.balanced else None  # the call's split size rides after the lengths
        return split_blocks(lens_ref[b], B, cfg.num_splits, split, per=per)

    @pl.when(wg == 1)
    def _producer():
        if not interp:
            plgpu.set_max_registers(40, action="decrease")
        rows = cfg.piece_rows

        def item_loads(k, n):
            """Item ``k``'s K/V blocks into the ring; ``n`` blocks went before it."""
            split, b, h, _ = item_of(k)
            lo, count = blocks_of(split, b)
            cols = pl.ds(h * D, D)

            @pl.loop(0, count)
            def _(i):
                slot = lax.rem(n + i, jnp.int32(S))

                @pl.when(n + i >= S)
                def _():
                    plgpu.barrier_wait(kv_free.at[slot])

                for j in range(B // rows):  # the block's pieces: one per page, or one piece of a page
                    tok = (lo + i) * B + j * rows
                    pidx = jnp.minimum(lax.div(tok, jnp.int32(cfg.page_size)), cfg.max_pages - 1)
                    page = jnp.clip(page_table_ref[b, pidx], 0, cfg.num_pages - 1)
                    row = page * cfg.page_size + lax.rem(tok, jnp.int32(cfg.page_size))
                    dst = pl.ds(j * rows, rows)
                    plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(row, rows), cols], k_s.at[slot, dst], kv_bar.at[slot])
                    if not cfg.latent:
                        plgpu.copy_gmem_to_smem(v_ref.at[pl.ds(row, rows), cols], v_s.at[slot, dst], kv_bar.at[slot])

            return n + count

        total = lax.fori_loop(0, my_items, item_loads, jnp.int32(0))
        if interp:
            drain_free_barriers(total, S, kv_free)

    @pl.when(wg == 0)
    def _consumer():
        if not interp:
            plgpu.set_max_registers(_PAIR_REGS if cfg.paired else _SOLO_REGS, action="increase")
        xscale = cfg.scale * _LOG2E

        def load_q(k):
            _, b, h, t = item_of(k)
            plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(t * N, N)], q_s, q_bar.at[0])

        load_q(0)  # every CTA has at least one item

        def item_body(k, n):
            """Item ``k``: its blocks ``n ..`` of the ring, then ``O^T`` and the LSE out."""
            split, b, h, t = item_of(k)
            seq_len = lens_ref[b]
            lo, count = blocks_of(split, b)
            # fp8_qk: the scores of the e4m3 query carry its factor
            xs = xscale * qf_ref[b, h, t] if cfg.fp8_qk else xscale
            # the first key some query does not see (a later draft token of a causal block)
            first_partial = seq_len - cfg.q_len + 1 if cfg.is_causal and cfg.q_len > 1 else seq_len
            plgpu.barrier_wait(q_bar.at[0])

            cols = tile_iota((B, N), 1, interpret=interp) + t * N  # the KV head's query rows
            # the last key each column sees (padding columns: the request's last key)
            q_of = jnp.minimum(lax.div(cols, jnp.int32(G)), cfg.q_len - 1)
            limit = jnp.minimum(seq_len - cfg.q_len + q_of, seq_len - 1) if cfg.is_causal else seq_len - 1

            def s_t(k_tile, during=lambda: None):
                """``(S^T, during())``: ``S^T = K Q^T`` (e4m3 operands with ``fp8_qk``), and
                what ``during()`` returns, which runs while the MMA is in flight."""
                if interp:
                    got = during()
                    kt, qt = (k_tile[...], q_s[...])
                    if cfg.fp8_qk:  # the GPU's e4m3 products are exact; f32 here
                        kt, qt = kt.astype(jnp.float32), qt.astype(jnp.float32)
                    dims = (((1,), (1,)), ((), ()))
                    return lax.dot_general(kt, qt, dims, preferred_element_type=jnp.float32), got

                def scope(acc):
                    plgpu.wgmma(acc, k_tile, q_s.T)
                    got = during()
                    return acc[...], got

                return pl.run_scoped(scope, plgpu.ACC((B, N), jnp.float32))

            def load_vt(slot):
                """``v_regs``: the landed e4m3 V tile as ``V^T`` in registers, f16, one
                ``[64, B]`` piece per 64 columns (``O^T``'s halves), read through a transposed
                view of each 64-column tile of the ring slot."""
                pieces = []
                for h in range(cfg.v_dim // 64):
                    tile = v_s.at[slot, :, pl.ds(h * 64, 64)]
                    if interp:
                        pieces.append(tile[...].astype(dtype).T)
                        continue
                    v = load_layout(tile.T, plgpu.Layout.WGMMA_TRANSPOSED, interpret=False, optimized=True)
                    pieces.append(plgpu.layout_cast(v.astype(dtype), plgpu.Layout.WGMMA))
                return pieces

            def upcast_v(slot):
                """The landed e4m3 V tile into the f16 tile ``O^T`` reads, 64 rows at a time
                (the registers of one 64-row piece). ``softmax_pv``'s fence publishes it."""
                for r in range(B // 64):
                    rows = pl.ds(r * 64, 64)
                    vc_s.at[rows][...] = v_s.at[slot, rows][...].astype(dtype)

            def o_t(acc, v_tile):
                """``acc[h] + V[:, h]^T @ P^T`` for each 64-row half ``h`` of ``O^T``: the halves'
                ``wgmma``s are issued together and waited for once. ``v_tile``: the V tile in
                shared memory, or (``v_regs``) the halves' ``V^T`` in registers."""
                halves = [pl.ds(h * 64, 64) for h in range(len(acc))]
                if interp:
                    vts = v_tile if cfg.v_regs else [v_tile.at[:, c][...].T for c in halves]
                    return tuple(a + jnp.dot(v, p_s[...], preferred_element_type=jnp.float32) for a, v in zip(acc, vts))
                vts = v_tile if cfg.v_regs else [v_tile.at[:, c].T for c in halves]

                def body(acc_refs):
                    for acc_ref, v in zip(acc_refs, vts):
                        plgpu.wgmma(acc_ref, v, p_s)

                return pl.run_state(body)(tuple(plgpu.ACC.init(a) for a in acc))

            def flag_partial(bad_row, t0, seen, flag):
                """``flag`` raised for the queries that see a key with a non-finite V entry
                (``bad_row`` [B] > 0, in the scores' key layout) among the keys only some
                queries see (a causal block of several queries)."""
                row = vec_iota(B, 0, interpret=interp) + t0
                partial = ((row >= first_partial) & (row < seq_len)).astype(jnp.float32)
                bad = lax.broadcast_in_dim(bad_row * partial, (B, N), [0])
                return jnp.maximum(flag, jnp.where(seen, bad, 0.0).max(axis=0))

            def clean(v_tile, t0, seen, flag):
                """An edge block: V rows past the length become 0; non-finite entries of keys
                some query does not see become 0, and the queries that see such a row are
                flagged (``flag`` > 0: they come out NaN); keys every query sees are left as
                they are. MLA: the latent tile's value columns, 64 at a time, after its
                ``S^T`` (a query that sees a non-finite value entry has a NaN score: no flag)."""
                if cfg.v_regs:  # V^T in registers, [64, B] per 64 columns: keys along axis 1
                    key = tile_iota((64, B), 1, interpret=interp) + t0
                    finite = [v - v == 0 for v in v_tile]
                    keep = [(key < seq_len) & (f | (key < first_partial)) for f in finite]
                    v_tile = [jnp.where(k_, v, jnp.zeros(v.shape, v.dtype)) for k_, v in zip(keep, v_tile)]
                    if kb_s is None:
                        return v_tile, flag
                    # the keys' NaN rows go to the scores' key layout through shared memory
                    bad_key = functools.reduce(jnp.maximum, [jnp.where(f, 0.0, 1.0).max(axis=0) for f in finite])
                    kb_s[...] = bad_key
                    plgpu.commit_smem()
                    bad_row = load_layout(kb_s, plgpu.Layout.WGMMA.reduce(1), interpret=interp)
                    return v_tile, flag_partial(bad_row, t0, seen, flag)
                # the whole V tile, or the latent tile's value columns 64 at a time (registers)
                chunks = [v_tile.at[:, pl.ds(c * 64, 64)] for c in range(cfg.latent // 64)] or [v_tile]
                for chunk in chunks:
                    v = chunk[...]
                    keyrow = tile_iota(v.shape, 0, interpret=interp) + t0
                    finite = v - v == 0
                    # keys every query sees keep what they hold (a non-finite V reaches every row)
                    keep = (keyrow < seq_len) & (finite | (keyrow < first_partial))
                    chunk[...] = jnp.where(keep, v, jnp.zeros(v.shape, v.dtype))
                if cfg.is_causal and cfg.q_len > 1 and not cfg.latent:
                    bad_row = jnp.where(finite, 0.0, 1.0).max(axis=1)  # [B], 1: a non-finite entry
                    flag = flag_partial(bad_row, t0, seen, flag)
                return v_tile, flag

            def softmax_pv(i, x, carry, v_tile, edge: bool):
                """Block ``i``'s scores ``x`` (``S^T``, unscaled) into the running softmax and
                ``O^T += V^T P^T``. The softmax sums stay a ``[64, N]`` tile (``l_t``, rescaled
                with the outputs), summed over its rows once after the loop: one cross-warp
                reduction per block (the max) instead of two."""
                acc, m_i, l_t, flag = carry
                t0 = (lo + i) * B
                x = x * xs
                if edge:
                    seen = tile_iota((B, N), 0, interpret=interp) + t0 <= limit
                    x = jnp.where(seen, x, -jnp.inf)
                    v_tile, flag = clean(v_tile, t0, seen, flag)
                m_new = jnp.maximum(m_i, x.max(axis=0))
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp2(m_i - m_use)
                p = jnp.exp2(x - lax.broadcast_in_dim(m_use, x.shape, [1]))
                alpha_t = lax.broadcast_in_dim(alpha, x.shape, [1])
                l_t = l_t * alpha_t + p
                p_s[...] = p.astype(dtype)
                plgpu.commit_smem()
                alpha_o = alpha_t if B == 64 else lax.broadcast_in_dim(alpha, (64, N), [1])  # O^T's halves
                acc = o_t(tuple(a * alpha_o for a in acc), v_tile)
                return acc, m_new, l_t, flag

            def step(i, carry, edge: bool):
                """One block in order: wait K/V, ``S^T = K Q^T``, softmax, ``O^T += V^T P^T``."""
                slot = lax.rem(n + i, jnp.int32(S))
                plgpu.barrier_wait(kv_bar.at[slot])
                if cfg.fp8_qk:  # S^T on the landed e4m3 K, V upcast (or read) meanwhile; then the slot is free
                    x, vs = s_t(k_s.at[slot], during=lambda: load_vt(slot) if cfg.v_regs else upcast_v(slot))
                    plgpu.barrier_arrive(kv_free.at[slot])
                    return softmax_pv(i, x, carry, vs if cfg.v_regs else vc_s, edge)
                if cfg.fp8:  # upcast into the f16/bf16 tiles; the FP8 slot is free at once
                    kc_s[...] = k_s[slot].astype(dtype)
                    vc_s[...] = v_s[slot].astype(dtype)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(kv_free.at[slot])
                    k_tile, v_tile = kc_s, vc_s
                else:
                    k_tile = k_s.at[slot]
                    v_tile = k_tile if cfg.latent else v_s.at[slot]
                carry = softmax_pv(i, s_t(k_tile)[0], carry, v_tile, edge)
                if not cfg.fp8:
                    plgpu.barrier_arrive(kv_free.at[slot])
                return carry

            def step_overlap(i, carry, edge: bool):
                """``overlap``: block ``i`` with block ``i + 1``'s ``S^T`` in flight while this
                block's softmax and ``O^T`` run; block ``i``'s scores come in the carry. After
                the last block the product is redone on the last K tile (still in its slot)
                and discarded."""
                *inner, x_cur = carry
                slot = lax.rem(n + i, jnp.int32(S))
                nslot = lax.rem(n + jnp.minimum(i + 1, count - 1), jnp.int32(S))

                @pl.when(i + 1 < count)
                def _():
                    plgpu.barrier_wait(kv_bar.at[nslot])

                v_tile = (lambda: load_vt(slot)) if cfg.v_regs else (lambda: v_s.at[slot])
                if interp:
                    x_next = s_t(k_s.at[nslot])[0]
                    inner = softmax_pv(i, x_cur, tuple(inner), v_tile(), edge)
                else:

                    def scope(s_ref):
                        plgpu.wgmma(s_ref, k_s.at[nslot], q_s.T)
                        out = softmax_pv(i, x_cur, tuple(inner), v_tile(), edge)  # waits for both MMAs
                        return out, s_ref[...]

                    inner, x_next = pl.run_scoped(scope, plgpu.ACC((B, N), jnp.float32))
                plgpu.barrier_arrive(kv_free.at[slot])
                return (*inner, x_next)

            vec = plgpu.Layout.WGMMA.reduce(0)
            m_i = cast_layout(jnp.full((N,), -jnp.inf, jnp.float32), vec, interpret=interp)
            l_t = cast_layout(jnp.zeros((B, N), jnp.float32), plgpu.Layout.WGMMA, interpret=interp)
            flag = cast_layout(jnp.zeros((N,), jnp.float32), vec, interpret=interp)
            acc = tuple(
                cast_layout(jnp.zeros((64, N), jnp.float32), plgpu.Layout.WGMMA, interpret=interp)
                for _ in range(cfg.v_dim // 64)
            )
            n_full = jnp.clip(lax.div(first_partial, jnp.int32(B)) - lo, 0, count)
            carry = (acc, m_i, l_t, flag)
            body = step
            # the first block's scores before the loop. An item with no blocks computes them on
            # a slot it never waited for (the producer may be landing the next item's block in
            # it) and never reads them: a wasted MMA, no result affected.
            if cfg.overlap:
                first = lax.rem(n, jnp.int32(S))

                @pl.when(count > 0)
                def _():
                    plgpu.barrier_wait(kv_bar.at[first])

                carry, body = (*carry, s_t(k_s.at[first])[0]), step_overlap
            carry = lax.fori_loop(0, n_full, functools.partial(body, edge=False), carry)
            carry = lax.fori_loop(n_full, count, functools.partial(body, edge=True), carry)
            acc, m_i, l_t, flag = carry[:4]

            # Every S^T of this item has been read: the next item's Q lands during the epilogue
            # (the producer is already streaming its K/V into the slots freed above).
            @pl.when(k + 1 < my_items)
            def _():
                load_q(k + 1)

            l_i = l_t.sum(axis=0)
            empty = l_i == 0.0
            inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l_i))
            inv = jnp.where(flag > 0, jnp.nan, inv)
            # the last item's stores have read the staging tiles
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            l_s[...] = jnp.where(empty, -jnp.inf, jnp.where(empty, 0.0, m_i) + jnp.log2(jnp.where(empty, 1.0, l_i)))
            # O^T leaves in 64-row halves through one staging tile (half the shared memory);
            # an item with no key blocks leaves it unwritten where a merge follows
            for half, a in enumerate(acc):
                if half:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last half has been read
                o_s[...] = a * lax.broadcast_in_dim(inv, a.shape, [1])
                plgpu.commit_smem()
                store = functools.partial(plgpu.copy_smem_to_gmem, o_s, o_ref.at[split, b, h, t, pl.ds(half * 64, 64)])
                unless_empty_split(store, count, cfg.num_splits)
            plgpu.copy_smem_to_gmem(l_s, lse_ref.at[split, b, h, t])  # committed with the first half
            return n + count

        lax.fori_loop(0, my_items, item_body, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)


def _run(cfg: HeadsConfig, dtype, page_table, lens, q_arr, k2d, v2d, qf=None):
    bs = q_arr.shape[0]
    D, N, S, B = cfg.head_dim, cfg.n, cfg.stages, cfg.block
    tr_pv = swizzle_transforms(dtype, N)  # V and P^T share one swizzle (2N bytes)
    # MLA: the latent tile is both operands' K and V, so Q, the tile and P^T share one swizzle
    tr = tr_pv if cfg.latent else swizzle_transforms(dtype, D)
    kv_dt = k2d.dtype
    # FP8: the TMA ring holds e4m3 tiles; the MMAs read one upcast K and one upcast V tile
    # (v_regs: V in 64-column tiles, each read transposed into registers)
    ring_k, ring_v = (swizzle_transforms(kv_dt, D),) * 2 if cfg.fp8 else (tr, tr_pv)
    ring_v = swizzle_transforms(kv_dt, 64) if cfg.v_regs else ring_v
    upcast = [plgpu.SMEM((B, D), dtype, transforms=tr), plgpu.SMEM((B, D), dtype, transforms=tr_pv)]
    upcast = [] if cfg.v_regs or not cfg.fp8 else upcast[1:] if cfg.fp8_qk else upcast
    if cfg.v_regs and cfg.is_causal and cfg.q_len > 1:  # the edge block's per-key NaN rows
        upcast = [plgpu.SMEM((B,), jnp.float32)]
    # fp8_qk: Q in e4m3 beside the landed e4m3 K tile (one swizzle)
    q_smem = plgpu.SMEM((N, D), q_arr.dtype, transforms=ring_k if cfg.fp8_qk else tr)
    out_type = (
        jax.ShapeDtypeStruct((cfg.num_splits, bs, cfg.kv_heads, cfg.tiles, cfg.v_dim, N), jnp.float32),
        jax.ShapeDtypeStruct((cfg.num_splits, bs, cfg.kv_heads, cfg.tiles, N), jnp.float32),
    )

    def entry(*refs):
        pl.run_scoped(
            lambda *scratch: _kernel(cfg, dtype, *refs, *scratch),
            q_smem,
            plgpu.SMEM((S, B, D), kv_dt, transforms=ring_k),
            *([] if cfg.latent else [plgpu.SMEM((S, B, D), kv_dt, transforms=ring_v)]),
            plgpu.SMEM((B, N), dtype, transforms=tr_pv),
            plgpu.SMEM((64, N), jnp.float32),
            plgpu.SMEM((N,), jnp.float32),
            *upcast,
            plgpu.Barrier(num_arrivals=(1 if cfg.latent else 2) * (B // cfg.piece_rows), num_barriers=S),
            plgpu.Barrier(num_arrivals=1, num_barriers=S),
            plgpu.Barrier(num_arrivals=1, num_barriers=1),
            collective_axes="wg",
        )

    kernel = plgpu_kernel(
        entry,
        out_type,
        grid=(cfg.ctas,),
        grid_names=("cta",),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name=f"jattn_{'mla_' if cfg.latent else ''}decode_heads_n{N}_q{cfg.q_len}"
        f"{'_causal' if cfg.is_causal else ''}{f'_t{cfg.tiles}' if cfg.row_tile else ''}"
        f"{'_b128' if B == 128 else ''}{'_qk8' if cfg.fp8_qk else ''}{'_vregs' if cfg.v_regs else ''}"
        f"{'_ovl' if cfg.overlap else ''}{'_bal' if cfg.balanced else ''}",
    )
    return kernel(page_table, lens, *([qf] if cfg.fp8_qk else []), q_arr, k2d, v2d)
