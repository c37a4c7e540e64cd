"""Data parallelism for MLA (:class:`DataParallelMLABackend`, also importable from
``jattn.sharding``): MLA has one latent KV head, so DeepSeek serving shards requests
instead of heads. Each device of the mesh axis owns its requests and a pool of its own
(the global pool ``[n * pages, page_size, R + r]`` split by pages, page ids local to
each device); the per-device plans are concatenated along their leading axis
(:func:`jattn.plan_stack.stack_plans`) and split again inside ``shard_map``."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jattn.checks import _check_cu_seqlens, _check_lengths, _concrete
from jattn.config import LayerSpec
from jattn.kv_cache import MLAKVCache
from jattn.mla_backend import check_llama_4_scaling
from jattn.sharding import _axis_size, _Wrapped, shard_map

__all__ = ["DataParallelMLABackend"]


def _unstack(md):
    """Inside ``shard_map``: a device's slice of a stacked plan is its own plan."""
    return dataclasses.replace(md, num_reqs=md.num_reqs.reshape(()))


def _absorbed_method(name: str):
    """``DataParallelMLABackend.<name>``: ``MLABackend.<name>`` on every device, the token
    arrays (``positions`` included, each device's own, stacked) split, ``cos_sin_cache``
    whole on every device."""

    def method(
        self, q, k, v, layer, kv_cache, metadata, save_kv_cache=True, q_rope=None, k_rope=None,
        llama_4_scaling=None, cos_sin_cache=None, is_neox=False, positions=None,
    ):  # fmt: skip
        split = dict(k=k, q_rope=q_rope, k_rope=k_rope, llama_4_scaling=llama_4_scaling, positions=positions)
        return self._absorbed(name, q, layer, kv_cache, metadata, save_kv_cache, split, cos_sin_cache, is_neox)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``MLABackend.{name}`` on each device's requests, pool and plan."
    return method


