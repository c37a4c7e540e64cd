"""Attention across devices with ``jax.sharding``: tensor-parallel heads, data-parallel MLA.

Everything here is JAX's own machinery: a :class:`jax.sharding.Mesh`, ``NamedSharding``
placements, and ``shard_map`` around the unchanged single-device ops and backends (the
``xla`` reference or a Mosaic kernel alike: inside ``shard_map`` each device runs the call
on its own shard). No communication is written by hand; where the math needs it (the
row-parallel projections of a model), XLA inserts the collectives.

**Tensor parallelism** (:class:`TensorParallel`, SGLang's and tokenspeed's
``attn_tp_size``): query heads, KV heads and the KV pools are split over one mesh axis of
size ``n``; the metadata (page table, lengths, slots) is replicated, so every device runs
the same plan on its heads. Device ``i`` holds query heads ``[i * Hq / n, (i + 1) * Hq / n)``
and the KV heads they read. With fewer KV heads than devices (``Hkv < n``) each KV head is
replicated ``n / Hkv`` times, as serving engines do: the pool then holds ``n`` *physical*
KV heads, physical head ``p`` a copy of KV head ``p // (n / Hkv)``, one per device
(:meth:`HeadPartition.expand_kv`). Rules: ``Hq`` divisible by ``n``; ``Hkv`` divisible by
``n`` or ``n`` divisible by ``Hkv``.

**Data parallelism for MLA** (:class:`DataParallelMLABackend`, in ``jattn.data_parallel``
and importable from here): MLA has one latent KV
head, so DeepSeek serving shards requests instead. Each device of the axis owns its
requests and a pool of its own (the global pool ``[n * pages, page_size, R + r]`` split
by pages, page ids local to each device); the per-device plans are concatenated along
their leading axis (:func:`stack_plans`) and split again inside ``shard_map``.

Works with ``jax.shard_map`` (jax >= 0.7) and ``jax.experimental.shard_map`` before it,
on one process or several (``jax.distributed.initialize``): arrays are placed with
:func:`put`, which builds global arrays from host values on every process.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jattn import ops
from jattn.checks import _is_int
from jattn.config import LayerSpec
from jattn.kv_cache import PagedKVCache, is_fp8
from jattn.plan_stack import stack_plans

__all__ = [
    "DataParallelMLABackend",  # noqa: F822 - from jattn.data_parallel, through __getattr__
    "HeadPartition",
    "TensorParallel",
    "TensorParallelMHABackend",
    "put",
    "shard_map",
    "stack_plans",
]


def shard_map(f, mesh: Mesh, in_specs, out_specs):
    """``shard_map(f)`` over ``mesh`` with replication checks off (kernels inside are opaque
    custom calls); ``jax.shard_map`` where it exists, else ``jax.experimental.shard_map``."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as _legacy  # jax < 0.7

    return _legacy(f, mesh, in_specs, out_specs, check_rep=False)


def put(x, mesh: Mesh, spec: P = P()):
    """``x`` (host or device array) as a global array sharded by ``spec`` over ``mesh``.
    Built shard by shard from a host copy, so it works when the mesh spans processes
    (every process must pass the same value)."""
    sharding = NamedSharding(mesh, spec)
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _axis_size(mesh: Mesh, axis: str, who: str) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{who}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"{who}: axis={axis!r} is not an axis of the mesh (axes {tuple(mesh.axis_names)})")
    return int(mesh.shape[axis])


# ----------------------------------------------------------------------------- heads


def _check_kv_heads(hkv: int, n: int, ax: str) -> None:
    if not _is_int(hkv) or hkv < 1:  # before any int(): 2.5 heads are not 2
        raise ValueError(f"num_kv_heads={hkv!r} must be an int >= 1")
    if hkv >= n and hkv % n:
        raise ValueError(
            f"num_kv_heads={hkv} must be divisible by the size {n} of mesh axis {ax!r} "
            "(KV heads at least as many as devices are split evenly)"
        )
    if hkv < n and n % hkv:
        raise ValueError(
            f"the size {n} of mesh axis {ax!r} must be a multiple of num_kv_heads={hkv} "
            "(fewer KV heads than devices: each KV head is replicated size / num_kv_heads times)"
        )


