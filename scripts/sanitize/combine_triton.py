"""The split-KV combine kernel (Triton through jax-triton) alone: 300 splits (two chunks of
256, merged online), column blocks narrower than head_dim, sinks and v_scale, padded rows
(NaN, never read), empty splits and one row with no keys; f16 partial outputs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from common import report

from jattn.pallas_kernels import combine, triton_glue
from jattn.pallas_kernels.interpret import on_gpu

if not on_gpu() or not triton_glue.available():
    print("skip combine_triton: needs a GPU with jax-triton")
    raise SystemExit(0)
splits, bs, rows, hq, q_len, d = 300, 2, 16, 4, 2, 64
m = hq * q_len
rng = np.random.default_rng(0)
o = rng.standard_normal((splits, bs, rows, d)).astype(np.float16)
lse = (rng.standard_normal((splits, bs, rows)) * 4).astype(np.float32)
lse[::3] = -np.inf  # empty splits
lse[:, 1, 3] = -np.inf  # a row with no keys
o[:, :, m:] = np.nan
sinks = (rng.standard_normal(hq) * 2).astype(np.float32)
v_scale = 0.61
f = jax.jit(
    lambda o, lse, s: combine._combine_triton(
        o, lse, s, v_scale, m_rows=m, num_q_heads=hq, out_dtype=jnp.dtype(jnp.float32)
    )
)
out, lse_out = (np.asarray(x) for x in f(jnp.asarray(o), jnp.asarray(lse), jnp.asarray(sinks)))
# float64 merge (base-2 LSE in, natural-log out), then sinks and v_scale
l64, o64 = lse[:, :, :m].astype(np.float64), o[:, :, :m].astype(np.float64)
mx = l64.max(0)
mxs = np.where(np.isneginf(mx), 0.0, mx)
w = np.exp2(l64 - mxs)
ws = w.sum(0)
empty = ws == 0
ref = (w[..., None] * o64).sum(0) / np.where(empty, 1.0, ws)[..., None]
ref_lse = np.where(empty, -np.inf, (mxs + np.log2(np.where(empty, 1.0, ws))) * math.log(2.0))
ref = ref * np.where(empty, 1.0, 1.0 / (1.0 + np.exp(sinks[np.arange(m) % hq][None] - ref_lse)))[..., None] * v_scale
err = float(np.abs(out - ref).max())
assert not np.isnan(out).any() and err < 1e-4, err
assert np.array_equal(np.isneginf(lse_out), np.isneginf(ref_lse))
report("combine_triton", f"splits={splits} max_err={err:.2e}")
