"""Probe (not a test): compile and run each Mosaic GPU decode kernel once at 64 x 4096
(32/8 heads, d128, page 64) so that ``MOSAIC_GPU_DUMP_PTXAS=1`` prints ptxas's register and
shared-memory use per kernel, and ``ncu --metrics launch__*`` can read the occupancy.

    MOSAIC_GPU_DUMP_PTXAS=1 python scripts/probe_regs.py 2>&1 | grep -E "Compiling|Used|spill"
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jattn.pallas_kernels import mosaic_decode as md
from jattn.pallas_kernels import mosaic_decode_heads as mh


def main() -> None:
    bs, length, hq, hkv, d, ps = 64, 4096, 32, 8, 128, 64
    rng = np.random.default_rng(0)
    pages = bs * length // ps
    k = jnp.asarray(rng.standard_normal((pages, ps, hkv, d)), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(pages).reshape(bs, -1), jnp.int32)
    lens = jnp.full((bs,), length, jnp.int32)
    opts = md.KernelOptions(heads_kernel=False)
    for q_len in (1, 4, 8):
        q = jnp.asarray(rng.standard_normal((bs * q_len, hq, d)), jnp.bfloat16)
        print(f"== all-heads kernel q_len {q_len}", flush=True)
        jax.block_until_ready(md.mha_decode(q, k, k, table, lens, max_seqlen_q=q_len, options=opts))
        print(f"== per-KV-head kernel q_len {q_len}", flush=True)
        jax.block_until_ready(mh.mha_decode_heads(q, k, k, table, lens, max_seqlen_q=q_len))


if __name__ == "__main__":
    main()
