"""Mosaic MLA absorbed decode, causal verify: 3 draft tokens x 32 heads (96 rows: a full row
tile and a last tile of 32 rows), pages of 64, lengths not multiples of the 64-token block."""

from common import mla

mla("mosaic_mla_verify", lens=[333, 97], heads=32, page_size=64, q_len=3)
