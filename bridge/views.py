"""The bridge's per-pool state: each KV pool's buffer views (checked against the config
and the layer when first seen, imported into JAX once) and hot-path plans, for the
adapters of :mod:`jattn.bridge.call`."""

from __future__ import annotations

import jax
import numpy as np
import torch

from .convert import BridgeError, check_shareable
from .state import _Bounded, _PoolState, _ref, _View


class _PoolViews:
    """Mixin of :class:`jattn.bridge.call._BridgeBase`: reads ``self._pools`` (a bounded
    dict of :class:`_PoolState` by ``id(pool)``), ``cache_bounds``, ``page_size``,
    ``config`` and the installed plan ``_md_call``."""

    def _pool_state(self, pool) -> _PoolState:
        """The per-pool state of ``pool`` (O(1): a dict look-up and a weak reference);
        a pool seen for the first time (or a new pool at a dead one's ``id``) gets a
        fresh one, dropped again when the pool dies."""
        key = id(pool)
        st = self._pools.get(key)
        if st is not None and st.ref() is pool:
            return st
        ps = getattr(pool, "page_size", None)
        if isinstance(ps, int) and ps != self.page_size:
            raise BridgeError(f"KV pool {type(pool).__name__} has page_size={ps}, config.page_size={self.page_size}")
        b = self.cache_bounds
        st = self._pools[key] = _PoolState(_ref(pool, self._pools, key), _Bounded(b["views"]), _Bounded(b["plans"]))
        return st

    def _view(
        self, pool, st: _PoolState, key, name: str, buf: torch.Tensor, row: tuple, mismatch, *, jax_view=True
    ) -> _View:
        """The cached JAX view ``[pages, page_size, *row]`` of pool buffer ``buf``
        (``name``, e.g. ``"k_buffer[layer 3]"``), imported when first seen or replaced.
        On import the buffer is checked: per-slot layout ``row`` (``[slots, *row]`` up to
        dims of size 1, or ``[slots, prod(row)]``; else ``mismatch(shape)`` names the
        difference), slots a multiple of the page size, at least ``config.num_pages``
        pages. ``jax_view=False`` (the native kernels): the same checks and torch view,
        no JAX import (the view's ``jax`` is None), and the installed plan's page bound
        checked against the buffer on every call."""
        v = st.views.get(key)
        if (
            v is not None
            and v.torch.data_ptr() == buf.data_ptr()
            and v.src_shape == buf.shape
            and v.torch.dtype == buf.dtype
            and (v.jax is not None or not jax_view)
        ):
            if not jax_view:
                self._check_native_bound(v.torch.shape[0], name)
            return v
        where = f"KV pool {type(pool).__name__}: {name}"
        if buf.dtype != self.kv_cache_dtype:
            raise BridgeError(f"{where} has dtype {buf.dtype}; config.kv_cache_dtype is {self.kv_cache_dtype}")
        shape = tuple(buf.shape)

        def squeezed(dims):
            return tuple(x for x in dims if x != 1)

        if not (squeezed(shape[1:]) == squeezed(row) or shape[1:] == (int(np.prod(row)),)):
            raise BridgeError(f"{where} has shape {shape}: {mismatch(shape)}")
        ps, num_pages = self.page_size, self.config.num_pages
        if shape[0] % ps:
            raise BridgeError(f"{where} has {shape[0]} slots, not a multiple of config.page_size={ps}")
        if num_pages is not None and shape[0] // ps < num_pages:
            raise BridgeError(
                f"{where} has {shape[0] // ps} pages, config.num_pages={num_pages} (page ids up to "
                f"{num_pages - 1} would be read past its end)"
            )
        check_shareable(buf, where, "a pool is shared in place, never copied: allocate it contiguous and aligned")
        t = buf.view((-1, ps) + row)
        if not jax_view:
            self._check_native_bound(t.shape[0], name)
        v = _View(t, jax.dlpack.from_dlpack(t, copy=False) if jax_view else None, src_shape=buf.shape)
        st.views[key] = v
        return v

    def _check_native_bound(self, pages: int, name: str) -> None:
        """The native kernels read page ids as the plan gives them: the plan must have
        been checked against a page count (``config.num_pages`` or ``num_pages=``) that
        the buffer (``pages`` pages) holds."""
        bound = getattr(self._md_call, "num_pages", None)
        if bound is None:
            raise BridgeError(
                "the installed plan's page ids were never range-checked: kernels='triton_native' reads "
                "the pool directly, so set config.num_pages or pass num_pages to init_forward_metadata"
            )
        if bound > pages:
            raise BridgeError(
                f"{name} has {pages} pages, but the plan's page ids were checked against num_pages={bound} "
                "(ids past the buffer's end would be read)"
            )

    @property
    def _views(self) -> dict:
        """Every live pool's views, keyed ``(id(pool), layer_id, buffer)`` (introspection)."""
        return {(pid,) + k: v for pid, st in self._pools.items() for k, v in st.views.items()}

    @property
    def _plans(self) -> dict:
        """Every live pool's hot-path plans, keyed ``(id(pool),) + plan key`` (introspection)."""
        return {(pid,) + k: v for pid, st in self._pools.items() for k, v in st.plans.items()}
