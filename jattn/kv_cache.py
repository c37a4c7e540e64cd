"""Paged KV caches (pytrees of per-layer pools) and the host-side page allocator."""

from __future__ import annotations

import dataclasses
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jattn.checks import _check_bool, _is_int
from jattn.metadata import DUMMY_PAGE
from jattn.plan_inputs import _positive_int

_DTYPES = {
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
    "fp16": jnp.float16,
    "float32": jnp.float32,
    "fp8": jnp.float8_e4m3fn,
    "float8_e4m3fn": jnp.float8_e4m3fn,
}
_ALLOWED = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn)


def cache_dtype(dtype) -> jnp.dtype:
    """Normalises a KV-cache dtype (bf16, fp16, f32 or FP8 e4m3)."""
    d = _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    try:
        d = jnp.dtype(d) if d is not None else None  # jnp.dtype(None) would be float64
    except TypeError:
        d = None
    if d is None or d not in [jnp.dtype(a) for a in _ALLOWED]:
        raise ValueError(f"kv cache dtype={dtype if d is None else d} must be one of bf16, fp16, f32, float8_e4m3fn")
    return d


def _num_pages(num_pages) -> int:
    """A pool's page count (:class:`PageAllocator`, the caches' ``create``)."""
    if not _is_int(num_pages) or num_pages < 2:
        raise ValueError(f"num_pages={num_pages!r} must be >= 2 (an int; page {DUMMY_PAGE} is reserved)")
    return int(num_pages)


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn)


def _sizes(**sizes) -> tuple:
    """The pool dimensions given to ``create``, each a positive int (a message naming the
    first that is not, instead of an error from ``jnp.zeros`` or an empty cache)."""
    return tuple(_positive_int(v, k) for k, v in sizes.items())


class _Pools:
    """What the MHA and MLA caches share: per-layer pools, the tuple fields named by
    ``_POOLS``, each one array per layer or (``stacked``) one array of all layers."""

    _POOLS: tuple = ()

    def _first(self):
        return getattr(self, self._POOLS[0])

    @property
    def num_layers(self) -> int:
        return self._first()[0].shape[0] if self.stacked else len(self._first())

    @property
    def num_pages(self) -> int:
        return self._first()[0].shape[int(self.stacked)]

    @property
    def page_size(self) -> int:
        return self._first()[0].shape[1 + int(self.stacked)]

    @property
    def dtype(self):
        return self._first()[0].dtype

    def _index(self, i) -> int:
        """A layer index in ``[0, num_layers)`` (a stacked pool's indexing would clamp a
        larger one, and its update drop it, silently)."""
        if not _is_int(i) or not 0 <= i < self.num_layers:
            raise ValueError(
                f"layer {i!r} is out of range: the {type(self).__name__} holds layers [0, {self.num_layers})"
            )
        return int(i)

    def _layer(self, i: int) -> tuple:
        i = self._index(i)
        return tuple(getattr(self, n)[0][i] if self.stacked else getattr(self, n)[i] for n in self._POOLS)

    def _replace_layer(self, i: int, arrays):
        """A new cache with layer ``i``'s pools replaced by arrays of their shape and dtype
        (a stacked pool's update would broadcast a smaller array and cast another dtype)."""
        i = self._index(i)
        new = {}
        for n, a in zip(self._POOLS, arrays):
            pools = getattr(self, n)
            ref = pools[0] if self.stacked else pools[i]
            want = ref.shape[1:] if self.stacked else ref.shape
            if tuple(jnp.shape(a)) != tuple(want) or jnp.result_type(a) != ref.dtype:
                raise ValueError(
                    f"{n}: layer {i}'s new pool is {jnp.result_type(a)}{list(jnp.shape(a))}; it must be the "
                    f"cache's {ref.dtype}{list(want)}"
                )
            if self.stacked:
                new[n] = (pools[0].at[i].set(a),)
            else:
                per_layer = list(pools)
                per_layer[i] = a
                new[n] = tuple(per_layer)
        return dataclasses.replace(self, **new)

    def stack(self):
        """The same cache stacked (one copy; a stacked cache is returned as is)."""
        if self.stacked:
            return self
        return dataclasses.replace(self, stacked=True, **{n: (jnp.stack(getattr(self, n)),) for n in self._POOLS})

    def _require_stacked(self) -> None:
        if not self.stacked:
            raise ValueError(f"{type(self).__name__} is per-layer (stacked=False): flat() views a stacked cache")

    def flat(self):
        """A stacked cache as a one-layer cache of ``num_layers * num_pages`` pages (no copy)."""
        self._require_stacked()
        return dataclasses.replace(
            self, stacked=False, **{n: (_merge_layers(getattr(self, n)[0]),) for n in self._POOLS}
        )

    def unflat(self, flat):
        """The stacked cache of this cache's shape holding ``flat`` (the inverse of :meth:`flat`)."""
        self._require_stacked()
        for n in self._POOLS:
            got, want = getattr(flat, n)[0].shape, _merge_layers(getattr(self, n)[0]).shape
            if tuple(got) != tuple(want):  # a reshape of the same size would reorder the pages silently
                raise ValueError(f"flat.{n} has shape {tuple(got)}; the flat view of this cache is {tuple(want)}")
            got_t, want_t = getattr(flat, n)[0].dtype, getattr(self, n)[0].dtype
            if got_t != want_t:  # an f32 view would turn an FP8 cache into an f32 one
                raise ValueError(f"flat.{n} is {got_t}; this cache's {n} is {want_t}")
        return dataclasses.replace(
            self, **{n: (getattr(flat, n)[0].reshape(getattr(self, n)[0].shape),) for n in self._POOLS}
        )


