"""Forward metadata as immutable pytrees, and the host-side planners that build it.

One request ``b`` in a batch, in token positions::

    |<------------- cache_seqlens[b] (L) ------------->|
    |<---- prefix_lens[b] (cached) ---->|<- new (n) ->|
    [ k0 k1 ... (already in the paged cache)  | q0 .. qn-1 ]
                                               ^ positions = L - n + i

``L`` always counts the new tokens, which are written to the cache (at
``out_cache_loc``) before attention reads it. A decode step is ``n = max_seqlen_q``
(1, or the number of draft tokens for spec verify); an extend step has a
different ``n`` per request (``cu_seqlens_q``).

Arrays are pytree data; everything that shapes the compiled program (bucketed
sizes, ``max_seqlen_q``, ``page_size``, causality, ``has_prefix``, ``forward_mode``)
is static, so feeding new values of the same bucket to a jitted step never retraces.
Rows added to reach a bucket (and rows given with length 0) have length 0, write
only to the reserved dummy page (:data:`DUMMY_PAGE`), and their outputs are zero
and ignored. The exact rules are in docs/SEMANTICS.md.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jattn.checks import _check_causal, _concrete
from jattn.plan_inputs import (
    _as_int_array,
    _check_host_lengths,
    _check_i32,
    _check_nonnegative,
    _check_num_pages,
    _check_pages,
    _check_unique_slots,
    _check_writes,
    _positive_int,
    _resolve_page_table,
    extend_prefix,
)

DUMMY_PAGE = 0
"""Page reserved for padded rows' writes; ``PageAllocator`` never hands it out."""

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ForwardMode(enum.Enum):
    """What one forward step does; the plan of a step records it (a static field).

    ``DECODE`` one new token per request; ``TARGET_VERIFY`` the same number of draft
    tokens per request, causal; ``DRAFT_BLOCK`` a DFLASH draft block (that many tokens,
    non-causal); ``EXTEND`` ragged new tokens over a paged prefix (a prefill when there
    is no prefix); ``DRAFT_EXTEND`` ragged new draft tokens that MLA runs as absorbed
    (decode-style) attention, padded per request.
    """

    DECODE = "decode"
    TARGET_VERIFY = "target_verify"
    DRAFT_BLOCK = "draft_block"
    EXTEND = "extend"
    DRAFT_EXTEND = "draft_extend"

    def is_decode(self) -> bool:
        """A fixed number of new tokens per request (a :class:`DecodeMetadata` plan)."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_BLOCK)

    def is_extend(self) -> bool:
        """Ragged new tokens per request (an :class:`ExtendMetadata` plan)."""
        return self in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND)

    @classmethod
    def parse(cls, mode) -> "ForwardMode":
        """A :class:`ForwardMode` from itself, its value, or another engine's enum member: by
        its value where that is one of these values (a mirror of this enum), else by name
        (SGLang's ``MIXED`` / ``PREFILL`` are ``EXTEND``, ``DRAFT_EXTEND_V2`` is
        ``DRAFT_EXTEND``, and its v1 ``DRAFT_EXTEND`` is ``EXTEND``, the ragged extend over
        the prefix that SGLang's TRT-LLM MLA backend runs it as)."""
        if isinstance(mode, cls):
            return mode
        if isinstance(mode, str):
            try:
                return cls(mode.lower())
            except ValueError:
                raise ValueError(f"unknown forward_mode {mode!r}; one of {[m.value for m in cls]}") from None
        value = getattr(mode, "value", None)
        if isinstance(value, str) and value in {m.value for m in cls}:  # a mirror of this enum
            return cls(value)
        name = getattr(mode, "name", None)
        if isinstance(name, str):
            n = name.lower()
            alias = {
                "mixed": "extend",
                "prefill": "extend",
                "draft_extend": "extend",
                "draft_extend_v2": "draft_extend",
            }
            return cls.parse(alias.get(n, n))
        raise ValueError(f"unknown forward_mode {mode!r}")


def _pytree(cls, data):
    meta = [f.name for f in dataclasses.fields(cls) if f.name not in data]
    return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=meta)


