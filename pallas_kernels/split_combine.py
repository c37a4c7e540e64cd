"""Merge of split-KV partial attention outputs in one kernel (Pallas, Triton lowering).

A split-KV decode kernel leaves, per (split, request, query row), an output
normalised over its split's keys and that split's log-sum-exp (base 2). The merge
is a softmax over the splits' LSEs weighting their outputs. As XLA ops it was five
kernels (max, exp, two reductions, the final scale); at batch 1 every kernel is a
launch that costs as much as the decode itself, so it is one kernel here: one
program per (request, query row, column block) that loads all splits at once
(chunks merged online past 256 splits), sinks and ``v_scale`` applied before the
single store.

Any number of splits (chunks are masked); head_dim a power of two (Triton). Under
``interpret=True`` (CPU tests) the same kernel runs in the Pallas interpreter.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["combine_splits"]

_ELEMS = 8192    # partial-output elements one program loads per round (64 per thread)
_MIN_COLS = 32   # narrowest column block
_LN2 = math.log(2.0)


def _kernel(lse_ref, o_ref, sink_ref, vs_ref, out_ref, lse_out_ref, *, num_splits: int,
            chunk: int, has_sinks: bool, has_vscale: bool):
  # lse_ref [S] f32 (log2), o_ref [S, Dc]: one (request, row, column block) per program.
  m = l = acc = None
  cols = jnp.arange(o_ref.shape[-1])
  for c0 in range(0, num_splits, chunk):
    idx = c0 + jnp.arange(chunk)
    ok = idx < num_splits
    lse = pltriton.load(lse_ref.at[idx], mask=ok, other=-jnp.inf)           # [C]
    o = pltriton.load(o_ref.at[idx[:, None], cols[None, :]], mask=ok[:, None],
                      other=0.0).astype(jnp.float32)                         # [C, Dc]
    cm = jnp.max(lse)
    m_new = cm if m is None else jnp.maximum(m, cm)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    w = jnp.exp2(lse - m_use)                                                # 0: empty split
    part_l = jnp.sum(w)
    part_acc = jnp.sum(w[:, None] * o, axis=0)                               # [Dc]
    if m is None:
      l, acc = part_l, part_acc
    else:
      alpha = jnp.exp2(m - m_use)
      l = l * alpha + part_l
      acc = acc * alpha + part_acc
    m = m_new
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  m_safe = jnp.where(empty, 0.0, m)
  lse_nat = jnp.where(empty, -jnp.inf, (m_safe + jnp.log2(l_safe)) * _LN2)
  factor = jnp.where(empty, 0.0, 1.0 / l_safe)
  if has_sinks:
    sink = sink_ref[...].astype(jnp.float32)
    factor = factor * jnp.where(empty, 1.0, 1.0 / (1.0 + jnp.exp(sink - lse_nat)))
  if has_vscale:
    factor = factor * vs_ref[...].astype(jnp.float32)
  out_ref[...] = (acc * factor).astype(out_ref.dtype)
  lse_out_ref[...] = lse_nat


@functools.partial(jax.jit, static_argnames=("m_rows", "num_q_heads", "out_dtype", "interpret"))
def combine_splits(o_part, lse_part, sinks, v_scale, *, m_rows: int, num_q_heads: int,
                   out_dtype, interpret: bool = False):
  """Merge split partials.

  Args:
    o_part: ``[S, bs, rows, D]`` partial outputs, each normalised over its split
      (rows >= m_rows; the extra rows are ignored).
    lse_part: f32 ``[S, bs, rows']`` (rows' >= m_rows), base-2 LSE of each split,
      -inf for a split with no keys.
    sinks: None or f32 ``[num_q_heads]``; row r's head is ``r % num_q_heads``.
    v_scale: None (1.0) or an f32 scalar.

  Returns:
    ``(o [bs, m_rows, D] out_dtype, lse f32 [bs, m_rows] natural log)``; a row whose
    splits are all empty gives 0 and -inf.
  """
  num_splits, bs, _, d = o_part.shape
  if d & (d - 1):
    raise ValueError(f"head_dim={d} must be a power of two for the split combine")
  s_pad = 1 << max(0, (num_splits - 1).bit_length())
  # One load round when the splits fit: a program takes all splits of a column
  # block (at most _ELEMS elements); columns are split across programs instead
  # (batch 1 on 132 splits: 4 programs per row, each [256, 32], one round).
  chunk = min(s_pad, _ELEMS // _MIN_COLS)
  dc = max(_MIN_COLS, min(d, _ELEMS // chunk))
  has_sinks, has_vscale = sinks is not None, v_scale is not None
  # Absent sinks / v_scale are numpy constants: an array built in the graph
  # would be one more kernel launch per call.
  sinks = (np.zeros((num_q_heads,), np.float32) if sinks is None
           else sinks.astype(jnp.float32))
  v_scale = (np.ones((1,), np.float32) if v_scale is None
             else jnp.reshape(jnp.asarray(v_scale, jnp.float32), (1,)))
  kernel = functools.partial(_kernel, num_splits=num_splits, chunk=chunk,
                             has_sinks=has_sinks, has_vscale=has_vscale)
  from jattn.pallas_kernels.interpret import outside_gpu_interpret
  with outside_gpu_interpret():
    return _call(kernel, bs, m_rows, d, dc, num_splits, num_q_heads, out_dtype, interpret,
                 lse_part, o_part, sinks, v_scale)


def _call(kernel, bs, m_rows, d, dc, num_splits, num_q_heads, out_dtype, interpret, *args):
  return pl.pallas_call(
      kernel,
      grid=(bs, m_rows, d // dc),
      in_specs=[
          pl.BlockSpec((num_splits, None, None), lambda b, r, c: (0, b, r)),
          pl.BlockSpec((num_splits, None, None, dc), lambda b, r, c: (0, b, r, c)),
          pl.BlockSpec((None,), lambda b, r, c: (r % num_q_heads,)),
          pl.BlockSpec((None,), lambda b, r, c: (0,)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, dc), lambda b, r, c: (b, r, c)),
          pl.BlockSpec((None, None), lambda b, r, c: (b, r)),
      ],
      out_shape=[jax.ShapeDtypeStruct((bs, m_rows, d), out_dtype),
                 jax.ShapeDtypeStruct((bs, m_rows), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="jattn_split_combine",
  )(*args)
