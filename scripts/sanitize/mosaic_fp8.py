"""Mosaic paged decode over an FP8 e4m3 KV cache with k/v scales (FP8 ring, K and V
upcast to f16 tiles in shared memory, one compute warpgroup), q_len 2."""

from common import decode

decode("mosaic_fp8", lens=[100, 17], hq=32, hkv=8, d=128, page_size=16, q_len=2, fp8=True)
