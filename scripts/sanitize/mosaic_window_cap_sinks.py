"""Mosaic paged decode with a sliding window (blocks below it skipped, a partial block
masked), logit cap and sinks; one empty request."""

from common import decode

decode(
    "mosaic_window_cap_sinks",
    lens=[200, 0, 3],
    hq=32,
    hkv=8,
    d=128,
    page_size=16,
    window_left=40,
    logit_cap=30.0,
    sinks=True,
)
