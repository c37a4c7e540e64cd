"""Probe (not a test): compile and run each Mosaic GPU decode kernel once at 64 x 4096
(32/8 heads, d128, page 64), or with ``--prefill`` the prefill kernel at each head width with
and without ``PrefillOptions(overlap_pv=True)``, or with ``--mla`` the MLA decode kernel
(16 heads, bf16 and FP8 latent cache), so that ``MOSAIC_GPU_DUMP_PTXAS=1`` prints
ptxas's register and shared-memory use per kernel, and ``ncu --metrics launch__*`` can read
the occupancy.

    MOSAIC_GPU_DUMP_PTXAS=1 python scripts/probe_regs.py [--prefill | --mla] 2>&1 | grep -E "==|Used|spill"
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from jattn.pallas_kernels import mosaic_decode as md
from jattn.pallas_kernels import mosaic_decode_heads as mh
from jattn.pallas_kernels import mosaic_prefill as mp


def prefill() -> None:
    rng = np.random.default_rng(0)
    cu = jnp.array([0, 1000, 2048], jnp.int32)
    for d, dv, hq, hkv in ((64, 64, 32, 8), (128, 128, 32, 8), (192, 128, 16, 16), (256, 256, 16, 4)):
        q = jnp.asarray(rng.standard_normal((2048, hq, d)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((2048, hkv, d)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((2048, hkv, dv)), jnp.bfloat16)
        for overlap in (False, True):
            print(f"== prefill d{d}/{dv} overlap_pv={overlap}", flush=True)
            opts = mp.PrefillOptions(overlap_pv=overlap)
            jax.block_until_ready(mp.mha_prefill(q, k, v, cu, is_causal=True, options=opts))


def mla() -> None:
    from jattn.pallas_kernels import mosaic_mla as mm

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((64, 16, 576)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((64 * 64, 64, 576)), jnp.bfloat16)
    table = jnp.arange(64 * 64, dtype=jnp.int32).reshape(64, 64)
    lens = jnp.full((64,), 4096, jnp.int32)
    for dt in (jnp.bfloat16, jnp.float8_e4m3fn):
        print(f"== mla decode {jnp.dtype(dt).name}", flush=True)
        jax.block_until_ready(mm.mla_decode(q, kv.astype(dt), table, lens, kv_lora_rank=512, softmax_scale=0.07))


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
    if "--mla" in sys.argv[1:]:
        mla()
    else:
        prefill() if "--prefill" in sys.argv[1:] else main()
