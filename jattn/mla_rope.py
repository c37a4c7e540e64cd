"""The MLA query and key preparation that SGLang's TRT-LLM MLA backend fuses into one
kernel: the rope of ``q_pe`` / ``k_pe`` from a ``cos_sin_cache`` and, where the latent
cache is FP8, the quantisation of the absorbed query. Plain JAX: inside the jitted
step XLA fuses the gather of the cos/sin rows, the rotation, the concatenation and
the cast into the ops around them.

Conventions (docs/SEMANTICS.md, "Fused rope and the FP8 query"):

* ``cos_sin_cache`` is ``[max_position, r]``: row ``p`` holds ``cos(p * f_i)`` in
  columns ``[0, r/2)`` and ``sin(p * f_i)`` in ``[r/2, r)`` (the layout of FlashInfer's
  and SGLang's rotary caches). ``r`` is the rope width ``qk_rope_head_dim``.
* ``is_neox=False`` (the default, DeepSeek's layout) rotates interleaved pairs
  ``(2i, 2i + 1)`` by angle ``i``; ``is_neox=True`` rotates ``(i, i + r/2)``.
* Each token is rotated by its absolute position: the plan's ``positions``
  (``L - n + i`` for query ``i`` of a request with ``L`` keys and ``n`` new tokens)
  unless the caller passes its own.
* The rotation is computed in f32. With an FP8 cache the absorbed query
  ``[q_nope, rope(q_pe)]`` is quantised with scale 1: ``clamp(q, -448, 448)`` cast to
  e4m3 (``llama_4_scaling``, if given, multiplies the quantised query in f32, which
  is quantised again), then handed to the attention op as those exact values in the
  query's dtype.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jattn.checks import _is_int
from jattn.reference import FP8_E4M3_MAX, round_to_e4m3

__all__ = ["MLARope", "apply_rope", "quantize_query_fp8"]


def _check_cache(cos_sin_cache, rope_dim: int) -> None:
    shape = getattr(cos_sin_cache, "shape", None)
    if shape is None or len(shape) != 2:
        raise ValueError(f"cos_sin_cache must be 2-D [max_position, rope_dim], got shape {shape}")
    if shape[1] != rope_dim or rope_dim % 2:
        raise ValueError(
            f"cos_sin_cache is {shape[1]} wide; it must equal the (even) rope width {rope_dim} "
            "(cos in the first half, sin in the second)"
        )
    dtype = getattr(cos_sin_cache, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"cos_sin_cache.dtype={dtype} must be a float type (cos and sin values)")
    if shape[0] == 0:  # no row to clamp a position to
        raise ValueError(f"cos_sin_cache has no rows (shape {tuple(shape)}); it needs one per position")


def _check_rope_dim(x, rope_dim) -> None:
    """``rope_dim`` names the last columns of ``x`` (``x[..., -0:]`` would be all of them)."""
    if not _is_int(rope_dim) or not 0 < rope_dim <= x.shape[-1]:
        raise ValueError(f"rope_dim={rope_dim!r} must be an int in [1, {x.shape[-1]}] (the last columns of x)")


def apply_rope(x, positions, cos_sin_cache, *, is_neox: bool = False):
    """``x`` ``[T, ..., r]`` rotated by each token's position; returns f32.

    ``positions`` int[T] (clamped to the cache's rows: below 0 to row 0, past the end to
    the last row, compared in their own integer type), ``cos_sin_cache``
    ``[max_position, r]`` (cos then sin). ``is_neox`` picks the pairing: ``(i, i + r/2)``
    if True, interleaved ``(2i, 2i + 1)`` if False.
    """
    if jnp.ndim(x) < 2:
        raise ValueError(f"x must be [tokens, ..., rope_dim], got shape {jnp.shape(x)}")
    r = x.shape[-1]
    _check_cache(cos_sin_cache, r)
    n = cos_sin_cache.shape[0]
    if isinstance(positions, (np.ndarray, list, tuple, int, np.integer)):
        host = np.asarray(positions)  # clamped here: jnp.asarray would wrap int64 without x64
        if np.issubdtype(host.dtype, np.integer):
            positions = np.clip(host, 0, n - 1).astype(np.int32)
    positions = jnp.asarray(positions)
    if positions.shape != (x.shape[0],):
        raise ValueError(f"positions has shape {positions.shape}; it must be [{x.shape[0]}] (one per token)")
    if not jnp.issubdtype(positions.dtype, jnp.integer):  # the cast to int32 would truncate
        raise TypeError(f"positions.dtype={positions.dtype} must be an integer type (token positions)")
    if jnp.dtype(positions.dtype).itemsize < 4:  # n - 1 may not fit int8 / int16: compare in int32
        positions = positions.astype(jnp.int32)
    cs = jnp.asarray(cos_sin_cache)[jnp.clip(positions, 0, n - 1).astype(jnp.int32)]
    cs = cs.astype(jnp.float32).reshape((x.shape[0],) + (1,) * (x.ndim - 2) + (r,))
    cos, sin = cs[..., : r // 2], cs[..., r // 2 :]
    xf = x.astype(jnp.float32)
    if is_neox:
        x1, x2 = xf[..., : r // 2], xf[..., r // 2 :]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xf.shape)


def quantize_query_fp8(query, scale=1.0):
    """``clamp(query * scale, -448, 448)`` cast to float8_e4m3fn (the quantisation of
    SGLang's FP8 MLA query: scale 1, saturating). NaN stays NaN."""
    y = query.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)
    return round_to_e4m3(jnp.clip(y, -FP8_E4M3_MAX, FP8_E4M3_MAX)).astype(jnp.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class MLARope:
    """One step's fused query / key preparation (built by the MLA backend per call).

    ``positions`` i32[T] (one per query row, ragged order), ``cos_sin_cache``
    ``[max_position, r]``, ``is_neox`` the pairing, ``fp8`` whether the latent cache
    is FP8 (the query is then quantised)."""

    positions: object
    cos_sin_cache: object
    is_neox: bool = False
    fp8: bool = False

    @classmethod
    def for_plan(cls, metadata, cos_sin_cache, is_neox, positions, fp8: bool):
        """The rope of one step (None without ``cos_sin_cache``): at ``positions``, else
        the plan's (``metadata`` None: a call with no plan, which must pass ``positions``)."""
        if cos_sin_cache is None:
            return None
        pos = getattr(metadata, "positions", None) if positions is None else positions
        if pos is None:
            where = "this call has no plan" if metadata is None else "the plan has none (a slimmed plan)"
            raise ValueError(f"cos_sin_cache needs positions: {where}; pass positions= (i32[T])")
        return cls(pos, cos_sin_cache, bool(is_neox), fp8)

    def key(self, k_pe):
        """``k_pe`` ``[T, r]`` (or ``[T, 1, r]``) rotated, f32; None stays None. The write
        into the latent cache quantises it (``set_mla_kv_buffer``)."""
        if k_pe is None:
            return None
        if not (k_pe.ndim == 2 or (k_pe.ndim == 3 and k_pe.shape[1] == 1)):
            raise ValueError(f"k_pe must be [tokens, rope_dim] or [tokens, 1, rope_dim], got shape {tuple(k_pe.shape)}")
        return apply_rope(
            k_pe.reshape(k_pe.shape[0], k_pe.shape[-1]), self.positions, self.cos_sin_cache, is_neox=self.is_neox
        )

    def rotate_tail(self, x, rope_dim: int):
        """``x`` ``[T, ..., D]`` with its last ``rope_dim`` columns rotated, in ``x``'s dtype."""
        _check_rope_dim(x, rope_dim)
        rot = apply_rope(x[..., -rope_dim:], self.positions, self.cos_sin_cache, is_neox=self.is_neox)
        return jnp.concatenate([x[..., :-rope_dim], rot.astype(x.dtype)], axis=-1)

    def query(self, query, rope_dim: int, llama_4_scaling=None):
        """The absorbed query ``[T, H, R + r]`` (rope not yet applied to its last ``r``
        columns) prepared for the attention: rotated; with an FP8 cache quantised (and
        ``llama_4_scaling`` applied to the quantised values, quantised again), returned
        as those values in ``query``'s dtype (exact: e4m3 values are bf16/fp16/f32 values)."""
        from jattn.backends import apply_llama_4_scaling  # the one scaling rule

        _check_rope_dim(query, rope_dim)
        rot = apply_rope(query[..., -rope_dim:], self.positions, self.cos_sin_cache, is_neox=self.is_neox)
        if not self.fp8:
            q = jnp.concatenate([query[..., :-rope_dim], rot.astype(query.dtype)], axis=-1)
            return apply_llama_4_scaling(q, llama_4_scaling)
        q8 = quantize_query_fp8(jnp.concatenate([query[..., :-rope_dim].astype(jnp.float32), rot], axis=-1))
        if llama_4_scaling is not None:
            q8 = quantize_query_fp8(apply_llama_4_scaling(q8.astype(jnp.float32), llama_4_scaling))
        return q8.astype(query.dtype)