def _merge_layers(pool):
    """``[L, P, ...] -> [L * P, ...]`` (a reshape: layer i's page p becomes page i * P + p)."""
    return pool.reshape(pool.shape[0] * pool.shape[1], *pool.shape[2:])


@dataclasses.dataclass(frozen=True)
class PagedKVCache(_Pools):
    """MHA/GQA paged cache: per-layer ``k[i]`` of shape ``[num_pages, page_size, num_kv_heads,
    head_dim]`` and ``v[i]`` of ``[..., head_dim_v]``.

    The cache holds data only: FP8 scales are the layer's (``LayerSpec.k_scale`` /
    ``v_scale``), passed to the writes and the reads by the backend.
    Page :data:`jattn.metadata.DUMMY_PAGE` is reserved for padded rows' writes.

    **Stacked** (``stacked=True``, for a model whose layers run as one ``lax.scan``): ``k``
    and ``v`` each hold ONE array ``[num_layers, num_pages, page_size, num_kv_heads,
    head_dim]``. :meth:`flat` views it as a one-layer cache of ``num_layers * num_pages``
    pages (a reshape, no copy), in which layer ``i``'s page ``p`` is page
    ``i * num_pages + p``; a plan shifted by ``DecodeMetadata.with_page_offset`` addresses
    one layer of it.
    """

    k: tuple
    v: tuple
    stacked: bool = False
    _POOLS = ("k", "v")

    @classmethod
    def create(
        cls,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        head_dim_v: int | None = None,
        dtype="bfloat16",
        stacked: bool = False,
    ) -> "PagedKVCache":
        dt = cache_dtype(dtype)
        num_pages = _num_pages(num_pages)
        dv = head_dim if head_dim_v is None else head_dim_v
        sizes = dict(num_layers=num_layers, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
        num_layers, page_size, num_kv_heads, head_dim, dv = _sizes(**sizes, head_dim_v=dv)
        _check_bool(stacked, "stacked")  # a string or number would pass the truth test
        if stacked:
            k = (jnp.zeros((num_layers, num_pages, page_size, num_kv_heads, head_dim), dt),)
            v = (jnp.zeros((num_layers, num_pages, page_size, num_kv_heads, dv), dt),)
            return cls(k=k, v=v, stacked=True)
        k = tuple(jnp.zeros((num_pages, page_size, num_kv_heads, head_dim), dt) for _ in range(num_layers))
        v = tuple(jnp.zeros((num_pages, page_size, num_kv_heads, dv), dt) for _ in range(num_layers))
        return cls(k=k, v=v)

    def layer(self, i: int):
        return self._layer(i)

    def replace_layer(self, i: int, k, v) -> "PagedKVCache":
        return self._replace_layer(i, (k, v))


@dataclasses.dataclass(frozen=True)
class MLAKVCache(_Pools):
    """DeepSeek MLA latent cache: per-layer ``kv[i]`` of shape
    ``[num_pages, page_size, kv_lora_rank + rope_dim]`` (c_kv then k_pe).

    Data only: the FP8 scale is the layer's (``LayerSpec.k_scale``). ``stacked=True``:
    ``kv`` holds one array ``[num_layers, num_pages, page_size, kv_lora_rank + rope_dim]``,
    viewed by :meth:`flat` as :class:`PagedKVCache` describes."""

    kv: tuple
    kv_lora_rank: int = 512
    stacked: bool = False
    _POOLS = ("kv",)

    @classmethod
    def create(
        cls,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_lora_rank: int = 512,
        rope_dim: int = 64,
        dtype="bfloat16",
        stacked: bool = False,
    ) -> "MLAKVCache":
        dt = cache_dtype(dtype)
        num_pages = _num_pages(num_pages)
        sizes = dict(num_layers=num_layers, page_size=page_size, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
        num_layers, page_size, kv_lora_rank, rope_dim = _sizes(**sizes)
        shape = (num_pages, page_size, kv_lora_rank + rope_dim)
        _check_bool(stacked, "stacked")  # a string or number would pass the truth test
        if stacked:
            return cls(kv=(jnp.zeros((num_layers, *shape), dt),), kv_lora_rank=kv_lora_rank, stacked=True)
        kv = tuple(jnp.zeros(shape, dt) for _ in range(num_layers))
        return cls(kv=kv, kv_lora_rank=kv_lora_rank)

    def layer(self, i: int):
        return self._layer(i)[0]

    def replace_layer(self, i: int, kv) -> "MLAKVCache":
        return self._replace_layer(i, (kv,))


jax.tree_util.register_dataclass(PagedKVCache, data_fields=["k", "v"], meta_fields=["stacked"])
jax.tree_util.register_dataclass(MLAKVCache, data_fields=["kv"], meta_fields=["kv_lora_rank", "stacked"])


class PagePoolExhausted(RuntimeError):
    """Raised when the allocator cannot hand out the pages asked for."""


class PageAllocator:
    """Host-side free list of page ids ``1 .. num_pages - 1`` (page 0 is the dummy)."""

    def __init__(self, num_pages: int):
        self.num_pages = _num_pages(num_pages)
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._used = np.zeros(num_pages, bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if not _is_int(n) or n < 0:
            raise ValueError(f"cannot allocate n={n!r} pages (an int >= 0)")
        if n > len(self._free):
            raise PagePoolExhausted(
                f"page pool exhausted: asked for {n} pages, {len(self._free)} of {self.num_pages - 1} free"
            )
        pages = [self._free.pop() for _ in range(n)]
        self._used[pages] = True
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        seen = set()
        for p in pages:
            if not _is_int(p):  # int() would free page 2 for 2.7
                raise ValueError(f"page {p!r} is not a page id (an int)")
            if not 0 < p < self.num_pages:
                raise ValueError(f"page {p} out of range [1, {self.num_pages})")
            if not self._used[p] or p in seen:
                raise ValueError(f"page {p} is not allocated (double free?)")
            seen.add(p)
        for p in pages:
            self._used[p] = False
            self._free.append(int(p))

    @staticmethod
    def pages_for(num_tokens: int, page_size: int) -> int:
        if not _is_int(num_tokens) or num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens!r} must be an int >= 0")
        return -(-int(num_tokens) // _positive_int(page_size, "page_size"))
