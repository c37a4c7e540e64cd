"""Static configuration of the Mosaic GPU MLA decode kernel (``mosaic_mla_kernel``): its
block size, ring depths, register split and :class:`MLADecodeConfig`."""

from __future__ import annotations

import dataclasses

__all__ = ["BLOCK_N", "FP8_LAND_STAGES", "NUM_STAGES", "REGISTERS", "REGISTERS_FP8", "MLADecodeConfig"]

BLOCK_N = 64  # tokens per KV block
NUM_STAGES = 2  # bf16/f16: slots of the TMA ring
FP8_LAND_STAGES = 3  # FP8: slots of the e4m3 landing ring
# Registers per thread of (warpgroup 0, warpgroup 1, producer) after ``set_max_registers``.
# Their sum may not pass three times the launch's 168: an increase only takes what the
# decreases gave back, and otherwise waits for ever. FP8: the producer also upcasts V.
REGISTERS = (232, 232, 40)
REGISTERS_FP8 = (232, 224, 48)


@dataclasses.dataclass(frozen=True)
class MLADecodeConfig:
    """Static configuration of one kernel build."""

    width: int  # R + r
    rank: int  # R: the value columns
    num_heads: int
    q_len: int
    is_causal: bool
    page_size: int
    num_pages: int
    max_pages: int
    num_splits: int
    score_scale: float | None  # softmax_scale * kv_scale when known at trace time
    interpret: bool
    fp8: bool = False  # an e4m3 latent cache (and an e4m3 query)
    row_scales: bool = False  # FP8: the query rows come with factors (the wrapper quantised them)
    land_stages: int = FP8_LAND_STAGES  # FP8: slots of the ring the TMA lands e4m3 tiles in
    v_regs: bool = False  # FP8, at most 32 query rows (v_regs_ok): V^T read into registers
    v_split: int = 128  # v_regs: the value columns warpgroup 0 accumulates (warpgroup 1 the rest)
    # balanced splits: the lengths operand ends with one more entry, the split size in blocks
    # every request shares this call (``mosaic_mla.balanced_split_size``), so a request
    # takes as many splits as its length needs; else each request cuts its own blocks
    # into ``num_splits`` ranges
    balanced: bool = False

    def __post_init__(self):
        if self.v_regs and not self.v_regs_ok:
            raise ValueError(f"v_regs needs an FP8 cache and at most 32 query rows (got {self.m_rows8})")

    @property
    def v_regs_ok(self) -> bool:
        """Whether ``v_regs`` can be built: an FP8 cache and one row tile of at most 32 query
        rows (``n_cols``). Each warpgroup holds a block's ``V^T`` in registers from when the
        block lands through its softmax or its wait for P, beside ``O^T``; at 64 columns
        the accumulators leave no room."""
        return self.fp8 and self.m_rows8 <= 32

    @property
    def upcast(self) -> bool:
        """FP8 fed to ``P V`` by the producer's upcast into an f16 V slot (not ``v_regs``)."""
        return self.fp8 and not self.v_regs

    @property
    def n_cols(self) -> int:
        """``v_regs``: the columns of ``O^T`` (the query rows, a multiple of 8)."""
        return self.m_rows8

    @property
    def m_rows(self) -> int:
        return self.q_len * self.num_heads

    @property
    def m_tiles(self) -> int:
        return -(-self.m_rows // 64)

    @property
    def m_rows8(self) -> int:
        """Query rows rounded up to 8 (a TMA box row of the tiled shared memory): the row
        count of q as the kernel reads it and of its outputs."""
        return -(-self.m_rows // 8) * 8

    @property
    def last_rows8(self) -> int:
        """Rows of the last row tile that are read and written (a multiple of 8)."""
        return self.m_rows8 - (self.m_tiles - 1) * 64

    @property
    def pieces(self) -> int:
        """TMA copies per block: one, or one per page when pages are smaller."""
        return 1 if self.page_size >= BLOCK_N else BLOCK_N // self.page_size

    @property
    def half(self) -> int:
        return self.rank // 2

    @property
    def stages(self) -> int:
        """Slots of the TMA ring."""
        return self.land_stages if self.fp8 else NUM_STAGES
