"""The per-KV-head Mosaic decode (keys as the MMA rows), two calls, each checked against
naive float64 attention: a causal verify of 3 queries x 4 heads (N = 16), page 64, two
splits, a page tail, its 8 items on 3 persistent CTAs (the staging tiles and Q reused
across items); then 8 queries x 4 heads (N = 32, a two-slot ring) with one item per CTA."""

import jax.numpy as jnp
import numpy as np
from common import check, naive, report, run_here

from jattn.pallas_kernels import mosaic_decode_heads as mh

rng = np.random.default_rng(0)
lens, hq, hkv, d, ps = [150, 9], 8, 2, 128, 64
pool = naive.Pool(rng, lens, ps, extra_pages=1)
k = np.asarray(pool.fill(rng, (hkv, d))).astype(jnp.bfloat16)
v = np.asarray(pool.fill(rng, (hkv, d))).astype(jnp.bfloat16)


def checked_call(q_len: int, persistent: bool) -> float:
    """One causal call (two splits; 3 persistent CTAs or one per item): its max error."""
    q = rng.standard_normal((len(lens) * q_len, hq, d)).astype(jnp.bfloat16)
    args = [jnp.asarray(x) for x in (q, k, v, pool.page_table, pool.lens)]

    def call():
        out, lse = mh.mha_decode_heads(
            *args, max_seqlen_q=q_len, return_lse=True, num_splits=2, persistent=persistent, num_ctas=3
        )
        return np.asarray(out.astype(jnp.float32)), np.asarray(lse)

    out, lse = run_here(call)
    truth, truth_lse = naive.mha_decode(q, k, v, pool.page_table, pool.lens, max_seqlen_q=q_len, is_causal=True)
    return check("mosaic_decode_heads", out, lse, truth, truth_lse, tol=2e-2)


err3, err8 = checked_call(3, persistent=True), checked_call(8, persistent=False)
report("mosaic_decode_heads", f"q3 splits=2 ctas=3 max_err={err3:.2e}; q8 max_err={err8:.2e}")
