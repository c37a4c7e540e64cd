"""Pieces shared by the Mosaic GPU (Pallas ``plgpu``) kernels of jattn.

* :func:`plgpu_kernel`: ``plgpu.kernel`` across JAX releases
  (``out_shape=``/``scratch_shapes=`` became ``out_type=``/``scratch_types=``;
  jax 0.10 accepts both, newer releases only the new names).
* :func:`swizzle_transforms`: the tiling + swizzle of a shared-memory tile whose
  rows are ``head_dim`` elements, as TMA and ``wgmma`` want it.
* :func:`cast_layout` / :func:`vec_iota` / :func:`tile_iota` / :func:`load_layout`:
  register layouts that the Mosaic GPU interpreter does not take (CPU tests run the same
  kernel bodies).
* :func:`split_blocks`: a split-KV CTA's range of a request's key blocks.
* :func:`drain_free_barriers`: the end of a producer's K/V ring under the interpreter.

Interpreter setup lives in ``interpret.py``; the split-KV combine in
``combine.py``.
"""

from __future__ import annotations

import inspect

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = [
    "plgpu_kernel",
    "swizzle_transforms",
    "cast_layout",
    "vec_iota",
    "tile_iota",
    "load_layout",
    "split_blocks",
    "drain_free_barriers",
    "check_plan",
]

_KERNEL_PARAMS = inspect.signature(plgpu.kernel).parameters
_OUT_KW = "out_type" if "out_type" in _KERNEL_PARAMS else "out_shape"
# jax 0.10 requires plgpu.load's index argument; later releases deprecate it (index the ref)
_LOAD_IDX = inspect.signature(plgpu.load).parameters.get("idx")
_LOAD_TAKES_IDX = _LOAD_IDX is not None and _LOAD_IDX.default is inspect.Parameter.empty


def fold_softmax_scale(softmax_scale, k_scale):
    """``(softmax_scale, k_scale)`` for a kernel that takes the softmax scale as a static
    Python number: an array (or traced) ``softmax_scale`` is folded into the traced
    ``k_scale`` (both multiply the scores) and the static one becomes 1.0."""
    if softmax_scale is None or isinstance(softmax_scale, (int, float)):
        return softmax_scale, k_scale
    return 1.0, jnp.asarray(k_scale, jnp.float32) * jnp.asarray(softmax_scale, jnp.float32)


def unless_empty_split(store, count, num_splits: int) -> None:
    """Runs ``store`` (a split's output stores) unless there are several splits and this
    one has no key blocks (``count == 0``): the merge reads only an empty split's LSE
    (-inf), never its output; one split's output is final and always written."""
    if num_splits == 1:
        store()
    else:
        pl.when(count > 0)(store)


def plgpu_kernel(body, out, **kwargs):
    """``plgpu.kernel(body, out_type=out, **kwargs)`` under either keyword name."""
    return plgpu.kernel(body, **{_OUT_KW: out}, **kwargs)


def swizzle_transforms(dtype, row_elems: int):
    """Transforms of a shared-memory tile with ``row_elems``-element rows: 8-row
    tiles, swizzled by the row's byte width up to 128 bytes, halved until it divides the
    row (576 e4m3 columns: 64 bytes, as one tile row must not straddle two rows)."""
    itemsize = jnp.dtype(dtype).itemsize
    row_bytes = row_elems * itemsize
    swizzle = min(128, row_bytes)
    while row_bytes % swizzle:
        swizzle //= 2
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def cast_layout(x, layout, *, interpret: bool):
    """``plgpu.layout_cast(x, layout)``; ``x`` itself under the interpreter."""
    return x if interpret else plgpu.layout_cast(x, layout)


def load_layout(ref, layout, *, interpret: bool, optimized: bool = False):
    """The whole of ``ref`` (shared memory) as a register value in ``layout``, by the
    unoptimised load path (any layout), or with ``optimized`` a transfer plan free of bank
    conflicts (Mosaic GPU refuses the load where it finds none); ``ref[...]`` under the
    interpreter."""
    if interpret:
        return ref[...]
    if _LOAD_TAKES_IDX:
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


def vec_iota(size: int, dim: int, *, interpret: bool):
    """i32 indices ``0..size-1`` of one axis of a WGMMA-layout tile: the rows
    (``dim=0``) or the columns (``dim=1``), in the reduced layout that broadcasts
    to the tile by reusing registers, so per-row and per-column work is done once
    per row or column, not per element.

    ``vec_iota(n, 0)`` and ``vec_iota(n, 1)`` are the same op before their layout
    casts: where one dominates the other, CSE merges them ahead of Mosaic GPU's layout
    inference, which then has one value cast to two layouts and fails. In one scope
    use at most one of the two per size (or a 2-D iota for the other)."""
    if interpret:
        return lax.broadcasted_iota(jnp.int32, (size,), 0)
    layout = plgpu.Layout.WGMMA.reduce(1 - dim)
    return plgpu.broadcasted_iota(jnp.int32, (size,), 0, layout=layout)


def tile_iota(shape, dim: int, *, interpret: bool):
    """i32 indices along ``dim`` of a 2-D tile of ``shape`` in the WGMMA layout (plain
    under the interpreter). Two of one shape and dim are one op to CSE: give them one layout."""
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def split_blocks(seq_len, block: int, num_splits: int, split, per=None):
    """``(first block, block count)`` of split ``split`` when a request of ``seq_len`` keys
    in blocks of ``block`` is cut into ``num_splits`` ranges of ``ceil(blocks / num_splits)``
    blocks (the last ones short or empty), or, with ``per`` (a traced split size shared
    by every request, at least ``ceil(blocks / num_splits)``), into ranges of ``per``
    blocks."""
    nblk = lax.div(seq_len + block - 1, jnp.int32(block))
    if per is None:
        per = lax.div(nblk + num_splits - 1, jnp.int32(num_splits))
    lo = jnp.minimum(split * per, nblk)
    return lo, jnp.minimum(lo + per, nblk) - lo


def drain_free_barriers(count, num_stages: int, *free_barriers) -> None:
    """Producer side, after its loop over ``count`` ring steps: wait on the last
    ``min(count, num_stages)`` phases of each slot's "free" barriers. The Mosaic GPU
    interpreter requires every barrier phase to be observed (on the GPU nothing needs
    these waits), so CTAs with more blocks than ring stages run interpreted too."""
    for j in range(num_stages):

        @pl.when(count > j)
        def _():
            last = lax.rem(count - 1 - j, jnp.int32(num_stages))
            for bar in free_barriers:
                plgpu.barrier_wait(bar.at[last])


def check_plan(q, page_table, cache_seqlens, max_seqlen_q: int) -> None:
    """The page table and lengths must describe ``q``'s batch (``rows / max_seqlen_q``)."""
    batch = q.shape[0] // max(1, max_seqlen_q)
    if page_table.ndim != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table shape {page_table.shape} != (bs={batch}, max_pages)")
    if cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens shape {cache_seqlens.shape} != ({batch},)")


def empty_outputs(q, width: int, dtype, return_lse: bool):
    """The result of a call with no requests, query rows or heads: zero output rows of ``width``
    in ``dtype`` and, with ``return_lse``, an LSE of -inf; no kernel is launched."""
    out = jnp.zeros((q.shape[0], q.shape[1], width), dtype)
    return (out, jnp.full(q.shape[:2], -jnp.inf, jnp.float32)) if return_lse else out
