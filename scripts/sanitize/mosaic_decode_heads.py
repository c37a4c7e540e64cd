"""The per-KV-head Mosaic decode (keys as the MMA rows): causal verify, 3 queries x 4
heads (N = 16), page 64, two splits, a page tail; the 8 items on 3 persistent CTAs (the
staging tiles and Q reused across items); one call, checked against naive float64 attention."""

import jax.numpy as jnp
import numpy as np
from common import check, naive, report, run_here

from jattn.pallas_kernels import mosaic_decode_heads as mh

rng = np.random.default_rng(0)
lens, hq, hkv, d, ps, q_len = [150, 9], 8, 2, 128, 64, 3
pool = naive.Pool(rng, lens, ps, extra_pages=1)
k = np.asarray(pool.fill(rng, (hkv, d))).astype(jnp.bfloat16)
v = np.asarray(pool.fill(rng, (hkv, d))).astype(jnp.bfloat16)
q = rng.standard_normal((len(lens) * q_len, hq, d)).astype(jnp.bfloat16)
args = [jnp.asarray(x) for x in (q, k, v, pool.page_table, pool.lens)]


def call():
    out, lse = mh.mha_decode_heads(
        *args, max_seqlen_q=q_len, return_lse=True, num_splits=2, persistent=True, num_ctas=3
    )
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


out, lse = run_here(call)
truth, truth_lse = naive.mha_decode(q, k, v, pool.page_table, pool.lens, max_seqlen_q=q_len, is_causal=True)
err = check("mosaic_decode_heads", out, lse, truth, truth_lse, tol=2e-2)
report("mosaic_decode_heads", f"splits=2 ctas=3 max_err={err:.2e}")
