"""Mosaic paged decode, target verify: q_len 4, causal; 2 KV heads (aligned tail boxes,
V rows of the page tail zeroed in shared memory), page 32; the plain block loop."""

from common import decode

decode("mosaic_verify_q4", lens=[45, 7], hq=8, hkv=2, d=128, page_size=32, q_len=4, overlap_qk=False)
