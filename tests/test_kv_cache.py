"""The paged caches' layer access and construction (``jattn.kv_cache``) and the page
allocator's arguments: what a stacked pool's indexing would clamp, its update drop or
broadcast, or ``int()`` truncate, is refused with a message naming the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import MLAKVCache, PageAllocator, PagedKVCache
from jattn.kv_cache import cache_dtype

SHAPE = dict(num_pages=4, page_size=4, num_kv_heads=1, head_dim=8, dtype="float32")


@pytest.mark.parametrize("stacked", [False, True])
def test_layer_index_is_checked(stacked):
    """A stacked pool clamped ``layer(5)`` to the last layer and dropped ``replace_layer(5)``."""
    cache = PagedKVCache.create(num_layers=2, stacked=stacked, **SHAPE)
    k = jnp.ones((4, 4, 1, 8))
    for i in (2, 5, -1, 1.0, True):
        with pytest.raises(ValueError, match=rf"layer {i!r} is out of range: the PagedKVCache holds layers \[0, 2\)"):
            cache.layer(i)
        with pytest.raises(ValueError, match=rf"layer {i!r} is out of range"):
            cache.replace_layer(i, k, k)
    new = cache.replace_layer(np.int64(1), k, 2 * k)
    np.testing.assert_array_equal(new.layer(1)[1], 2 * k)
    np.testing.assert_array_equal(new.layer(0)[0], 0 * k)
    mla = MLAKVCache.create(num_layers=1, num_pages=4, page_size=4, kv_lora_rank=8, rope_dim=4, stacked=stacked)
    with pytest.raises(ValueError, match=r"layer 1 is out of range: the MLAKVCache holds layers \[0, 1\)"):
        mla.layer(1)


@pytest.mark.parametrize("stacked", [False, True])
def test_replace_layer_needs_the_layers_shape_and_dtype(stacked):
    """A stacked pool's update broadcast a [page_size, H, D] array over every page and cast
    a bf16 one; a per-layer cache took either as the layer's new pool."""
    cache = PagedKVCache.create(num_layers=2, stacked=stacked, **SHAPE)
    k = jnp.ones((4, 4, 1, 8))
    with pytest.raises(ValueError, match=r"k: layer 0's new pool is float32\[4, 1, 8\]; it must be the cache's "):
        cache.replace_layer(0, k[0], k)
    with pytest.raises(
        ValueError, match=r"v: layer 1's new pool is bfloat16\[4, 4, 1, 8\]; it must be the cache's float32\["
    ):
        cache.replace_layer(1, k, k.astype(jnp.bfloat16))
    mla = MLAKVCache.create(num_layers=2, num_pages=4, page_size=4, kv_lora_rank=8, rope_dim=4, stacked=stacked)
    with pytest.raises(
        ValueError, match=r"kv: layer 1's new pool is bfloat16\[4, 4, 11\]; it must be the cache's bfloat16\[4, 4, 12\]"
    ):
        mla.replace_layer(1, jnp.zeros((4, 4, 11), jnp.bfloat16))
    # under jit the shapes are static: the same check, and a right update goes through
    out = jax.jit(lambda c, a: c.replace_layer(1, a, a))(cache, k)
    np.testing.assert_array_equal(out.layer(1)[0], k)


def test_unflat_needs_the_flat_views_shape():
    """A flat pool of the same size but another layout was reshaped into the cache silently."""
    cache = PagedKVCache.create(num_layers=2, stacked=True, **SHAPE)
    other = PagedKVCache.create(num_layers=1, num_pages=4, page_size=8, num_kv_heads=1, head_dim=8, dtype="float32")
    with pytest.raises(
        ValueError, match=r"flat.k has shape \(4, 8, 1, 8\); the flat view of this cache is \(8, 4, 1, 8\)"
    ):
        cache.unflat(other)
    fp8 = PagedKVCache.create(num_layers=2, stacked=True, **{**SHAPE, "dtype": "float8_e4m3fn"})
    with pytest.raises(ValueError, match=r"flat.k is float32; this cache's k is float8_e4m3fn"):
        fp8.unflat(cache.flat())  # same shape, another dtype: was an f32 cache silently
    rng = np.random.default_rng(0)
    full = PagedKVCache(
        k=tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in cache.k),
        v=tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in cache.v),
        stacked=True,
    )
    flat = full.flat()
    pages = full.k[0].shape[1]
    for layer in range(2):  # layer-major pages: layer i's page p is flat page i * pages + p
        np.testing.assert_array_equal(flat.k[0][layer * pages : (layer + 1) * pages], full.k[0][layer])
        np.testing.assert_array_equal(flat.v[0][layer * pages : (layer + 1) * pages], full.v[0][layer])
    back = full.unflat(flat)
    for a, b in zip(back.k + back.v, full.k + full.v):
        np.testing.assert_array_equal(a, b)


def test_create_and_dtype_arguments():
    for kw, msg in (
        (dict(page_size=0), "page_size=0 must be a positive int"),
        (dict(num_layers=0), "num_layers=0 must be a positive int"),
        (dict(head_dim=-8), "head_dim=-8 must be a positive int"),
        (dict(head_dim_v=0), "head_dim_v=0 must be a positive int"),
        (dict(num_kv_heads=1.5), "num_kv_heads=1.5 must be a positive int"),
        (dict(num_pages=2.5), r"num_pages=2.5 must be >= 2 \(an int; page 0 is reserved\)"),
        (dict(dtype="nonsense"), "kv cache dtype=nonsense must be one of"),
    ):
        with pytest.raises(ValueError, match=msg):
            PagedKVCache.create(**{"num_layers": 1, **SHAPE, **kw})
    with pytest.raises(ValueError, match="rope_dim=0 must be a positive int"):
        MLAKVCache.create(num_layers=1, num_pages=4, page_size=4, rope_dim=0)
    with pytest.raises(ValueError, match="kv cache dtype=None must be one of"):  # was float64
        cache_dtype(None)
    assert PagedKVCache.create(num_layers=np.int64(1), **SHAPE).num_layers == 1


def test_page_allocator_arguments():
    """``free([2.7])`` freed page 2 (``int()``), ``alloc(True)`` took a page."""
    alloc = PageAllocator(np.int64(6))
    pages = alloc.alloc(np.int32(3))
    for bad in (2.7, "3", None):
        with pytest.raises(ValueError, match=rf"page {bad!r} is not a page id \(an int\)"):
            alloc.free([bad])
    assert alloc.num_free == 2
    for n in (True, 1.5, -1):
        with pytest.raises(ValueError, match=rf"cannot allocate n={n!r} pages \(an int >= 0\)"):
            alloc.alloc(n)
    alloc.free(np.asarray(pages))
    assert alloc.num_free == 5 and all(type(p) is int for p in alloc.alloc(5))
    for bad in (3.5, "8"):
        with pytest.raises(ValueError, match=rf"num_pages={bad!r} must be >= 2"):
            PageAllocator(bad)
    with pytest.raises(ValueError, match="page_size=0 must be a positive int"):
        PageAllocator.pages_for(10, 0)
    with pytest.raises(ValueError, match="num_tokens=-5 must be an int >= 0"):
        PageAllocator.pages_for(-5, 4)
    assert PageAllocator.pages_for(np.int64(33), 16) == 3
