"""The producer warpgroup of the Mosaic GPU prefill / extend kernel
(``mosaic_prefill_kernel``): it streams each of its CTA's items' K/V blocks by TMA into
the ring of ``num_stages`` slots (pages of any size: one TMA box per page when pages
are smaller than a block), and for FP8 K/V it lands the e4m3 tiles in buffers of their
own and upcasts them into the 2-byte ring (exact), so the consumers always see 2-byte
K/V. The ring's slot and barrier phases run on across items (``base``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jattn.pallas_kernels.mosaic_common import drain_free_barriers
from jattn.pallas_kernels.mosaic_prefill_config import PrefillConfig

__all__ = ["produce", "PRODUCER_REGS"]

#: The producer's registers per thread (FP8: it also upcasts).
PRODUCER_REGS = {False: 40, True: 56}


def produce(cfg: PrefillConfig, tile, items, page_table_ref, k_ref, v_ref, ring) -> None:
    """The producer warpgroup's program. ``tile(r)``: the scalars of this CTA's item in
    round ``r``; ``items(body)``: ``body(r, base) -> base`` over its rounds; ``ring``:
    ``(k_smem, v_smem, k_bar, v_bar, k_free, v_free, k_stage, v_stage, k_sbar, v_sbar)``
    (the last four None without FP8 K/V)."""
    k_smem, v_smem, k_bar, v_bar, k_free, v_free, k_stage, v_stage, k_sbar, v_sbar = ring
    BK, S, DV = cfg.block_kv, cfg.num_stages, cfg.head_dim_v
    if not cfg.interpret:
        plgpu.set_max_registers(PRODUCER_REGS[cfg.kv_fp8], action="decrease")

    def item(r, base):
        h, req, live, b, loc, n_q, n_kv, off, kvh, q_base, kv_base, dk, q0, lo, hi, count = tile(r)

        def fetch(ref, smem, bar, slot, blk):
            if cfg.page_size == 0:
                plgpu.copy_gmem_to_smem(ref.at[pl.ds(kv_base + blk * BK, BK), kvh], smem.at[slot], bar.at[slot])
                return
            ps = cfg.page_size
            if cfg.pieces == 1:  # BK divides the page: one box inside one page
                per_page = ps // BK
                pidx = jnp.minimum(lax.div(blk, jnp.int32(per_page)), cfg.max_pages - 1)
                page = jnp.clip(page_table_ref[b, pidx], 0, cfg.num_pages - 1)
                row = lax.rem(blk, jnp.int32(per_page)) * BK
                plgpu.copy_gmem_to_smem(ref.at[page, pl.ds(row, BK), kvh], smem.at[slot], bar.at[slot])
                return
            for j in range(cfg.pieces):  # pages smaller than BK: one whole page per box
                pidx = jnp.minimum(blk * cfg.pieces + j, cfg.max_pages - 1)
                page = jnp.clip(page_table_ref[b, pidx], 0, cfg.num_pages - 1)
                plgpu.copy_gmem_to_smem(ref.at[page, :, kvh], smem.at[slot, pl.ds(j * ps, ps)], bar.at[slot])

        def upcast(stage, ring, slot, width):
            """An FP8 tile from its landing buffer into ring slot ``slot`` as f16 (exact),
            in [64, 64] pieces (32 values a thread), then made visible to the wgmma."""
            for r in range(0, BK, 64):
                for c in range(0, width, 64):
                    x = stage[0, pl.ds(r, 64), pl.ds(c, 64)]
                    ring[slot, pl.ds(r, 64), pl.ds(c, 64)] = x.astype(ring.dtype)
            plgpu.commit_smem()

        if cfg.kv_fp8:  # K(i + 1) lands while V(i) is upcast; the f16 ring runs ahead as before

            @pl.when(count > 0)
            def _():
                fetch(k_ref, k_stage, k_sbar, 0, lo)

            @pl.loop(0, count)
            def _fetch_fp8(i):
                slot = lax.rem(base + i, jnp.int32(S))
                fetch(v_ref, v_stage, v_sbar, 0, lo + i)
                plgpu.barrier_wait(k_sbar.at[0])

                @pl.when(base + i >= S)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])

                upcast(k_stage, k_smem, slot, cfg.head_dim)  # ends with a warpgroup barrier:
                plgpu.barrier_arrive(k_bar.at[slot])  # k_stage's reads are done before its refill

                @pl.when(i + 1 < count)
                def _():
                    fetch(k_ref, k_stage, k_sbar, 0, lo + i + 1)

                plgpu.barrier_wait(v_sbar.at[0])

                @pl.when(base + i >= S)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])

                upcast(v_stage, v_smem, slot, DV)
                plgpu.barrier_arrive(v_bar.at[slot])

            return base + count

        @pl.loop(0, count)
        def _fetch(i):
            slot = lax.rem(base + i, jnp.int32(S))

            @pl.when(base + i >= S)
            def _():
                plgpu.barrier_wait(k_free.at[slot])

            fetch(k_ref, k_smem, k_bar, slot, lo + i)

            @pl.when(base + i >= S)
            def _():
                plgpu.barrier_wait(v_free.at[slot])

            fetch(v_ref, v_smem, v_bar, slot, lo + i)

        return base + count

    total = items(item)
    if cfg.interpret:
        drain_free_barriers(total, S, k_free, v_free)
