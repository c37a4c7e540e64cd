"""The Mosaic GPU (Hopper) kernel of ragged prefill and paged extend attention.

One kernel serves both ops:

* **prefill** (``jattn.ops.mha_prefill``): ragged q, k, v without a cache; request
  ``b``'s queries are ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and its keys
  ``cu_seqlens_kv[b]:cu_seqlens_kv[b+1]``;
* **extend** (``jattn.ops.mha_extend_with_kvcache``, after the new K/V are written
  to the cache): ragged q over a paged cache; request ``b``'s keys are its first
  ``cache_seqlens[b]`` cached tokens, found through ``page_table[b]``.

The causal mask is aligned bottom-right (query ``i`` of ``n`` sees key
``j <= L - n + i``), so an extend is a prefill whose first ``L - n`` keys are the
prefix.

Layout of the work (FlashAttention-3 style):

* A **tile** is 128 consecutive query rows of one request and one query head: two
  compute warpgroups own 64 rows each. The tiles of all requests are listed once
  (a request of ``n`` queries has ``ceil(n / 128)`` of them, no padding between
  requests) and ordered longest work first; the work list is (tile, query head)
  pairs, heads fastest. Two launches:
  - **persistent** (the default at head_dim 64 and 128 with 2-byte K/V): one CTA per SM.
    CTA ``c`` takes item ``c`` of each round of ``ctas`` items, counting forwards
    in even rounds and backwards in odd ones, so that with the longest work first
    every CTA's items add up to about the same work. The ring, its barrier phases
    and the ping-pong run on from one tile to the next, so the producer streams
    the next tile's first K/V blocks while the consumers finish a tile, and no CTA
    is launched per tile. A static order rather than a device-side work queue:
    the tiles' work is known when the list is built.
  - **one CTA per tile** (the rest): the hardware places each CTA as an SM frees
    up, in the same longest-first order, so the CTAs launched last are the short
    ones and the SMs finish together.
  - either launch takes the items in **L2 sections** instead where each query head
    has its own KV head (``PrefillOptions.l2_section_kib``, by default on there,
    ``prefill_plan.section_items``): request by request, a few KV heads at a time,
    so the CTAs in flight read the same K/V from L2 rather than one stream each
    from HBM; for the persistent walk each section is folded so that its rounds
    stay even (``PrefillOptions.fold_sections``).
* A **producer** warpgroup streams K and V blocks of ``block_kv`` tokens of the
  query head's KV head by TMA into a ring of ``num_stages`` slots. Only the blocks
  the tile can see are fetched: with a causal mask the blocks past the tile's last
  query, with a sliding window the blocks before the first query's window.
* **FP8 e4m3 K/V** (an extend over an FP8 cache): the TMA lands each block in an
  FP8 tile and the producer upcasts it to f16 (exact) into the ring, so the
  consumers' loop is the one above; ``k_scale`` is folded into the score scale
  and ``v_scale`` multiplies the output. The queries are computed in f16 then.
* The two **consumer** warpgroups run ``S = Q K^T`` and ``O += P V`` on the
  tensor cores (``wgmma``) with an online softmax in base 2. A shared barrier
  staggers them (ping-pong): while one warpgroup's softmax runs, the other's
  matmuls use the tensor cores.
* Blocks wholly inside every row's visible range skip the mask; only the edge
  blocks (causal diagonal, window start, the request's first and last blocks)
  compute it. Masked keys contribute nothing, whatever they hold: on an edge
  block warpgroup 0 records which V rows hold a non-finite value and replaces
  those entries by 0 in shared memory; each row that sees a recorded key comes
  out NaN, and ``P = 0`` times the cleaned tile is 0
  (the next request's keys, a page's unused tail, a future token's V). This
  cleaning (``clean_edges``) is on for causal and windowed calls, and runs only
  when some V row a query could see masked is non-finite (one check per call
  outside the kernel, ``v_bad``): otherwise, and without causal or window masks,
  zeroing the V rows outside the request is exact, since P = 0 times a finite
  value is 0.
* Each warpgroup's 64 output rows go by TMA straight into the ragged output when
  they lie inside their request; the at most two chunks per request that straddle
  its first or last row go to a small side buffer and are put in place after the
  kernel (a scatter of at most 128 rows per request). The rows past the last
  request (padding) are one more request with no keys, so the kernel writes every
  output row (0, LSE -inf). The LSE likewise. The output tiles are staged in Q's
  tiles where ``Dv == D``; at 192/128 they borrow the V ring slot of block
  ``count - S`` once both warpgroups are past their loops, which leaves room for
  128-key blocks (``PrefillConfig.out_in_ring``).
* ``PrefillOptions`` holds scheduling variants, off by default: an intra-warpgroup
  overlap of ``S(i)`` with ``P(i-1) V(i-1)`` (``overlap_pv``), a fence before the
  hand-over, an earlier wait for the next K, and the block size.

The entry points (argument handling, the tile plan, padding, the side merge)
are ``mosaic_prefill.mha_prefill`` and ``mosaic_prefill.mha_extend``; this module
holds the kernel body and its launch (:func:`run`). The f32 oracles are
``jattn.reference.mha_prefill`` and ``jattn.reference.mha_extend``.

Under the Mosaic GPU interpreter (CPU tests) the matmuls are plain dots on the
shared-memory tiles and the inputs are padded so that no TMA box reads out of
bounds (the GPU's TMA fills those rows with zeros); the rest (tile order, page
addressing, ring, barriers, masks, softmax) is the kernel that runs on the GPU.
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
    load_layout,
    plgpu_kernel,
    swizzle_transforms,
    tile_iota,
    vec_iota,
)
from jattn.pallas_kernels.mosaic_prefill_config import TILE_Q, PrefillConfig
from jattn.pallas_kernels.mosaic_prefill_producer import produce

__all__ = ["run"]

_LOG2E = math.log2(math.e)


# ---------------------------------------------------------------------------
# The kernel.
def _kernel(
    cfg: PrefillConfig,
    dtype,
    # inputs
    tile_req_ref,  # i32[T]: request of each launched tile (-1: none)
    tile_loc_ref,  # i32[T]: which tile of its request (0, 1, ...)
    item_ref,  # i32[Hq * T]: the item at each launch position (options.l2_section_kib), else i32[1]
    cu_q_ref,  # i32[bs + 1]
    kv_start_ref,  # i32[bs]: first key row (contiguous) or 0 (paged)
    kv_len_ref,  # i32[bs]
    page_table_ref,  # i32[bs, max_pages] (paged) or i32[1, 1]
    scale_ref,  # f32[2 + Hq]: score scale, the sinks (natural log units), then v_bad (> 0: some V may be non-finite)
    q_ref,  # [Tq, Hq, D]
    k_ref,  # [Tk, Hkv, D] or [num_pages, page_size, Hkv, D]
    v_ref,  # same with Dv
    # outputs
    o_ref,  # [Tq, Hq, Dv]: the ragged output (chunks wholly inside their request)
    lse_ref,  # f32[Hq, Tq] natural log, likewise
    o_side_ref,  # [2 * bs, 64, Hq, Dv]: chunks that straddle a request's edge
    lse_side_ref,  # f32[2 * bs, Hq, 64]
    # scratch
    q_smem,  # [2, 64, D] (the output tile reuses it when Dv == D)
    o_smem,  # [2, 64, Dv] or None
    k_smem,  # [S, BK, D]
    v_smem,  # [S, BK, Dv]
    lse_smem,  # f32[2, 64]
    bad_smem,  # f32[S, BK]: an edge block's V rows holding a non-finite value (clean_edges)
    k_bar,
    v_bar,
    q_bar,
    k_free,
    v_free,
    sched,
    cleaned,  # per slot: warpgroup 0 has cleaned the slot's V tile (clean_edges)
    k_stage,  # FP8 K/V (kv_fp8): [1, BK, D] / [1, BK, Dv] e4m3 landing tiles of the TMA, else None
    v_stage,
    k_sbar,  # their TMA barriers
    v_sbar,
    out_bar,  # out_in_ring: both warpgroups are done with the ring (else None)
):
    BK, S, DV = cfg.block_kv, cfg.num_stages, cfg.head_dim_v
    wg = lax.axis_index("wg")
    cta = lax.axis_index("ctas")
    ctas = cfg.launch_ctas
    rounds = -(-cfg.items // ctas)

    def tile(r):
        """The scalars of this CTA's item in round ``r``: item ``w`` is query head
        ``w % Hq``, tile ``w // Hq`` (tiles longest first), and the rounds walk the CTAs
        forwards and backwards in turn, so each CTA's items add up to about the same
        work. With ``l2_section_kib`` launch position ``w`` runs item ``item_ref[w]``. An
        item past the last is a dead tile (no blocks, no stores)."""
        c = jnp.where(lax.rem(r, 2) == 0, cta, ctas - 1 - cta)
        w = r * ctas + c
        wc = jnp.minimum(w, cfg.items - 1)
        if cfg.options.l2_section_kib:
            wc = item_ref[wc]
        h = lax.rem(wc, jnp.int32(cfg.num_q_heads))
        t = lax.div(wc, jnp.int32(cfg.num_q_heads))
        req = jnp.where(w < cfg.items, tile_req_ref[t], -1)
        live = req >= 0
        b = jnp.maximum(req, 0)
        loc = tile_loc_ref[t]
        q_start = cu_q_ref[b]
        n_q = cu_q_ref[b + 1] - q_start
        n_kv = kv_len_ref[b]
        off = n_kv - n_q  # key index of query 0 under the bottom-right causal alignment
        kvh = lax.div(h, jnp.int32(cfg.group))
        # TMA boxes of the tiled shared-memory layout start on 8-row boundaries of the
        # GMEM arrays, so tiles and blocks start at the 8-row boundary at or before the
        # request's first row: the tile's first rows (dq of them) and the first block's
        # first keys (dk) belong to the previous request and are masked (rows: never
        # gathered; keys: masked, their V zeroed).
        q_base = lax.div(q_start, jnp.int32(8)) * 8
        dq = q_start - q_base
        if cfg.page_size == 0:
            kv_start = kv_start_ref[b]
            kv_base = lax.div(kv_start, jnp.int32(8)) * 8
            dk = kv_start - kv_base
        else:
            kv_base = dk = jnp.int32(0)
        q0 = loc * TILE_Q - dq  # request row of the tile's first row (may be negative)

        # The tile's blocks: [lo, hi) in units of BK (same in every warpgroup); block
        # ``blk`` holds keys ``blk * BK - dk + [0, BK)``.
        row_hi = jnp.minimum(q0 + TILE_Q, n_q)  # rows past n_q belong to no query
        key_hi = jnp.minimum(off + row_hi, n_kv) if cfg.is_causal else n_kv
        hi = jnp.where(live, lax.div(jnp.maximum(key_hi, 0) + dk + BK - 1, jnp.int32(BK)), 0)
        if cfg.window_left >= 0:
            lo = lax.div(jnp.clip(off + q0 - cfg.window_left, 0, n_kv) + dk, jnp.int32(BK))
        else:
            lo = jnp.int32(0)
        lo = jnp.minimum(lo, hi)
        count = hi - lo
        return h, req, live, b, loc, n_q, n_kv, off, kvh, q_base, kv_base, dk, q0, lo, hi, count

    def items(body):
        """Run ``body(r, base) -> base`` over this CTA's rounds, ``base`` the ring steps
        taken so far (the ring and its barrier phases run on across items)."""
        if rounds == 1:
            return body(0, jnp.int32(0))
        return lax.fori_loop(0, rounds, body, jnp.int32(0))

    @pl.when(wg == 2)
    def _producer():
        ring = (k_smem, v_smem, k_bar, v_bar, k_free, v_free, k_stage, v_stage, k_sbar, v_sbar)
        produce(cfg, tile, items, page_table_ref, k_ref, v_ref, ring)

    @pl.when(wg < 2)
    def _consumer():
        interp = cfg.interpret
        if not interp:
            plgpu.set_max_registers(_CONSUMER_REGS[cfg.kv_fp8], action="increase")

        def item(r, base):
            h, req, live, b, loc, n_q, n_kv, off, kvh, q_base, kv_base, dk, q0, lo, hi, count = tile(r)

            def ring(i):
                """The ring slot of this item's block ``i``."""
                return lax.rem(base + i, jnp.int32(S))

            qo_smem = q_smem.at[wg]
            if cfg.out_in_ring:  # slot count % S: its last block (count - S) is done in both warpgroups at out_bar
                out_smem = v_smem.at[ring(count), pl.ds(wg * 64, 64)]
            else:
                out_smem = qo_smem if o_smem is None else o_smem.at[wg]
            r0 = q0 + wg * 64  # first row of this warpgroup within the request

            @pl.when(live)
            def _():
                row = q_base + loc * TILE_Q + wg * 64
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row, 64), h], qo_smem, q_bar.at[wg])
                plgpu.barrier_wait(q_bar.at[wg])

            scale = scale_ref[0]
            xscale = scale if cfg.logit_cap > 0 else scale * _LOG2E

            def cast(x, layout):
                return cast_layout(x, layout, interpret=interp)

            def sched_sync():
                """Ping-pong: each call lets the other warpgroup take the tensor cores."""
                if not interp:
                    plgpu.barrier_arrive(sched)
                    plgpu.barrier_wait(sched)

            def mask_of(blk):
                cols = vec_iota(BK, 1, interpret=interp)
                key = lax.broadcast_in_dim(cols + (blk * BK - dk), (64, BK), [1])
                ok = (key >= 0) & (key < n_kv)
                if cfg.is_causal or cfg.window_left >= 0:
                    rows = vec_iota(64, 0, interpret=interp) + r0  # [64] row of each query
                    qp = lax.broadcast_in_dim(off + rows, (64, BK), [0])  # its key position
                    if cfg.is_causal:
                        ok = ok & (key <= qp)
                    if cfg.window_left >= 0:
                        ok = ok & (key >= qp - cfg.window_left)
                return ok

            def qk(slot):
                k_tile = k_smem.at[slot]
                if interp:
                    return lax.dot_general(
                        qo_smem[...], k_tile[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                    )

                def scope(acc_ref):
                    plgpu.wgmma(acc_ref, qo_smem, k_tile.T)
                    sched_sync()
                    return acc_ref[...]

                return pl.run_scoped(scope, plgpu.ACC((64, BK), jnp.float32))

            def zero_tail(slot, blk):
                """Zero the V rows of keys outside [0, n_kv) (the first and last blocks)."""
                vt = v_smem.at[slot]
                k0 = blk * BK - dk

                @pl.when((k0 < 0) | (k0 + BK > n_kv))
                def _():
                    vr = tile_iota((BK, DV), 0, interpret=interp)
                    key = vr + k0
                    vt[...] = jnp.where((key >= 0) & (key < n_kv), vt[...], jnp.zeros((BK, DV), vt.dtype))
                    plgpu.commit_smem()

            def load_cols(ref):
                """A [BK] f32 vector from shared memory, in the score tile's column layout."""
                return load_layout(ref, plgpu.Layout.WGMMA.reduce(0), interpret=interp)

            def clean_edge_tile(slot, ok):
                """An edge block's V tile made safe to multiply by P, and the poison of the
                rows that see a non-finite V. A masked key (P = 0) must add exactly nothing,
                but 0 * NaN is NaN: warpgroup 0 records which V rows hold a non-finite value
                (``bad_smem``) and replaces those entries by 0 in shared memory; both
                warpgroups then read the record (``cleaned`` orders it before their P @ V)
                and a row whose mask ``ok`` admits a flagged key gets NaN in its softmax
                denominator. Warpgroup 0 runs ahead of warpgroup 1 (ping-pong), so the
                wait rarely stalls."""
                v_tile = v_smem.at[slot]

                @pl.when(wg == 0)
                def _():
                    v = v_tile[...]
                    finite = v - v == 0
                    one, zero = jnp.ones(v.shape, v.dtype), jnp.zeros(v.shape, v.dtype)
                    bad_smem[slot] = jnp.where(finite, zero, one).max(axis=1).astype(jnp.float32)
                    v_tile[...] = jnp.where(finite, v, zero)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(cleaned.at[slot])

                plgpu.barrier_wait(cleaned.at[slot])
                bad = lax.broadcast_in_dim(load_cols(bad_smem.at[slot]), (64, BK), [1])
                hit = jnp.where(ok & (bad > 0), 1.0, 0.0).max(axis=1)
                return jnp.where(hit > 0, jnp.nan, 0.0)

            def softmax(s, m_i, l_i, ok=None):
                """Online softmax of one block's scores (base 2): ``(P, alpha, m, l)``,
                ``alpha`` the factor that rescales the accumulator to the new maximum."""
                x = s * xscale
                if cfg.logit_cap > 0:
                    x = jnp.tanh(x * (1.0 / cfg.logit_cap)) * (cfg.logit_cap * _LOG2E)
                if ok is not None:
                    x = jnp.where(ok, x, -jnp.inf)
                m_new = jnp.maximum(m_i, x.max(axis=1))
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp2(m_i - m_use)
                p = jnp.exp2(x - lax.broadcast_in_dim(m_use, x.shape, [0]))
                return p.astype(dtype), alpha, m_new, l_i * alpha + p.sum(axis=1)

            def rescale(acc, alpha):
                return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            def step(i, carry, masked: bool, clean: bool = False):
                acc, m_i, l_i = carry
                slot = ring(i)
                blk = lo + i
                if not prefetch_k:
                    plgpu.barrier_wait(k_bar.at[slot])
                s = qk(slot)
                plgpu.barrier_arrive(k_free.at[slot])
                ok = mask_of(blk) if masked else None
                p16, alpha, m_new, l_i = softmax(s, m_i, l_i, ok)
                acc = rescale(acc, alpha)
                if cfg.options.fence_softmax:
                    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                if not interp:
                    plgpu.barrier_arrive(sched)  # softmax done
                plgpu.barrier_wait(v_bar.at[slot])
                if masked and clean:
                    l_i = l_i + clean_edge_tile(slot, ok)
                elif masked:
                    zero_tail(slot, blk)
                acc = pv(acc, p16, slot, wait_next_k(i) if prefetch_k else None)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            def pv(acc, p16, slot, then=None):
                """``acc + P V`` on the tensor cores once they are this warpgroup's, with
                ``then()`` run while the product is in flight."""
                if interp:
                    acc = acc + jnp.dot(p16, v_smem[slot], preferred_element_type=jnp.float32)
                    if then is not None:
                        then()
                    return acc
                plgpu.barrier_wait(sched)  # the tensor cores are ours

                def product(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    if then is not None:
                        then()

                return pl.run_state(product)(plgpu.ACC.init(acc))

            prefetch_k = cfg.options.prefetch_k

            def wait_next_k(i):
                """A function that waits for block ``i + 1``'s K, if there is one. Its
                predicate and slot are computed here, outside the ``run_state`` of
                :func:`pv` that calls it: a value it closes over becomes an input and an
                output of that ``run_state``, and one that JAX holds as a literal (a
                constant ring base, with a single round per CTA) fails to lower there."""
                more = i + 1 < count
                slot = ring(i + 1)

                def wait():
                    @pl.when(more)
                    def _():
                        plgpu.barrier_wait(k_bar.at[slot])

                return wait

            def overlapped_steps(a, b, carry):
                """Unmasked steps [a, b) (a < b), the tensor-core work of consecutive blocks
                overlapped in this warpgroup (``PrefillOptions.overlap_pv``):

                * prologue: ``S(a)``, its softmax;
                * step i: issue ``S(i)`` and ``O += P(i-1) V(i-1)`` together, hand the
                  tensor cores over, take ``S(i)`` as soon as it lands (the P V may still
                  run) and run its softmax, then wait for the P V and rescale O;
                * epilogue: ``O += P(b-1) V(b-1)``.

                The ping-pong barrier sees the same arrive / wait sequence as :func:`step`
                (two of each per block), so overlapped and plain steps mix freely."""
                acc, m_i, l_i = carry
                slot = ring(a)
                plgpu.barrier_wait(k_bar.at[slot])
                s = qk(slot)
                plgpu.barrier_arrive(k_free.at[slot])
                p16, alpha, m_i, l_i = softmax(s, m_i, l_i)
                acc = rescale(acc, alpha)
                if not interp:
                    plgpu.barrier_arrive(sched)  # softmax done

                def body(i, carry):
                    acc, m_i, l_i, p_prev = carry
                    slot = ring(i)
                    pslot = ring(i - 1)
                    plgpu.barrier_wait(k_bar.at[slot])
                    plgpu.barrier_wait(v_bar.at[pslot])
                    if interp:
                        s = lax.dot_general(
                            qo_smem[...], k_smem[slot], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                        )
                        plgpu.barrier_arrive(k_free.at[slot])
                        acc = acc + jnp.dot(p_prev, v_smem[pslot], preferred_element_type=jnp.float32)
                        plgpu.barrier_arrive(v_free.at[pslot])
                        p16, alpha, m_i, l_i = softmax(s, m_i, l_i)
                        return rescale(acc, alpha), m_i, l_i, p16
                    plgpu.barrier_wait(sched)  # the tensor cores are ours

                    def scope(s_ref, o_ref):
                        o_ref[...] = acc
                        plgpu.wgmma(s_ref, qo_smem, k_smem.at[slot].T)
                        plgpu.wgmma(o_ref, p_prev, v_smem.at[pslot])
                        sched_sync()
                        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S(i) in, P V in flight
                        plgpu.barrier_arrive(k_free.at[slot])
                        p16, alpha, m_new, l_new = softmax(s, m_i, l_i)
                        plgpu.barrier_arrive(sched)  # softmax done
                        o = plgpu.wgmma_accumulator_load(o_ref, wait_n=0)
                        plgpu.barrier_arrive(v_free.at[pslot])
                        return rescale(o, alpha), m_new, l_new, p16

                    return pl.run_scoped(scope, plgpu.ACC((64, BK), jnp.float32), plgpu.ACC((64, DV), jnp.float32))

                acc, m_i, l_i, p16 = lax.fori_loop(a + 1, b, body, (acc, m_i, l_i, p16))
                slot = ring(b - 1)
                plgpu.barrier_wait(v_bar.at[slot])
                acc = pv(acc, p16, slot)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_i, l_i

            def middle_steps(a, b, carry):
                """The unmasked steps [a, b)."""
                if not cfg.options.overlap_pv:
                    return lax.fori_loop(a, b, functools.partial(step, masked=False), carry)
                return lax.cond(b > a, functools.partial(overlapped_steps, a, b), lambda c: c, carry)

            m_i = cast(jnp.full((64,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = cast(jnp.full((64,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = cast(jnp.full((64, DV), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            # Blocks [full_lo, full_hi) need no mask for any query row of the tile: every
            # key is >= 0 and < n_kv, <= the first row's position (causal), >= the last
            # row's window start. The rest of [lo, hi) are edge blocks, the same ones in
            # both warpgroups (they meet on each).
            if cfg.clean_edges:  # the tile's rows: both warpgroups take the same edge blocks
                first_pos = off + jnp.maximum(q0, 0)
                last_pos = off + jnp.maximum(jnp.minimum(q0 + TILE_Q - 1, n_q - 1), 0)
            else:  # this warpgroup's rows
                first_pos = off + jnp.maximum(r0, 0)
                last_pos = off + jnp.maximum(jnp.minimum(r0 + 63, n_q - 1), 0)
            key_end = jnp.minimum(first_pos + 1, n_kv) if cfg.is_causal else n_kv
            full_hi = jnp.clip(lax.div(jnp.maximum(key_end, 0) + dk, jnp.int32(BK)), lo, hi)
            key_start = jnp.maximum(last_pos - cfg.window_left, 0) if cfg.window_left >= 0 else 0
            full_lo = jnp.clip(lax.div(key_start + dk + BK - 1, jnp.int32(BK)), lo, full_hi)

            if prefetch_k:  # the first block's K; each step waits for the next one

                @pl.when(count > 0)
                def _():
                    plgpu.barrier_wait(k_bar.at[ring(0)])

            if not interp:
                pl.when(wg == 1)(sched_sync)  # warpgroup 0 goes first
            carry = (acc, m_i, l_i)
            v_bad = scale_ref[1 + cfg.num_q_heads] > 0

            def edge_steps(a, b, carry, in_request_masks: bool):
                """Edge steps [a, b). Where a key inside the request is masked for some rows
                (``in_request_masks``) and some V may be non-finite (``v_bad``, decided per
                call outside the kernel), with the cleaning; else zeroing the V rows outside
                the request, which is then exact (P = 0 times a finite V is 0)."""
                if not (cfg.clean_edges and in_request_masks):
                    return lax.fori_loop(a, b, functools.partial(step, masked=True), carry)
                mid = jnp.where(v_bad, b, a)  # the same in both warpgroups
                carry = lax.fori_loop(a, mid, functools.partial(step, masked=True, clean=True), carry)
                return lax.fori_loop(mid, b, functools.partial(step, masked=True), carry)

            window = cfg.window_left >= 0
            carry = edge_steps(0, full_lo - lo, carry, window)  # the window's first blocks, the request's first
            carry = middle_steps(full_lo - lo, full_hi - lo, carry)
            acc, m_i, l_i = edge_steps(full_hi - lo, count, carry, cfg.is_causal or window)  # diagonal, last
            if not interp:
                pl.when(wg == 0)(sched_sync)

            empty = l_i == 0.0
            m_use = jnp.where(empty, 0.0, m_i)
            denom = l_i
            if cfg.has_sinks:
                sink2 = scale_ref[1 + h] * _LOG2E
                denom = l_i + jnp.exp2(sink2 - m_use)
            inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, denom))
            acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
            lse = jnp.where(empty, -jnp.inf, (m_use + jnp.log2(jnp.where(empty, 1.0, l_i))) * (1.0 / _LOG2E))

            if cfg.out_in_ring:
                plgpu.barrier_arrive(out_bar)
                plgpu.barrier_wait(out_bar)

            @pl.when(live)
            def _():
                out_smem[...] = acc.astype(dtype)
                lse_smem[wg] = lse
                plgpu.commit_smem()
                # A chunk of 64 rows wholly inside the request goes straight to its rows of
                # the ragged output; one that straddles the request's first or last row
                # (its other rows belong to the neighbours) goes to the request's side slot
                # (2b: the first chunk, 2b + 1: the last), merged in after the kernel.
                inside = (r0 >= 0) & (r0 + 64 <= n_q)
                some = (r0 < n_q) & (r0 + 64 > 0)
                row = q_base + loc * TILE_Q + wg * 64

                @pl.when(inside)
                def _():
                    plgpu.copy_smem_to_gmem(out_smem, o_ref.at[pl.ds(row, 64), h])
                    plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[h, pl.ds(row, 64)])

                @pl.when(some & ~inside)
                def _():
                    side = 2 * b + jnp.where(r0 < 0, 0, 1)
                    plgpu.copy_smem_to_gmem(out_smem, o_side_ref.at[side, :, h])
                    plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_side_ref.at[side, h])

                plgpu.wait_smem_to_gmem(0)

            return base + count

        items(item)


# Register budgets per thread (producer, consumers) by kv_fp8: 232 x 256 + 40 x 128 fills the
# 64K registers; the FP8 producer holds [64, 64] upcast pieces and needs more.
_CONSUMER_REGS = {False: 232, True: 224}


def run(cfg: PrefillConfig, dtype, arrays):
    """Launch the kernel: ``(o, lse, o_side, lse_side)`` for ``arrays`` as ``mosaic_prefill`` builds them."""
    tile_req, tile_loc, item, cu_q, kv_start, kv_len, page_table, scales, q, k, v = arrays
    BK, S, D, DV = cfg.block_kv, cfg.num_stages, cfg.head_dim, cfg.head_dim_v
    hq, tq, bs = cfg.num_q_heads, q.shape[0], kv_len.shape[0]
    out_type = (
        jax.ShapeDtypeStruct((tq, hq, DV), dtype),
        jax.ShapeDtypeStruct((hq, tq), jnp.float32),
        jax.ShapeDtypeStruct((2 * bs, 64, hq, DV), dtype),
        jax.ShapeDtypeStruct((2 * bs, hq, 64), jnp.float32),
    )
    tq, tv = swizzle_transforms(dtype, D), swizzle_transforms(dtype, DV)
    # FP8: the TMA lands in [1, BK, width] e4m3 tiles of 64-byte swizzle, (8, 64) tiles
    # like the f16 ring's, so the producer upcasts [64, 64] pieces tile for tile.
    f8 = k.dtype
    stage_tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))
    staging = (
        [
            plgpu.SMEM((1, BK, D), f8, transforms=stage_tr),
            plgpu.SMEM((1, BK, DV), f8, transforms=stage_tr),
            plgpu.Barrier(num_arrivals=cfg.pieces, num_barriers=1),
            plgpu.Barrier(num_arrivals=cfg.pieces, num_barriers=1),
        ]
        if cfg.kv_fp8
        else [None] * 4
    )
    ring_arrivals = 1 if cfg.kv_fp8 else cfg.pieces  # the producer's arrive, or the TMA's

    def entry(*refs):
        ins, outs = refs[:11], refs[11:]
        pl.run_scoped(
            lambda *scratch: _kernel(cfg, dtype, *ins, *outs, *scratch),
            plgpu.SMEM((2, 64, D), dtype, transforms=tq),
            None if DV == D or cfg.out_in_ring else plgpu.SMEM((2, 64, DV), dtype, transforms=tv),
            plgpu.SMEM((S, BK, D), dtype, transforms=tq),
            plgpu.SMEM((S, BK, DV), dtype, transforms=tv),
            plgpu.SMEM((2, 64), jnp.float32),
            plgpu.SMEM((S, BK), jnp.float32),
            plgpu.Barrier(num_arrivals=ring_arrivals, num_barriers=S),
            plgpu.Barrier(num_arrivals=ring_arrivals, num_barriers=S),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_arrivals=2, num_barriers=S),
            plgpu.Barrier(num_arrivals=2, num_barriers=S),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_arrivals=1, num_barriers=S),
            *staging,
            plgpu.Barrier(num_arrivals=2) if cfg.out_in_ring else None,
            collective_axes="wg",
        )

    mode = f"paged{cfg.page_size}" if cfg.page_size else "ragged"
    flags = "".join(
        f"_{n}" for n, on in (("fp8", cfg.kv_fp8), ("causal", cfg.is_causal), ("persistent", cfg.ctas)) if on
    )
    name = f"jattn_prefill_{mode}_d{D}x{DV}_bk{BK}_s{S}{flags}"
    kernel = plgpu_kernel(
        entry,
        out_type,
        grid=(cfg.launch_ctas,),
        grid_names=("ctas",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name=name,
    )
    return kernel(tile_req, tile_loc, item, cu_q, kv_start, kv_len, page_table, scales, q, k, v)
