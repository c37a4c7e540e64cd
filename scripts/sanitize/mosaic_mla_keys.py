"""Mosaic MLA absorbed decode with the latent rows as the MMA rows
(``mosaic_mla_heads.mla_decode``), bf16, causal verify of 2 tokens x 16 heads
(N = 32): one request over several splits and the ring wrapping (700 keys), one of a single
key, one empty; pages of 16 (four TMA copies per block)."""

from common import mla

mla("mosaic_mla_keys", lens=[700, 1, 0], heads=16, page_size=16, q_len=2, keys_as_rows=True)
