"""Mosaic ragged prefill, causal, bf16: tiles across two requests (one of 300 rows, over
three tiles and three KV blocks: the ring wraps around; one of a single row), GQA 4 with
head_dim 128, NaN rows past the ragged totals."""

from common import prefill

prefill("mosaic_prefill_causal", q_lens=[300, 1], hq=8, hkv=2, d=128)