class DataParallelMLABackend(_Wrapped):
    """An :class:`~jattn.backends.MLABackend` run data-parallel over ``axis`` of ``mesh``:
    every device serves its own requests from its own latent pool. The global arrays are
    the per-device ones concatenated along their leading axis: tokens (q, c_kv, k_pe,
    outputs) ``[n * T, ...]``, the pool ``[n * pages, page_size, R + r]`` (split by page;
    :meth:`create_kv_cache`), the plan from :func:`stack_plans` of one plan per device
    (planned by the inner backend against that device's pool, ``num_pages`` its pages,
    all with one ``batch_buckets``). Methods have the inner backend's arguments; the plan's
    page ids are local to each device's pool."""

    def __init__(self, backend, mesh: Mesh, axis: str = "dp"):
        self.backend = backend
        self.mesh, self.axis = mesh, axis
        self.size = _axis_size(mesh, axis, "DataParallelMLABackend")

    @property
    def sharding_key(self):
        return ("dp", self.mesh, self.axis)

    @property
    def data_parallel_size(self) -> int:
        """Devices of the data-parallel axis: the number of pools and of stacked plans."""
        return self.size

    def create_kv_cache(self, *, num_layers, num_pages_per_device, page_size, kv_lora_rank, rope_dim, dtype="bfloat16"):
        """A zero latent pool of ``num_pages_per_device`` pages per device, split by page."""

        def make():
            return MLAKVCache.create(
                num_layers=num_layers,
                num_pages=num_pages_per_device * self.size,
                page_size=page_size,
                kv_lora_rank=kv_lora_rank,
                rope_dim=rope_dim,
                dtype=dtype,
            )

        return jax.jit(make, out_shardings=NamedSharding(self.mesh, P(self.axis)))()

    def _stacked(self, metadata):
        """``metadata``, checked to be a stacked plan of this axis; on an axis of one device
        a plain plan is taken too (stacked, it differs only in ``num_reqs``'s shape)."""
        n = np.shape(metadata.num_reqs)
        if self.size == 1 and n == ():
            return dataclasses.replace(metadata, num_reqs=jnp.reshape(metadata.num_reqs, (1,)))
        if n != (self.size,):
            raise ValueError(
                f"metadata.num_reqs has shape {n}: a data-parallel plan stacks one plan per device of mesh axis "
                f"{self.axis!r} (size {self.size}); build it with stack_plans"
            )
        return metadata

    def _per_device(self, check, *arrays) -> None:
        """``check(*parts)`` on each device's parts of ``arrays`` (split along their leading
        axis) where all are concrete, the message naming the device: the inner backend's
        value checks, which inside ``shard_map`` see traced slices and pass."""
        vals = [_concrete(a) for a in arrays]
        if any(v is None for v in vals):
            return
        for d, parts in enumerate(zip(*(np.split(v, self.size) for v in vals))):
            try:
                check(*parts)
            except ValueError as e:
                raise ValueError(f"device {d} of mesh axis {self.axis!r}: {e}") from None

    def _check_plan(self, metadata, pool) -> None:
        """Each device's page ids and lengths against its own pool's pages."""
        per = pool.shape[0] // self.size
        check = functools.partial(_check_lengths, page_size=metadata.page_size, num_pages=per)
        self._per_device(check, metadata.page_table, metadata.cache_seqlens)

    def _check_offsets(self, name: str, cu, x, x_name: str, max_name: str, max_seqlen: int) -> None:
        """Each device's ``cu`` ([bs + 1] offsets) against its rows of ``x``."""
        local = x.shape[0] // self.size
        self._per_device(lambda c: _check_cu_seqlens(c, name, local, x_name, max_seqlen, max_name), cu)

    def _run(self, fn, named_args: dict, optional=None, replicated=None, static=None, check=None):
        """``fn(*local args, **local optional args)`` on every device. Every argument of
        ``named_args`` (``{name: value}``, passed by position) and of ``optional`` (by
        keyword, left out where None), and every output, is split along its leading axis,
        whose size must be a multiple of the axis size (else a message naming the argument,
        instead of ``shard_map``'s); ``replicated`` arguments (a rope table; left out where
        None) reach every device whole, ``static`` ones as they are, both by keyword.
        ``check()``, then, runs the value checks the local calls cannot (their values are
        traced); a ``llama_4_scaling`` among ``optional`` is checked here."""
        split = {**named_args, **{k: v for k, v in (optional or {}).items() if v is not None}}
        whole = {k: v for k, v in (replicated or {}).items() if v is not None}
        for name, x in split.items():
            for leaf in jax.tree_util.tree_leaves(x):
                rows = np.shape(leaf)[0] if np.ndim(leaf) else None
                if rows is None or rows % self.size:
                    raise ValueError(
                        f"{name} has leading size {rows}: a data-parallel call splits it over the {self.size} "
                        f"devices of mesh axis {self.axis!r}, so it must be a multiple of {self.size} (each "
                        "device's rows, stacked)"
                    )
        if split.get("llama_4_scaling") is not None:
            check_llama_4_scaling(split["llama_4_scaling"], np.shape(next(iter(named_args.values())))[0])
        if check is not None:
            check()
        n = len(named_args)
        keywords = list(split)[n:] + list(whole)

        def body(*args):
            return fn(*args[:n], **dict(zip(keywords, args[n:])), **(static or {}))

        spec = P(self.axis)
        specs = tuple(spec for _ in split) + tuple(P() for _ in whole)
        return shard_map(body, self.mesh, specs, spec)(*split.values(), *whole.values())

    def fill_block_decode_seq_lens(self, metadata, bs, block_seq_lens):
        """``MLABackend.fill_block_decode_seq_lens`` on each device's plan: ``bs`` i32[n]
        (each device's request count) and ``block_seq_lens`` i32[n * B] (each device's
        rows of the stacked plan). Jittable. On an axis of one device a plain plan and
        ``bs`` are taken too, and a plain plan comes back."""
        plain = self.size == 1 and np.shape(metadata.num_reqs) == ()
        metadata = self._stacked(metadata)
        bs = jnp.asarray(bs, jnp.int32)
        if plain and bs.shape == ():
            bs = bs.reshape(1)
        if bs.shape != (self.size,):
            raise ValueError(f"bs has shape {bs.shape}: one request count per device, ({self.size},)")

        def body(md, bs, lens):
            out = self.backend.fill_block_decode_seq_lens(_unstack(md), bs[0], lens)
            return dataclasses.replace(out, num_reqs=jnp.reshape(out.num_reqs, (1,)))

        lens = jnp.asarray(block_seq_lens, jnp.int32)
        out = self._run(body, dict(metadata=metadata, bs=bs, block_seq_lens=lens))
        return _unstack(out) if plain else out

    def save_kv(
        self, layer: LayerSpec, kv_cache: MLAKVCache, out_cache_loc, c_kv, k_pe, *, cos_sin_cache=None,
        is_neox=False, positions=None,
    ) -> MLAKVCache:  # fmt: skip
        """``MLABackend.save_kv`` on each device's pool (slots local to it); ``positions``
        split as the tokens are, ``cos_sin_cache`` whole on every device."""
        local = dataclasses.replace(layer, layer_id=0)

        def body(pool, loc, c, k, **kw):
            return self.backend.save_kv(local, MLAKVCache((pool,), kv_cache.kv_lora_rank), loc, c, k, **kw).kv[0]

        args = dict(kv_cache=kv_cache.layer(layer.layer_id), out_cache_loc=out_cache_loc, c_kv=c_kv, k_pe=k_pe)
        rope = dict(cos_sin_cache=cos_sin_cache)
        pool = self._run(body, args, dict(positions=positions), rope, dict(is_neox=is_neox))
        return kv_cache.replace_layer(layer.layer_id, pool)

    def _absorbed(self, method, q, layer, kv_cache, metadata, save_kv_cache, split, cos_sin_cache, is_neox):
        """``MLABackend.<method>`` on every device: ``split`` the optional token arrays
        (``k`` among them), the rope table whole on each device."""
        metadata = self._stacked(metadata)
        local = dataclasses.replace(layer, layer_id=0)

        def body(q, pool, md, k=None, **kw):
            cache = MLAKVCache((pool,), kv_cache.kv_lora_rank)
            out, cache = getattr(self.backend, method)(q, k, None, local, cache, _unstack(md), save_kv_cache, **kw)
            return out, cache.kv[0]

        pool = kv_cache.layer(layer.layer_id)
        args = dict(q=q, kv_cache=pool, metadata=metadata)
        rope, check = dict(cos_sin_cache=cos_sin_cache), functools.partial(self._check_plan, metadata, pool)
        out, pool = self._run(body, args, split, rope, dict(is_neox=is_neox), check)
        return out, kv_cache.replace_layer(layer.layer_id, pool)

    forward_decode = _absorbed_method("forward_decode")
    forward_draft_extend = _absorbed_method("forward_draft_extend")
    forward_absorbed = _absorbed_method("forward_absorbed")

    def forward_extend(
        self, q, k, v, layer, metadata, q_rope=None, k_rope=None, return_lse=False, llama_4_scaling=None,
        cos_sin_cache=None, is_neox=False, positions=None,
    ):  # fmt: skip
        """``MLABackend.forward_extend`` (ragged non-absorbed prefill) on each device's tokens."""
        metadata = self._stacked(metadata)

        def body(q, k, v, md, **kw):
            return self.backend.forward_extend(q, k, v, layer, _unstack(md), return_lse=return_lse, **kw)

        split = dict(q_rope=q_rope, k_rope=k_rope, llama_4_scaling=llama_4_scaling, positions=positions)
        rope, static = dict(cos_sin_cache=cos_sin_cache), dict(is_neox=is_neox)
        mq = metadata.max_seqlen_q
        check = functools.partial(
            self._check_offsets, "cu_seqlens_q", metadata.cu_seqlens_q, q, "q", "max_seqlen_q", mq
        )
        return self._run(body, dict(q=q, k=k, v=v, metadata=metadata), split, rope, static, check)

    def forward_prefix_chunk(
        self, q, k, v, layer, cu_seqlens_q, cu_seqlens_kv, *, max_seqlen_q: int, max_seqlen_kv: int, q_rope=None,
        k_rope=None, llama_4_scaling=None, cos_sin_cache=None, is_neox=False, positions=None,
    ):  # fmt: skip
        """``MLABackend.forward_prefix_chunk`` on each device's tokens and chunk keys: q / k /
        v (and the optional token arrays) are the devices' rows concatenated, each device's
        part padded to the same size; ``cu_seqlens_q`` / ``cu_seqlens_kv`` each device's
        offsets ``[bs + 1]`` (local to its rows) concatenated. The keys are what the caller
        gathered from each device's own pool at that device's ``PrefixChunk.slots``.
        Returns ``(o, lse)`` split the same way."""
        static = dict(max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, is_neox=is_neox)

        def body(q, k, v, cu_q, cu_kv, **kw):
            return self.backend.forward_prefix_chunk(q, k, v, layer, cu_q, cu_kv, **kw)

        split = dict(q_rope=q_rope, k_rope=k_rope, llama_4_scaling=llama_4_scaling, positions=positions)
        named = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv)

        def check():
            self._check_offsets("cu_seqlens_q", cu_seqlens_q, q, "q", "max_seqlen_q", max_seqlen_q)
            self._check_offsets("cu_seqlens_kv", cu_seqlens_kv, k, "k", "max_seqlen_kv", max_seqlen_kv)

        return self._run(body, named, split, dict(cos_sin_cache=cos_sin_cache), static, check)
