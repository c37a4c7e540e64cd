"""Mosaic paged decode split over KV: 5 splits of one request whose page table is wider than
its length (the last splits hold no keys), merged by the Triton combine kernel through
jax-triton (with sinks); page 64."""

from common import decode

decode("mosaic_split_kv", lens=[300], hq=32, hkv=8, d=128, page_size=64, sinks=True, splits=5, max_pages=8)
