"""Mosaic paged decode, DFLASH draft block: q_len 4, non-causal; head_dim 64, page 16."""

from common import decode

decode("mosaic_draft_block", lens=[40, 9], hq=16, hkv=8, d=64, page_size=16, q_len=4, causal=False)
