"""Mosaic ragged prefill with DeepSeek MLA's head dims (192 for Q/K, 128 for V: KV blocks
of 64), non-causal as for a chunk of cached prefix, more keys than queries."""

from common import prefill

prefill("mosaic_prefill_mla", q_lens=[100, 3], prefix=[90, 200], hq=2, hkv=2, d=192, dv=128, causal=False)
