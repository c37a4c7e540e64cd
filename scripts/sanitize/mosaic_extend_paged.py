"""Mosaic paged extend: new tokens over a cached prefix in pages of 16 (several TMA
pieces per KV block), a sliding window (blocks before it skipped), logit cap and sinks;
a request with no prefix; MQA (4 query heads on one KV head)."""

from common import prefill

prefill(
    "mosaic_extend_paged",
    q_lens=[70, 5],
    prefix=[260, 0],
    page_size=16,
    hq=4,
    hkv=1,
    d=128,
    window_left=150,
    logit_cap=30.0,
    sinks=True,
)
