"""The static configuration of a Mosaic GPU prefill kernel build
(``mosaic_prefill_kernel``): the scheduling options a caller may set and the
per-build configuration the entry points derive from the call."""

from __future__ import annotations

import dataclasses

from jattn.pallas_kernels.prefill_plan import TILE_Q

__all__ = ["AUTO_L2_SECTION_KIB", "PrefillConfig", "PrefillOptions", "TILE_Q", "resolve_l2_section_kib"]


@dataclasses.dataclass(frozen=True)
class PrefillOptions:
    """Scheduling choices of the kernel (static)."""

    # Fence the softmax results (acc, l, m, P) before the warpgroup hands the tensor
    # cores over, so the compiler cannot sink softmax work past the hand-over.
    fence_softmax: bool = False
    # Wait for the next block's K while this block's P @ V runs, not before its Q K^T.
    # Off by default: measured within the noise of the default (docs/PERF.md).
    prefetch_k: bool = False
    # Intra-warpgroup overlap on the unmasked blocks: each warpgroup issues
    # ``S(i) = Q K(i)^T`` and ``O += P(i-1) V(i-1)`` together, and runs the softmax of
    # block i while its own P V is still on the tensor cores (O is rescaled once that
    # product lands). Not combined with ``prefetch_k``.
    overlap_pv: bool = False
    # Keys per K/V block (0: by head width, ``mosaic_prefill._choose_blocks``): 64, with
    # the ring stages the width allows, or 128 where the width takes 128 by default.
    block_kv: int = 0
    # One CTA per SM, each walking its share of the tiles (see ``_kernel``'s ``tile``):
    # the next tile's K/V stream in while a tile ends, and no CTA launches per tile.
    # Not where the output tiles borrow a ring slot (192/128). None: on where it was
    # measured faster (``persistent_by_default``), else one CTA per tile.
    persistent: bool | None = None
    # The persistent launch's CTA count (0: one per SM). A count with persistent=None
    # turns the persistent launch on; with persistent=False it is an error.
    ctas: int = 0
    # Launch order in L2 sections (KiB of K/V a section; 0: off): the tiles request by
    # request, each request's (tile, query head) items in sections of as many KV heads
    # as fit this much K/V, section by section (``prefill_plan.section_items``), so the
    # CTAs in flight share KV streams. Off: tiles longest first across requests, heads
    # fastest. None: ``AUTO_L2_SECTION_KIB`` where each query head has its own KV head
    # (MHA, MLA prefill: no two CTAs of the default order share a stream), else off
    # (with GQA the query heads of a KV head already share it).
    l2_section_kib: int | None = None
    # With the sections and the persistent launch: each section folded so that every
    # CTA's two items of a round pair are a long and a short tile
    # (``prefill_plan._fold_for_walk``), where the plan's count of each CTA's work says
    # it loads the busiest CTA no more. False: the sections' plain order, in which a
    # section ending mid-round leaves the CTAs' work uneven.
    fold_sections: bool = True


def persistent_by_default(head_dim: int, head_dim_v: int, kv_fp8: bool) -> bool:
    """Whether ``PrefillOptions(persistent=None)`` takes the persistent launch: head_dim 64
    and 128 (equal q/k and v widths) over 2-byte K/V, where it was measured faster than
    one CTA per tile; head_dim 256 and FP8 K/V keep one CTA per tile (docs/PERF.md)."""
    return head_dim == head_dim_v and head_dim in (64, 128) and not kv_fp8


# The sections' size where ``l2_section_kib`` is None: half the L2 of an H100 / H200
# (50 MB), so a section's K/V stays in L2 beside the other data in flight.
AUTO_L2_SECTION_KIB = 24576


def resolve_l2_section_kib(options: PrefillOptions, num_q_heads: int, num_kv_heads: int) -> int:
    """``options.l2_section_kib`` for a call with these head counts (None resolved)."""
    kib = options.l2_section_kib
    if kib is None:
        return AUTO_L2_SECTION_KIB if num_q_heads == num_kv_heads else 0
    if isinstance(kib, bool) or not isinstance(kib, int) or kib < 0:
        raise ValueError(f"PrefillOptions.l2_section_kib={kib!r}: None (auto), 0 (off) or KiB of K/V a section")
    return kib


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Static configuration of one kernel build."""

    head_dim: int  # q/k width
    head_dim_v: int
    num_q_heads: int
    num_kv_heads: int
    block_kv: int
    num_stages: int
    is_causal: bool
    window_left: int
    logit_cap: float
    has_sinks: bool
    page_size: int  # 0: contiguous (ragged) K/V
    num_pages: int
    max_pages: int
    interpret: bool
    clean_edges: bool  # non-finite V on edge blocks: flag and clean (else only zero keys outside)
    options: PrefillOptions = PrefillOptions()
    kv_fp8: bool = False  # FP8 e4m3 K/V: staged by TMA, upcast to f16 into the ring by the producer
    num_tiles: int = 1  # query tiles per head (the launch's work list is Hq x num_tiles items)
    ctas: int = 0  # CTAs launched (0: one per item)

    @property
    def items(self) -> int:
        return self.num_q_heads * self.num_tiles

    @property
    def launch_ctas(self) -> int:
        return min(self.ctas, self.items) if self.ctas else self.items

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def out_in_ring(self) -> bool:
        """The output tiles borrow a V ring slot after the loop (where ``Dv != D``, so
        Q's tiles cannot hold them, and a slot holds both warpgroups' 64 rows)."""
        return self.head_dim_v != self.head_dim and self.block_kv >= TILE_Q and self.num_stages >= 2

    @property
    def pieces(self) -> int:
        """TMA copies per K/V block: one, or one per page when pages are smaller."""
        return 1 if self.page_size == 0 or self.page_size >= self.block_kv else self.block_kv // self.page_size
