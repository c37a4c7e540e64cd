"""Probe (not a test): GPU time per call of the per-KV-head kernel's FP8 paths, called
directly (``mosaic_decode_heads.mha_decode_heads`` with each variant's arguments), beside the
routed bf16 decode, at 64 x 4096 and 1 x 32768 (32/8 heads, d128, page 16).

    python scripts/sweep_fp8_q8.py 1,2,8                       # query lengths, on the GPU
    VARIANTS=default,v_regs python scripts/sweep_fp8_q8.py 8   # variants whose names start so
"""

import functools
import os
import sys

import jax.numpy as jnp
import numpy as np

from jattn.bench import decode as bd
from jattn.pallas_kernels import mosaic_decode as md
from jattn.pallas_kernels import mosaic_decode_heads as mh

shapes = [(64, 4096), (1, 32768)]
qls = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "8").split(",")]
rng = np.random.default_rng(0)
variants = {
    "default(fp8_qk,f16 V tile,b64)": dict(fp8_qk=True, v_regs=False, block=64),
    "v_regs(b64)": dict(fp8_qk=True, v_regs=True, block=64),
    "overlap": dict(fp8_qk=True, v_regs=True, block=64, overlap=True),
    "row_tile16": dict(fp8_qk=True, v_regs=True, block=64, row_tile=16),
    "row_tile32": dict(fp8_qk=True, v_regs=True, block=64, row_tile=32),
    "exact-q (fp8_qk=False)": dict(fp8_qk=False),
    "block128": dict(fp8_qk=True, v_regs=True, block=128),
}
keep = os.environ.get("VARIANTS")
if keep:
    variants = {n: kw for n, kw in variants.items() if any(n.startswith(x) for x in keep.split(","))}
for bs, L in shapes:
    for ql in qls:
        for kvd in (jnp.bfloat16, jnp.float8_e4m3fn):
            n_hi = 12 if bs > 1 else 48
            qs, k, v, tables, lens, kv_bytes = bd._setup(bs, L, 16, ql, kvd, rng, n_hi)
            ks = 0.5 if kvd == jnp.float8_e4m3fn else 1.0
            if kvd == jnp.bfloat16:
                got, err = bd._time_decode(md.mha_decode, (qs, k, v, tables, lens), n_hi, ql, ks)
                print(f"{bs}x{L} q{ql} bf16 md.mha_decode: {err or f'{got * 1e6:.1f} us'}", flush=True)
                continue
            for name, kw in variants.items():
                fn = functools.partial(mh.mha_decode_heads, **kw)
                got, err = bd._time_decode(fn, (qs, k, v, tables, lens), n_hi, ql, ks)
                print(f"{bs}x{L} q{ql} fp8 {name}: {err[:150] if err else f'{got * 1e6:.1f} us'}", flush=True)
            del qs, k, v
