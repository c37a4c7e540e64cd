"""Mosaic paged decode, q_len 1, bf16 KV: one empty request and one whose length ends
mid-page; GQA 4 (32/8 heads, head_dim 128, page 16); the pipelined block loop, one split."""

from common import decode

decode("mosaic_q1_bf16", lens=[0, 37], hq=32, hkv=8, d=128, page_size=16)