class _PagedPlan:
    """What Decode and Extend plans share: shifting their pages."""

    def with_page_offset(self, offset, num_pages: int):
        """The same plan on pages ``offset + p`` of a pool of ``num_pages`` pages: page ids
        and write slots shifted (jittable; ``offset`` may be traced). Layer ``i`` of a
        stacked cache's ``flat()`` view (``jattn.kv_cache.PagedKVCache``) is
        ``offset = i * pages per layer``, ``num_pages = layers * pages per layer``."""
        return _with_page_offset(self, offset, num_pages)


@dataclasses.dataclass(frozen=True)
class DecodeMetadata(_PagedPlan):
    """Metadata of a decode step (``max_seqlen_q`` tokens per request, request-major).

    The arrays are pytree data; ``max_seqlen_q``, ``page_size``, ``is_causal``,
    ``forward_mode``, ``num_pages`` (the pool size the page ids were checked against,
    None if unchecked) and ``group_size`` are static (a new value compiles a new program).

    A **cascade** plan (``group_size > 1``): rows come in groups of ``group_size``
    consecutive requests, and group ``g``'s rows share their first ``prefix_pages[g]``
    pages (i32[batch / group_size]; 0: nothing shared). The backends then read each
    shared prefix once per group (``jattn.cascade_decode``); the page table and lengths
    are the full rows, as in any plan.
    """

    page_table: jax.Array  # i32[bs, max_pages]
    cache_seqlens: jax.Array  # i32[bs], new tokens included
    out_cache_loc: jax.Array  # i32[bs * max_seqlen_q], slots of the new tokens
    positions: jax.Array  # i32[bs * max_seqlen_q], absolute positions of the new tokens
    num_reqs: jax.Array  # i32[], requests given to the planner (rows >= num_reqs are bucket padding)
    max_seqlen_q: int = 1
    page_size: int = 16
    is_causal: bool = True
    forward_mode: ForwardMode = ForwardMode.DECODE
    num_pages: int | None = None  # the pool size every page id was checked against (None: unchecked)
    prefix_pages: jax.Array | None = None  # i32[batch / group_size] (cascade plans)
    group_size: int = 1

    @property
    def batch_size(self) -> int:
        return self.page_table.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.out_cache_loc.shape[0]

    def with_seq_lens(self, seq_lens, num_reqs=None) -> "DecodeMetadata":
        """The same plan with new per-request lengths (jittable, no retrace).

        ``seq_lens`` i32[bs] (new tokens included) replaces ``cache_seqlens`` for rows
        ``< num_reqs`` (default: the plan's ``num_reqs``); positions and write slots of
        those rows are re-derived from the page table, which must already hold their
        pages. Rows ``>= num_reqs`` keep length 0 and write to the dummy page. Concrete
        lengths outside ``[0, max_pages * page_size]`` are refused; traced ones there write
        nothing (their slot would be another token's). Host (numpy) lengths are also checked
        against the page table: a length reaching a column the planner filled with the
        dummy page is refused (a device copy of the table comes back for that check; device
        lengths skip it).
        """
        bs, n, ps = self.batch_size, self.max_seqlen_q, self.page_size
        cap = self.page_table.shape[1] * ps
        shape = getattr(seq_lens, "shape", None)
        dtype = getattr(seq_lens, "dtype", None)
        if shape is None or len(shape) != 1 or shape[0] > bs or not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(
                f"seq_lens must be an int array [n <= batch_size={bs}], got "
                f"{type(seq_lens).__name__} {getattr(dtype, 'name', dtype)}{list(shape) if shape is not None else ''}"
            )
        c = _concrete(seq_lens)
        if c is not None and c.size and (c.min() < 0 or c.max() > cap):
            b = int(np.flatnonzero((c < 0) | (c > cap))[0])
            raise ValueError(f"seq_lens[{b}]={int(c.reshape(-1)[b])} must be in [0, {cap}] (the page table's tokens)")
        nr = None
        if num_reqs is not None:
            nr = _concrete(num_reqs)
            if nr is not None and not (nr.ndim == 0 and jnp.issubdtype(nr.dtype, jnp.integer) and 0 <= nr <= shape[0]):
                raise ValueError(f"num_reqs={num_reqs!r} must be an int in [0, len(seq_lens)={shape[0]}]")
        num_reqs = self.num_reqs if num_reqs is None else num_reqs
        if isinstance(seq_lens, np.ndarray):  # host lengths: a host call, which may read the plan back
            nr = _concrete(num_reqs) if nr is None else nr
            if nr is not None and nr > shape[0]:
                raise ValueError(
                    f"seq_lens has {shape[0]} lengths for the plan's num_reqs={int(nr)} requests: a request "
                    "would be emptied silently (pass num_reqs= to shrink the batch)"
                )
            table = _concrete(self.page_table)
        else:  # device lengths (a step of a multi-step plan): no device-to-host copy of the plan
            table = None
        if c is not None and nr is not None and table is not None:
            _check_host_lengths(table, c, int(nr), ps, n)
        real = jnp.arange(bs) < num_reqs
        sl = jnp.asarray(seq_lens, jnp.int32).reshape(-1)[:bs]
        lens = jnp.where(real, jnp.pad(sl, (0, bs - sl.shape[0])), 0)
        pos = lens[:, None] - n + jnp.arange(n, dtype=jnp.int32)[None, :]
        ok = real[:, None] & (pos >= 0) & (pos < cap)
        pos = jnp.where(ok, pos, 0)
        page = jnp.take_along_axis(self.page_table, jnp.clip(pos // ps, 0, self.page_table.shape[1] - 1), axis=1)
        loc = jnp.where(ok, page * ps + pos % ps, DUMMY_PAGE * ps)
        return dataclasses.replace(
            self,
            cache_seqlens=lens,
            positions=pos.reshape(-1),
            out_cache_loc=loc.reshape(-1).astype(jnp.int32),
            num_reqs=jnp.asarray(num_reqs, jnp.int32),
        )


@dataclasses.dataclass(frozen=True)
class ExtendMetadata(_PagedPlan):
    """Metadata of an extend / prefill step (ragged new tokens over a paged prefix).

    The arrays are pytree data; ``max_seqlen_q``, ``page_size``, ``is_causal``,
    ``has_prefix`` (some request has a cached prefix), ``forward_mode`` and ``num_pages``
    (as in :class:`DecodeMetadata`) are static.
    """

    page_table: jax.Array  # i32[bs, max_pages]
    cache_seqlens: jax.Array  # i32[bs]: prefix + new
    prefix_lens: jax.Array  # i32[bs]
    cu_seqlens_q: jax.Array  # i32[bs + 1]
    out_cache_loc: jax.Array  # i32[num_tokens]; padding tokens write to the dummy page
    positions: jax.Array  # i32[num_tokens]
    num_reqs: jax.Array  # i32[]
    max_seqlen_q: int = 1
    page_size: int = 16
    is_causal: bool = True
    has_prefix: bool = True
    forward_mode: ForwardMode = ForwardMode.EXTEND
    num_pages: int | None = None  # the pool size every page id was checked against (None: unchecked)

    @property
    def batch_size(self) -> int:
        return self.page_table.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.out_cache_loc.shape[0]


def _with_page_offset(md, offset, num_pages: int):
    if md.num_pages is not None and md.num_pages > num_pages:
        raise ValueError(f"with_page_offset: num_pages={num_pages} is below the plan's num_pages={md.num_pages}")
    off_c = _concrete_int(offset)
    if off_c is not None and md.num_pages is not None and not 0 <= off_c <= num_pages - md.num_pages:
        raise ValueError(
            f"with_page_offset: offset={off_c} must be in [0, {num_pages - md.num_pages}] "
            f"(the plan's {md.num_pages} pages shifted inside a pool of num_pages={num_pages})"
        )
    off = jnp.asarray(offset, jnp.int32)
    return dataclasses.replace(
        md,
        page_table=md.page_table + off,
        out_cache_loc=md.out_cache_loc + off * md.page_size,
        # An unchecked plan stays unchecked: the shift does not bound its page ids.
        num_pages=None if md.num_pages is None else num_pages,
    )


def _concrete_int(x) -> int | None:
    """``x`` as a Python int, or None while it is traced."""
    try:
        return int(x)
    except (jax.errors.TracerIntegerConversionError, jax.errors.ConcretizationTypeError, TypeError):
        return None


_pytree(DecodeMetadata, ("page_table", "cache_seqlens", "out_cache_loc", "positions", "num_reqs", "prefix_pages"))
_pytree(
    ExtendMetadata,
    ("page_table", "cache_seqlens", "prefix_lens", "cu_seqlens_q", "out_cache_loc", "positions", "num_reqs"),
)


def bucket(n: int, buckets: Sequence[int] | None = None, *, name: str = "size") -> int:
    """Smallest bucket >= n (powers of two when ``buckets`` is None)."""
    if buckets is None:
        b = 1
        while b < n:
            b *= 2
        return b
    if len(buckets) == 0:
        raise ValueError(f"the {name} buckets are empty: give at least one, or None for powers of two")
    for b in sorted(buckets):
        if b >= n:
            return int(b)
    raise ValueError(f"{name}={n} exceeds the largest bucket {max(buckets)}")


def _pad_table(pt: np.ndarray, seq_lens: np.ndarray, page_size: int, bs_pad: int, width: int):
    """Page table padded to [bs_pad, width]; unused entries point at the dummy page."""
    out = np.full((bs_pad, width), DUMMY_PAGE, np.int32)
    need = -(-seq_lens // page_size)
    n = min(width, pt.shape[1])
    out[: pt.shape[0], :n] = np.where(np.arange(n)[None, :] < need[:, None], pt[:, :n], DUMMY_PAGE)
    return out


def _slots(pt: np.ndarray, rows: np.ndarray, pos: np.ndarray, page_size: int) -> np.ndarray:
    return pt[rows, pos // page_size].astype(np.int64) * page_size + pos % page_size


def _width(seq_lens, page_size, max_pages):
    need = int((-(-seq_lens // page_size)).max(initial=1))
    if max_pages is not None:
        ok = not isinstance(max_pages, (bool, np.bool_))
        try:
            max_pages = operator.index(max_pages) if ok else max_pages  # an int, numpy int or 0-d int array
        except TypeError:
            ok = False
        if not ok or max_pages < 1:
            raise ValueError(f"max_pages={max_pages!r} must be an int >= 1 (a plan's page table has a column)")
        if max_pages < need:
            raise ValueError(f"max_pages={max_pages} is less than the {need} pages a request needs")
        return max_pages
    return bucket(max(need, 1))


def plan_decode(
    seq_lens,
    *,
    page_size: int,
    page_table=None,
    req_to_page=None,
    req_pool_indices=None,
    q_len: int = 1,
    is_causal: bool = True,
    batch_buckets: Sequence[int] | None = DEFAULT_BATCH_BUCKETS,
    max_pages: int | None = None,
    num_pages: int | None = None,
    forward_mode: ForwardMode | None = None,
    group_size: int = 1,
    prefix_pages=None,
) -> DecodeMetadata:
    """Builds :class:`DecodeMetadata` from host (numpy) inputs.

    Args:
      seq_lens: int[bs], each request's length including its ``q_len`` new tokens
        (``>= q_len``), or 0 for a padding row.
      page_size: tokens per page.
      page_table: int[bs, >= pages needed] page ids, or give ``req_to_page``
        int[pool, max_pages] with ``req_pool_indices`` int[bs] (the request-to-page
        pool and per-request indices that SGLang and tokenspeed keep). A real
        request's pages must not be :data:`DUMMY_PAGE`.
      q_len: new tokens per request (1; draft tokens for spec verify; the block
        size for a non-causal DFLASH draft block with ``is_causal=False``).
      is_causal: False only for a DFLASH draft block.
      batch_buckets: the batch is padded to the smallest bucket >= bs (powers of two
        when None).
      max_pages: page-table width (default: power-of-two bucket of the need).
      num_pages: the pool's page count: every page id a request uses must be below it.
        The plan records it (static); the backends refuse a plan without it, or with
        more pages than their cache has (None leaves ids unchecked, for direct op use).
      forward_mode: a decode mode (``DECODE``, ``TARGET_VERIFY``, ``DRAFT_BLOCK``) or
        None to read it off ``q_len`` and ``is_causal``.
      group_size, prefix_pages: a cascade plan (causal modes): requests ``[g * group_size,
        (g + 1) * group_size)`` share their first ``prefix_pages[g]`` pages (int[number of
        groups], the last group may be partial). The padded batch must be a multiple of
        ``group_size``; groups past the last given one share nothing.

    Example:
      >>> md = plan_decode(np.array([5, 17]), page_size=16, page_table=np.array([[3, 0], [1, 2]]))
      >>> md.page_table.shape, md.max_seqlen_q
      ((2, 2), 1)
    """
    page_size = _positive_int(page_size, "page_size")
    q_len = _positive_int(q_len, "q_len")
    _check_causal(is_causal)
    mode = _decode_mode(forward_mode, q_len, is_causal)
    sl = _as_int_array(seq_lens, "seq_lens", 1)
    bs = sl.shape[0]
    short = (sl < q_len) & (sl != 0)
    if short.any() or (sl < 0).any():
        b = int(np.argmax(short | (sl < 0)))
        raise ValueError(
            f"seq_lens[{b}]={sl[b]} < q_len={q_len}: decode lengths count the new tokens (0 marks a padding row)"
        )
    num_pages = _check_num_pages(num_pages)
    pt, table_name, rows = _resolve_page_table(page_table, req_to_page, req_pool_indices, bs)
    _check_pages(pt, sl, page_size, num_pages, table_name=table_name, rows=rows)
    bs_pad = bucket(max(bs, 1), batch_buckets, name="batch size")
    width = _width(sl, page_size, max_pages)
    # A DRAFT_BLOCK plan keeps each request's whole row of valid page ids:
    # fill_block_decode_seq_lens may move the block's end on the device, past the
    # pages of today's length.
    draft_block = mode is ForwardMode.DRAFT_BLOCK
    table = _pad_table(pt, np.where(sl > 0, width * page_size, 0) if draft_block else sl, page_size, bs_pad, width)
    if draft_block:
        hi = np.iinfo(np.int32).max if num_pages is None else num_pages
        table = np.where((table > DUMMY_PAGE) & (table < hi), table, DUMMY_PAGE).astype(np.int32)
    lens = np.zeros(bs_pad, np.int32)
    lens[:bs] = sl
    pos = np.zeros((bs_pad, q_len), np.int64)
    pos[:bs] = sl[:, None] - q_len + np.arange(q_len)[None, :]
    rows = np.repeat(np.arange(bs_pad), q_len).reshape(bs_pad, q_len)
    empty = lens[:, None] == 0  # padding rows (given with length 0, or added for the bucket)
    pos = np.where(empty, 0, pos)
    loc = np.where(empty, DUMMY_PAGE * page_size, _slots(table, rows, pos, page_size))
    _check_i32(loc.reshape(-1), "out_cache_loc", "a slot: page * page_size + offset")
    real = np.flatnonzero(np.repeat(~empty[:, 0], q_len))  # the plan's token index of each checked slot
    _check_unique_slots(
        loc[~empty[:, 0]].reshape(-1), page_size, tokens=lambda i, j: f"new tokens {real[i]} and {real[j]}"
    )
    _check_writes(table, lens, np.full_like(lens, q_len), page_size, ~empty[:, 0])
    pp = _cascade_prefix(group_size, prefix_pages, table, lens, bs, bs_pad, page_size, q_len, is_causal)
    return DecodeMetadata(
        page_table=np.asarray(table, np.int32),
        cache_seqlens=lens,
        out_cache_loc=loc.reshape(-1).astype(np.int32),
        positions=pos.reshape(-1).astype(np.int32),
        num_reqs=np.int32(bs),
        max_seqlen_q=q_len,
        page_size=page_size,
        is_causal=is_causal,
        forward_mode=mode,
        num_pages=num_pages,
        prefix_pages=pp,
        group_size=int(group_size),
    )


def _cascade_prefix(group_size, prefix_pages, table, lens, bs, bs_pad, page_size, q_len, is_causal):
    """The checked i32 ``prefix_pages`` of a cascade plan (None for ``group_size`` 1)."""
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be an int >= 1")
    if group_size == 1:
        if prefix_pages is not None:
            raise ValueError("prefix_pages needs group_size > 1")
        return None
    if prefix_pages is None:
        raise ValueError(f"a cascade plan (group_size={group_size}) needs prefix_pages: the shared pages per group")
    if not is_causal:
        raise ValueError("a cascade plan (group_size > 1) must be causal")
    if bs_pad % group_size:
        raise ValueError(f"the padded batch {bs_pad} is not a multiple of group_size={group_size}")
    groups = bs_pad // group_size
    given = _as_int_array(prefix_pages, "prefix_pages", 1)
    want = -(-bs // group_size)
    if given.shape[0] != want:
        raise ValueError(f"prefix_pages has {given.shape[0]} entries; the {bs} requests form {want} groups")
    pp = np.zeros(groups, np.int32)
    pp[: given.shape[0]] = given
    from jattn.cascade import check_shared_prefix  # here: jattn.cascade imports the ops, which import this module

    check_shared_prefix(table, lens, pp, group_size=group_size, page_size=page_size, q_len=q_len)
    return pp


def _decode_mode(forward_mode, q_len: int, is_causal: bool) -> ForwardMode:
    """The decode mode of a plan: given, or read off ``q_len`` and causality."""
    if forward_mode is None:
        if q_len == 1 and is_causal:
            return ForwardMode.DECODE
        return ForwardMode.TARGET_VERIFY if is_causal else ForwardMode.DRAFT_BLOCK
    mode = ForwardMode.parse(forward_mode)
    if not mode.is_decode():
        raise ValueError(f"plan_decode plans decode modes, not {mode}; use plan_extend")
    if (mode is ForwardMode.DRAFT_BLOCK) == bool(is_causal):
        raise ValueError(f"forward_mode={mode} and is_causal={is_causal} disagree (only DRAFT_BLOCK is non-causal)")
    return mode


def plan_extend(
    seq_lens,
    extend_seq_lens,
    *,
    page_size: int,
    page_table=None,
    req_to_page=None,
    req_pool_indices=None,
    extend_prefix_lens=None,
    is_causal: bool = True,
    batch_buckets: Sequence[int] | None = DEFAULT_BATCH_BUCKETS,
    token_buckets: Sequence[int] | None = None,
    max_seqlen_q_buckets: Sequence[int] | None = None,
    max_pages: int | None = None,
    num_pages: int | None = None,
    forward_mode: ForwardMode = ForwardMode.EXTEND,
) -> ExtendMetadata:
    """Builds :class:`ExtendMetadata` for an extend/prefill step from host inputs.

    Args:
      seq_lens: int[bs], prefix + new tokens per request.
      extend_seq_lens: int[bs], new tokens per request (>= 0).
      extend_prefix_lens: int[bs], optional; must equal ``seq_lens - extend_seq_lens``.
      token_buckets: total new tokens are padded to the smallest bucket
        (powers of two, at least 16, when None).
      max_seqlen_q_buckets: the longest request's new tokens are padded to a
        bucket (powers of two when None); it is static in the compiled program.
      forward_mode: ``EXTEND`` (prefill / extend) or ``DRAFT_EXTEND``.
      Other arguments as in :func:`plan_decode`.
    """
    page_size = _positive_int(page_size, "page_size")
    _check_causal(is_causal)
    forward_mode = ForwardMode.parse(forward_mode)
    if not forward_mode.is_extend():
        raise ValueError(f"plan_extend plans extend modes, not {forward_mode}; use plan_decode")
    sl = _as_int_array(seq_lens, "seq_lens", 1)
    ext = _as_int_array(extend_seq_lens, "extend_seq_lens", 1)
    bs = sl.shape[0]
    prefix = extend_prefix(sl, ext, extend_prefix_lens)
    num_pages = _check_num_pages(num_pages)
    pt, table_name, rows = _resolve_page_table(page_table, req_to_page, req_pool_indices, bs)
    _check_pages(pt, sl, page_size, num_pages, table_name=table_name, rows=rows)
    bs_pad = bucket(max(bs, 1), batch_buckets, name="batch size")
    width = _width(sl, page_size, max_pages)
    table = _pad_table(pt, sl, page_size, bs_pad, width)
    total = int(ext.sum())
    # at least 16 rows when the buckets are the default powers of two
    t_pad = bucket(max(total, 16 if token_buckets is None else 1), token_buckets, name="num tokens")
    max_q = bucket(max(int(ext.max(initial=0)), 1), max_seqlen_q_buckets, name="max_seqlen_q")
    cu = np.zeros(bs_pad + 1, np.int64)
    cu[1 : bs + 1] = np.cumsum(ext)
    cu[bs + 1 :] = total
    rows = np.repeat(np.arange(bs), ext)
    pos_real = (np.arange(total) - cu[rows]) + prefix[rows]
    loc = np.full(t_pad, DUMMY_PAGE * page_size, np.int64)
    pos = np.zeros(t_pad, np.int64)
    loc[:total] = _slots(table, rows, pos_real, page_size)
    _check_i32(loc, "out_cache_loc", "a slot: page * page_size + offset")
    _check_unique_slots(loc[:total], page_size)
    pos[:total] = pos_real
    lens = np.zeros(bs_pad, np.int32)
    lens[:bs] = sl
    pre = np.zeros(bs_pad, np.int32)
    pre[:bs] = prefix
    _check_writes(table, lens, lens - pre, page_size, lens > 0)
    return ExtendMetadata(
        page_table=table,
        cache_seqlens=lens,
        prefix_lens=pre,
        cu_seqlens_q=cu.astype(np.int32),
        out_cache_loc=loc.astype(np.int32),
        positions=pos.astype(np.int32),
        num_reqs=np.int32(bs),
        max_seqlen_q=max_q,
        page_size=page_size,
        is_causal=is_causal,
        has_prefix=bool((prefix > 0).any()),
        forward_mode=forward_mode,
        num_pages=num_pages,
    )


@dataclasses.dataclass(frozen=True)
class PrefixChunk:
    """One chunk of the cached prefixes for the chunked-prefix-cache path (MLA prefill).

    Request ``b`` has keys ``cu_seqlens_kv[b] .. cu_seqlens_kv[b+1]`` in this chunk, held
    in the paged cache at ``slots`` (token-major, padded with the dummy slot). The model
    gathers the latent rows at ``slots``, up-projects them to K/V and runs a non-causal
    attention with LSE, merged into the new tokens' result with ``attn_merge_state``.
    """

    cu_seqlens_kv: jax.Array  # i32[bs + 1]
    slots: jax.Array  # i32[chunk_tokens]
    max_seqlen_kv: int = 1


_pytree(PrefixChunk, ("cu_seqlens_kv", "slots"))


def plan_prefix_chunks(
    prefix_lens,
    page_table,
    *,
    page_size: int,
    chunk_size: int,
    batch_size: int | None = None,
    num_pages: int | None = None,
) -> tuple:
    """Splits every request's cached prefix into chunks of at most ``chunk_size`` tokens.

    Chunk ``c`` holds prefix tokens ``[c * chunk_size, (c + 1) * chunk_size)`` of each
    request (a request whose prefix is shorter has 0 keys in it: its rows come out as
    ``o = 0, lse = -inf`` and merge as a no-op). ``batch_size`` pads the requests to a
    bucket (default: ``len(prefix_lens)``); ``num_pages`` (the pool's page count) bounds
    the page ids of the prefixes. Returns a tuple of :class:`PrefixChunk`.
    """
    pre = _as_int_array(prefix_lens, "prefix_lens", 1)
    pt = _as_int_array(page_table, "page_table", 2)
    page_size = _positive_int(page_size, "page_size")
    _check_nonnegative(pre, "prefix_lens")
    chunk_size = _positive_int(chunk_size, "chunk_size")
    if pt.shape[0] < pre.shape[0]:
        raise ValueError(f"page_table has {pt.shape[0]} rows but prefix_lens has {pre.shape[0]} requests")
    _check_pages(pt[: pre.shape[0]], pre, page_size, _check_num_pages(num_pages), "prefix_lens")
    bs = pre.shape[0] if batch_size is None else _positive_int(batch_size, "batch_size")
    if bs < pre.shape[0]:
        raise ValueError(f"batch_size={bs} is smaller than the {pre.shape[0]} requests")
    chunks = []
    for c in range(-(-int(pre.max(initial=0)) // chunk_size)):
        lo = c * chunk_size
        n = np.clip(pre - lo, 0, chunk_size)
        cu = np.zeros(bs + 1, np.int64)
        cu[1 : pre.shape[0] + 1] = np.cumsum(n)
        cu[pre.shape[0] + 1 :] = cu[pre.shape[0]]
        width = bucket(max(int(cu[-1]), 16))
        slots = np.full(width, DUMMY_PAGE * page_size, np.int64)
        rows = np.repeat(np.arange(pre.shape[0]), n)
        pos = lo + np.arange(int(cu[-1])) - cu[rows]
        slots[: int(cu[-1])] = _slots(pt, rows, pos, page_size)
        _check_i32(slots, "slots", "a slot: page * page_size + offset")
        chunks.append(
            PrefixChunk(cu.astype(np.int32), slots.astype(np.int32), max_seqlen_kv=bucket(max(int(n.max()), 1)))
        )
    return tuple(chunks)


def to_device(md):
    """Moves a metadata pytree's host arrays to the default device."""
    return jax.tree_util.tree_map(jax.numpy.asarray, md)
