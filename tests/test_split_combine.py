"""The split-KV merge kernel (pallas_kernels/split_combine.py) against a float64 merge."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jattn.pallas_kernels.interpret import on_gpu
from jattn.pallas_kernels.split_combine import combine_splits


def _merge_ref(o, lse, m, sinks, v_scale, hq):
  lse = np.asarray(lse, np.float64)[:, :, :m]
  o = np.asarray(o, np.float64)[:, :, :m]
  mx = lse.max(0)
  mxs = np.where(np.isneginf(mx), 0.0, mx)
  w = np.exp2(lse - mxs)
  ws = w.sum(0)
  empty = ws == 0
  out = (w[..., None] * o).sum(0) / np.where(empty, 1.0, ws)[..., None]
  lse_n = np.where(empty, -np.inf, (mxs + np.log2(np.where(empty, 1.0, ws))) * np.log(2.0))
  if sinks is not None:
    s = np.asarray(sinks, np.float64)[np.arange(m) % hq][None]
    out = out * np.where(empty, 1.0, 1.0 / (1.0 + np.exp(s - lse_n)))[..., None]
  if v_scale is not None:
    out = out * v_scale
  return out, lse_n


@pytest.mark.parametrize("splits,bs,rows,m,d,hq,sinks,v_scale", [
    (2, 3, 32, 32, 128, 32, False, None),
    (33, 2, 16, 9, 64, 9, True, 0.61),     # one past a chunk; rows padded past m
    (132, 1, 32, 32, 128, 32, False, None),  # batch-1 decode on 132 SMs
    (5, 4, 64, 64, 256, 16, True, None),
    (300, 1, 8, 8, 64, 8, True, 2.0),      # more splits than one load round
])
def test_combine_matches_float64(splits, bs, rows, m, d, hq, sinks, v_scale):
  rng = np.random.default_rng(splits)
  o = rng.standard_normal((splits, bs, rows, d)).astype(np.float32)
  lse = (rng.standard_normal((splits, bs, rows)) * 4).astype(np.float32)
  lse[::3, 0] = -np.inf              # empty splits
  lse[:, -1, min(1, m - 1)] = -np.inf  # a row with no keys at all
  o[:, :, m:] = np.nan               # rows past m are never read
  sk = rng.standard_normal(hq).astype(np.float32) * 2 if sinks else None
  out, lse_out = combine_splits(jnp.asarray(o, jnp.bfloat16), jnp.asarray(lse),
                                None if sk is None else jnp.asarray(sk), v_scale,
                                m_rows=m, num_q_heads=hq, out_dtype=jnp.float32,
                                interpret=not on_gpu())
  ref, ref_lse = _merge_ref(jnp.asarray(o, jnp.bfloat16).astype(jnp.float32), lse, m, sk,
                            v_scale, hq)
  out, lse_out = np.asarray(out), np.asarray(lse_out)
  assert out.shape == (bs, m, d) and lse_out.shape == (bs, m)
  assert not np.isnan(out).any()
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(np.isneginf(lse_out), np.isneginf(ref_lse))
  fin = np.isfinite(ref_lse)
  np.testing.assert_allclose(lse_out[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)
  assert np.all(out[-1, min(1, m - 1)] == 0)


def test_combine_rejects_non_power_of_two_head_dim():
  with pytest.raises(ValueError, match="head_dim=96"):
    combine_splits(jnp.zeros((2, 1, 8, 96), jnp.bfloat16), jnp.zeros((2, 1, 8)), None, None,
                   m_rows=8, num_q_heads=8, out_dtype=jnp.bfloat16, interpret=True)
