"""Mosaic MLA absorbed decode (query rows as the MMA rows), bf16, 16 heads: one request over several splits and the ring
wrapping (700 keys), one of a single key, one empty; pages of 32 (two TMA copies per block);
the tile's 48 rows past the 16 real ones are neither loaded nor written."""

from common import mla

mla("mosaic_mla", lens=[700, 1, 0], heads=16, page_size=32)