@dataclasses.dataclass(frozen=True)
class HeadPartition:
    """How ``num_q_heads`` query and ``num_kv_heads`` KV heads split over ``size`` devices.

    ``kv_replicas`` copies of each KV head when ``num_kv_heads < size`` (else 1), so the
    pool holds ``physical_kv_heads`` heads; each device holds ``local_q_heads`` query heads
    and ``local_kv_heads`` physical KV heads. ``ValueError`` names the head count and the
    rule it breaks."""

    num_q_heads: int
    num_kv_heads: int
    size: int
    axis: str = "tp"

    def __post_init__(self):
        hq, hkv, n, ax = self.num_q_heads, self.num_kv_heads, self.size, self.axis
        if not _is_int(n) or n < 1:
            raise ValueError(f"the size of mesh axis {ax!r} must be an int >= 1, got {n!r}")
        for name, v in (("num_kv_heads", hkv), ("num_q_heads", hq)):
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        _check_kv_heads(hkv, n, ax)
        if hq % hkv:
            raise ValueError(f"num_q_heads={hq} must be a multiple of num_kv_heads={hkv}")
        if hq % n:
            raise ValueError(
                f"num_q_heads={hq} must be divisible by the size {n} of mesh axis {ax!r} "
                f"(each device holds num_q_heads / {n} query heads)"
            )

    @property
    def kv_replicas(self) -> int:
        return max(1, self.size // self.num_kv_heads)

    @property
    def physical_kv_heads(self) -> int:
        return self.num_kv_heads * self.kv_replicas

    @property
    def local_q_heads(self) -> int:
        return self.num_q_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return self.physical_kv_heads // self.size

    def expand_kv(self, x, axis: int):
        """``x`` with its ``num_kv_heads`` heads (on ``axis``) replicated to the physical
        heads (head ``p`` = head ``p // kv_replicas``); ``x`` itself when no replication is
        needed or it holds the physical heads already. Query head ``h`` then reads physical
        head ``h // (num_q_heads / physical_kv_heads)``, a copy of its own KV head."""
        have = x.shape[axis]
        if have == self.physical_kv_heads:
            return x
        if have != self.num_kv_heads:
            raise ValueError(
                f"expected {self.num_kv_heads} (logical) or {self.physical_kv_heads} (physical) KV heads "
                f"on axis {axis}, got shape {tuple(x.shape)}"
            )
        return jnp.repeat(x, self.kv_replicas, axis=axis)


def _check_sinks(sinks, num_q_heads: int) -> None:
    """The global sinks (one per query head, split over the axis with the heads)."""
    if sinks is not None and tuple(jnp.shape(sinks)) != (num_q_heads,):
        raise ValueError(f"sinks must have shape ({num_q_heads},) (one per query head), got {jnp.shape(sinks)}")


def _split_kwargs(kwargs: dict):
    """(static keywords, names of array keywords): arrays go into ``shard_map`` as
    replicated arguments, not as closed-over values."""
    arrays = [k for k, v in kwargs.items() if isinstance(v, (jax.Array, np.ndarray)) or hasattr(v, "aval")]
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    return static, arrays


def _build_sharded_op(tp, op, specs, static, array_keys, has_sinks, return_lse):
    """``jit(shard_map(op))`` for :meth:`TensorParallel._run`; ``static``: the static
    keywords as ``(name, value)`` pairs."""
    static = dict(static)
    n = len(specs)

    def body(*a):
        kw = dict(static, **dict(zip(array_keys, a[n + has_sinks :])))
        if has_sinks:
            kw["sinks"] = a[n]
        return op(*a[:n], return_lse=return_lse, **kw)

    in_specs = (*specs, *((P(tp.axis),) if has_sinks else ()), *(P(),) * len(array_keys))
    out_specs = (tp.head_spec(), P(None, tp.axis)) if return_lse else tp.head_spec()
    return jax.jit(shard_map(body, tp.mesh, in_specs, out_specs))


# One program per call signature, so that eager calls with the same shapes compile once.
_sharded_op = functools.lru_cache(maxsize=128)(_build_sharded_op)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Tensor parallelism over mesh axis ``axis`` of ``mesh``: the op wrappers (same
    arguments as :mod:`jattn.ops`, outputs equal to the single-device op's) and the
    placements of pools and activations."""

    mesh: Mesh
    axis: str = "tp"

    def __post_init__(self):
        _axis_size(self.mesh, self.axis, "TensorParallel")

    @property
    def size(self) -> int:
        return int(self.mesh.shape[self.axis])

    def heads(self, num_q_heads: int, num_kv_heads: int) -> HeadPartition:
        return HeadPartition(num_q_heads, num_kv_heads, self.size, self.axis)

    # ---- placements

    def pool_spec(self) -> P:
        """A paged pool ``[num_pages, page_size, heads, dim]``: split by head. (Written
        without the trailing None, as ``shard_map`` gives its outputs: specs that differ only
        by it are different jit cache keys, so a step fed its own output would compile again.)"""
        return P(None, None, self.axis)

    def head_spec(self) -> P:
        """Token-major activations ``[tokens, heads, dim]``: split by head."""
        return P(None, self.axis, None)

    def physical_kv_heads(self, num_kv_heads: int) -> int:
        """The KV heads a pool holds for a model of ``num_kv_heads``: ``num_kv_heads``, or
        the axis size when it is smaller (each head replicated); ``ValueError`` as in
        :class:`HeadPartition`."""
        _check_kv_heads(num_kv_heads, self.size, self.axis)
        return max(int(num_kv_heads), self.size)

    def create_kv_cache(
        self, *, num_layers, num_pages, page_size, num_kv_heads, head_dim, head_dim_v=None, dtype="bfloat16"
    ) -> PagedKVCache:
        """A zero :class:`PagedKVCache` with the physical KV heads of a model of
        ``num_kv_heads`` (:meth:`physical_kv_heads`), created on the devices split by head."""
        hkv = self.physical_kv_heads(num_kv_heads)

        def make():
            return PagedKVCache.create(
                num_layers=num_layers,
                num_pages=num_pages,
                page_size=page_size,
                num_kv_heads=hkv,
                head_dim=head_dim,
                head_dim_v=head_dim_v,
                dtype=dtype,
            )

        return jax.jit(make, out_shardings=NamedSharding(self.mesh, self.pool_spec()))()

    def shard_kv_cache(self, cache: PagedKVCache) -> PagedKVCache:
        """``cache`` placed split by head; a pool with fewer KV heads than the axis size is
        first replicated to the physical heads (head ``p`` a copy of ``p // replicas``)."""
        _refuse_stacked(cache, "shard_kv_cache")
        hkv = cache.k[0].shape[2]
        reps = self.physical_kv_heads(hkv) // hkv

        def place(x):
            return put(np.repeat(np.asarray(x), reps, axis=2) if reps > 1 else x, self.mesh, self.pool_spec())

        return dataclasses.replace(cache, k=tuple(map(place, cache.k)), v=tuple(map(place, cache.v)))

    # ---- ops

    def _paged(self, op, q, k_cache, v_cache, extra, extra_specs, sinks, return_lse, kwargs):
        hp = self.heads(q.shape[1], k_cache.shape[2])
        k_cache, v_cache = hp.expand_kv(k_cache, 2), hp.expand_kv(v_cache, 2)
        return self._run(
            op,
            (q, k_cache, v_cache, *extra),
            (self.head_spec(), *(self.pool_spec(),) * 2, *extra_specs),
            sinks,
            return_lse,
            kwargs,
        )

    def _run(self, op, args, specs, sinks, return_lse, kwargs):
        # The global arguments' checks, values included where concrete: inside shard_map each
        # device would see traced slices (and check sinks against its own heads only).
        ops.check_arguments(op, *args, sinks=sinks, return_lse=return_lse, **kwargs)
        sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)  # a list is one argument
        static, array_keys = _split_kwargs(kwargs)
        extra = ((sinks,) if sinks is not None else ()) + tuple(kwargs[k] for k in array_keys)
        static = tuple(sorted(static.items()))
        try:
            hash(static)
            build = _sharded_op
        except TypeError:  # an unhashable static option: this call's program, uncached
            build = _build_sharded_op
        return build(self, op, tuple(specs), static, tuple(array_keys), sinks is not None, return_lse)(*args, *extra)

    def mha_decode_with_kvcache(
        self, q, k_cache, v_cache, page_table, cache_seqlens, *, sinks=None, return_lse=False, **kwargs
    ):
        """:func:`jattn.mha_decode_with_kvcache` with heads split over the axis (the page
        table and lengths replicated). A pool with fewer KV heads than devices is replicated
        to the physical heads first (a copy per call: keep pools physical, see
        :meth:`shard_kv_cache`, to avoid it)."""
        return self._paged(
            ops.mha_decode_with_kvcache,
            q,
            k_cache,
            v_cache,
            (page_table, cache_seqlens),
            (P(), P()),
            sinks,
            return_lse,
            kwargs,
        )

    def mha_extend_with_kvcache(
        self, q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, *, sinks=None, return_lse=False, **kwargs
    ):
        """:func:`jattn.mha_extend_with_kvcache` with heads split over the axis."""
        return self._paged(
            ops.mha_extend_with_kvcache,
            q,
            k_cache,
            v_cache,
            (page_table, cache_seqlens, cu_seqlens_q),
            (P(), P(), P()),
            sinks,
            return_lse,
            kwargs,
        )

    def mha_prefill(self, q, k, v, cu_seqlens_q, cu_seqlens_kv=None, *, sinks=None, return_lse=False, **kwargs):
        """:func:`jattn.mha_prefill` (ragged, no cache) with heads split over the axis."""
        hp = self.heads(q.shape[1], k.shape[1])
        k, v = hp.expand_kv(k, 1), hp.expand_kv(v, 1)
        args, specs = (q, k, v, cu_seqlens_q), (self.head_spec(),) * 3 + (P(),)
        if cu_seqlens_kv is not None:
            args, specs = args + (cu_seqlens_kv,), specs + (P(),)
        return self._run(ops.mha_prefill, args, specs, sinks, return_lse, kwargs)


# ----------------------------------------------------------------------------- backends


class _Wrapped:
    """Delegates planning (``init_forward_metadata``, buckets, ...) to the inner backend."""

    backend: object

    def __getattr__(self, name):
        if name == "backend":  # not set yet (copy / unpickle)
            raise AttributeError(name)
        return getattr(self.backend, name)

    @property
    def config(self):
        return self.backend.config


class TensorParallelMHABackend(_Wrapped):
    """An :class:`~jattn.backends.MHABackend` run with heads split over ``axis`` of
    ``mesh``: ``forward_decode`` / ``forward_extend`` take and return the same global
    arrays as the backend's (q ``[T, Hq, D]`` or ``[T, Hq * D]``, new K/V ``[T, Hkv, D]``,
    out ``[T, Hq * Dv]``), with one ``shard_map`` around the whole single-device call (the
    KV write and the attention, on each device's own heads). The plan is replicated. The
    cache must hold the physical KV heads (:meth:`TensorParallel.create_kv_cache` or
    :meth:`TensorParallel.shard_kv_cache`); new K/V with the layer's logical heads are
    replicated to them. Planning methods are the inner backend's."""

    def __init__(self, backend, mesh: Mesh, axis: str = "tp"):
        self.backend = backend
        self.tp = TensorParallel(mesh, axis)

    @property
    def sharding_key(self):
        """What besides ``config`` tells two wrapped backends apart (for program caches)."""
        return ("tp", self.tp.mesh, self.tp.axis)

    def _local(self, layer: LayerSpec, kv_cache: PagedKVCache, sinks):
        _refuse_stacked(kv_cache, "TensorParallelMHABackend")
        k_pool = kv_cache.k[layer.layer_id]
        hp = self.tp.heads(layer.num_q_heads, layer.num_kv_heads)
        if k_pool.shape[2] != hp.physical_kv_heads:
            raise ValueError(
                f"kv_cache layer {layer.layer_id} holds {k_pool.shape[2]} KV heads; with num_kv_heads="
                f"{layer.num_kv_heads} over mesh axis {self.tp.axis!r} of size {self.tp.size} it must hold the "
                f"{hp.physical_kv_heads} physical heads (TensorParallel.create_kv_cache / shard_kv_cache)"
            )
        _check_sinks(sinks, layer.num_q_heads)
        local = dataclasses.replace(layer, layer_id=0, num_q_heads=hp.local_q_heads, num_kv_heads=hp.local_kv_heads)
        return hp, local

    def _call(self, method, q, k, v, layer, kv_cache, metadata, sinks, **kw):
        if (k is None) != (v is None):
            raise ValueError(f"{method}: k and v must both be given or both be None")
        hp, local = self._local(layer, kv_cache, sinks)
        q, k, v = self.backend._heads(layer, q, k, v)  # the inner backend's shape rules and messages
        kc, vc = kv_cache.layer(layer.layer_id)
        self._check_values(method, q, layer, kc, vc, metadata, sinks)
        sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
        ax, heads = self.tp.axis, self.tp.head_spec()
        args, specs = [q, kc, vc, metadata], [heads, self.tp.pool_spec(), self.tp.pool_spec(), P()]
        if k is not None:
            args, specs = args + [hp.expand_kv(k, 1), hp.expand_kv(v, 1)], specs + [heads, heads]
        if sinks is not None:
            args, specs = args + [sinks], specs + [P(ax)]
        has_kv, has_sinks = k is not None, sinks is not None

        def body(q, kc, vc, md, *rest):
            k_l, v_l = (rest[0], rest[1]) if has_kv else (None, None)
            s_l = rest[-1] if has_sinks else None
            cache = PagedKVCache(k=(kc,), v=(vc,))
            out, cache = getattr(self.backend, method)(q, k_l, v_l, local, cache, md, sinks=s_l, **kw)
            return out, cache.k[0], cache.v[0]

        out_specs = (P(None, ax), self.tp.pool_spec(), self.tp.pool_spec())
        out, kc, vc = shard_map(body, self.tp.mesh, tuple(specs), out_specs)(*args)
        return out, kv_cache.replace_layer(layer.layer_id, kc, vc)

    def _check_values(self, method, q, layer, kc, vc, metadata, sinks):
        """The inner call's argument checks on the global arrays: page ids, lengths, offsets
        and sinks where concrete (inside ``shard_map`` each device's are traced, and pass)."""
        opts = dict(self.backend.attention_options(layer, is_fp8(kc.dtype)), sinks=sinks)
        opts.update(max_seqlen_q=metadata.max_seqlen_q, is_causal=metadata.is_causal and not layer.non_causal)
        args = (q, kc, vc, metadata.page_table, metadata.cache_seqlens)
        if method == "forward_decode":
            ops.check_arguments(ops.mha_decode_with_kvcache, *args, **opts)
        else:
            ops.check_arguments(ops.mha_extend_with_kvcache, *args, metadata.cu_seqlens_q, **opts)

    def forward_decode(self, q, k, v, layer, kv_cache, metadata, save_kv_cache=True, sinks=None):
        """``MHABackend.forward_decode`` with heads split; returns ``(out [T, Hq * Dv], kv_cache)``."""
        return self._call("forward_decode", q, k, v, layer, kv_cache, metadata, sinks, save_kv_cache=save_kv_cache)

    def forward_extend(self, q, k, v, layer, kv_cache, metadata, save_kv_cache=True, sinks=None, kv_in_cache=False):
        """``MHABackend.forward_extend`` with heads split; returns ``(out [T, Hq * Dv], kv_cache)``."""
        return self._call(
            "forward_extend",
            q,
            k,
            v,
            layer,
            kv_cache,
            metadata,
            sinks,
            save_kv_cache=save_kv_cache,
            kv_in_cache=kv_in_cache,
        )


def _refuse_stacked(cache, what: str) -> None:
    """Tensor parallelism splits per-layer pools by head; a stacked pool (one array of all
    layers) has another layout."""
    if getattr(cache, "stacked", False):
        raise ValueError(
            f"{what}: the KV cache is stacked (one [layers, pages, ...] array); tensor parallelism takes a "
            "per-layer cache (PagedKVCache.create(..., stacked=False))"
        )


def __getattr__(name):
    # the data-parallel wrapper lives in jattn.data_parallel (which imports this module)
    if name == "DataParallelMLABackend":
        from jattn.data_parallel import DataParallelMLABackend

        return DataParallelMLABackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
