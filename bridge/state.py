"""The torch bridge's per-call state: bounded caches, weak references that drop an
entry when its object dies, and the records kept per KV pool, per layer, per
parameter tensor and per torch buffer viewed from JAX (:mod:`jattn.bridge.call`
describes how the call machinery uses them)."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Callable

import jax
import numpy as np
import torch

from jattn.backends import LayerSpec

__all__ = ["_Bounded", "_LayerEntry", "_Param", "_Plan", "_PoolState", "_View", "_host", "_ref", "_slim"]


def _req_to_page(req_to_page, kwargs: dict):
    """The request-to-page table of a planning call: ``req_to_page``, else the
    ``req_to_token_pages`` keyword (SGLang's name for it), which is taken out of ``kwargs``."""
    alias = kwargs.pop("req_to_token_pages", None)
    return alias if req_to_page is None else req_to_page


def _host(x):
    """numpy view of a host value (torch CPU/GPU tensor, list, numpy)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _host_i32(x, name: str) -> np.ndarray:
    """Host integers ``x`` as int32, refusing other dtypes and values past int32 (a cast
    would truncate or wrap them silently); ``name`` is the argument in the messages."""
    a = _host(x)
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
    info = np.iinfo(np.int32)
    if a.size and (int(a.max()) > info.max or int(a.min()) < info.min):
        i = int(np.argmax(a)) if int(a.max()) > info.max else int(np.argmin(a))
        raise ValueError(f"{name}[{i}]={int(a.flat[i])} does not fit int32")
    return a.astype(np.int32)


def _slim(md):
    """``md`` without the fields the bridge's jitted bodies never read (positions,
    request count, prefix lengths): each array argument of a jitted call is host
    time on every call."""
    drop = {f: None for f in ("positions", "num_reqs", "prefix_lens") if hasattr(md, f)}
    return dataclasses.replace(md, **drop)


class _Bounded(dict):
    """A dict of at most ``maxsize`` entries: an insertion beyond the bound drops the
    oldest entry. Look-ups stay plain ``dict.get`` (no bookkeeping on the hot path); an
    entry dropped while still in use is rebuilt on its next use, so with a working
    set below the bound that costs one rebuild per ``maxsize`` new entries."""

    def __init__(self, maxsize: int):
        super().__init__()
        self.maxsize = maxsize

    def __setitem__(self, key, value):
        dict.pop(self, key, None)  # re-inserted: now the newest
        dict.__setitem__(self, key, value)
        while len(self) > self.maxsize:
            del self[next(iter(self))]


def _forget(cache: dict, key, ref) -> None:
    """Weak-reference callback: drops ``cache[key]`` if that entry is still the one of
    ``ref`` (not a newer entry of another object at the same ``id``)."""
    ent = dict.get(cache, key)
    if ent is not None and ent.ref is ref:
        del cache[key]


def _ref(obj, cache: dict | None = None, key=None) -> Callable:
    """A weak reference to ``obj`` (with a callback that drops ``cache[key]`` when
    ``obj`` dies), or, for an object without weak-reference support, a callable that
    returns it (held strongly; the bounded cache then limits how many are held)."""
    try:
        if cache is None:
            return weakref.ref(obj)
        return weakref.ref(obj, functools.partial(_forget, cache, key))
    except TypeError:
        return lambda: obj


@dataclasses.dataclass(eq=False)
class _PoolState:
    """What the bridge keeps per KV pool: the pool (held weakly), the views of its
    buffers per (layer, buffer) and its hot-path plans."""

    ref: Callable
    views: _Bounded
    plans: _Bounded


@dataclasses.dataclass(eq=False)
class _LayerEntry:
    """A layer object (held weakly) and its specs, with and without the layer id, and the
    key of the scale attributes they were read from (``pool.scale_key``)."""

    ref: Callable
    spec: LayerSpec
    spec0: LayerSpec
    scales: tuple = ()


@dataclasses.dataclass(eq=False)
class _Plan:
    """A hot-path plan (see :meth:`_BridgeBase._make_plan`) and its layer (held weakly)."""

    ref: Callable
    fn: Callable


class _Param:
    """A parameter tensor's f32 JAX copy and what identifies the tensor it was read
    from: the tensor (weakly), its version counter, data pointer, shape and dtype."""

    __slots__ = ("ref", "version", "ptr", "shape", "dtype", "array")

    def __init__(self, ref, x: torch.Tensor, array):
        # An inference-mode tensor has no version counter: None, never reused (re-read each call).
        self.ref, self.version, self.ptr = ref, None if x.is_inference() else x._version, x.data_ptr()
        self.shape, self.dtype, self.array = x.shape, x.dtype, array


@dataclasses.dataclass
class _View:
    """A torch buffer and the JAX array viewing it (replaced by the aliased output
    after each donating call)."""

    torch: torch.Tensor
    jax: jax.Array
    verified: bool = False
    src_shape: tuple = ()
