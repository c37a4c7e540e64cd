"""Static configuration of the Mosaic GPU paged decode kernel (``mosaic_decode``).

Everything here runs on the host at trace time, on shapes only:

* :class:`BlockSizes`: the tiling of one call (KV block shape, ring depth, KV
  splits, compute warpgroups), and :func:`choose_block_sizes`, which picks it
  from the shapes when the caller gives none;
* :class:`KernelOptions`: code-path choices of the kernel (software-pipelined
  block loop, split combine as one kernel, which calls go to the per-KV-head kernel),
  each giving the same results except on FP8 caches, where the per-KV-head kernel's
  e4m3 query changes them (see ``fp8_heads``);
* :func:`unsupported_reason` / :func:`auto_skip_reason`: which calls the kernel
  serves, and which automatic dispatch leaves to the xla backend.

Shared-memory accounting follows the kernel's scratch: a K and a V ring of
``num_stages`` blocks, one 64-row q/output tile per compute warpgroup, the LSE
rows, barriers, and for FP8 KV the f16 upcast rings of the converter warpgroup.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jattn.pallas_kernels.combine import NUM_SMS, balanced_split_count, choose_num_splits

__all__ = [
    "DecodeConfig",
    "decode_config",
    "BlockSizes",
    "KernelOptions",
    "choose_block_sizes",
    "choose_num_splits",
    "convert_stages_for",
    "unsupported_reason",
    "auto_skip_reason",
    "prefer_heads_kernel",
    "block_shape",
    "smem_bytes",
    "SUPPORTED_PAGE_SIZES",
    "SUPPORTED_HEAD_DIMS",
    "SUPPORTED_Q_DTYPES",
    "MAX_GROUP",
    "FP8_CONVERT_STAGES",
    "MAX_Q_LEN",
    "NUM_SMS",
    "SMEM_LIMIT",
]

SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_Q_DTYPES = (jnp.bfloat16, jnp.float16)
MAX_GROUP = 16
MAX_Q_LEN = 8
FP8_CONVERT_STAGES = 2  # f16 ring slots of the FP8 converter warpgroup
SMEM_LIMIT = 227 * 1024  # shared memory per block on sm90 (opt-in maximum)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tiling of one call (hashable; part of the compiled program).

    block_tokens: tokens of one page per KV *piece* (divides page_size).
    pages_per_block: pieces per KV block; > 1 only with whole pages
      (block_tokens == page_size) when one page has fewer than 64 rows.
    num_stages: depth of the shared-memory K/V ring.
    num_splits: KV splits per request (flash-decoding).
    compute_wgs: compute warpgroups per CTA, each owning 64 query rows.
    """

    block_tokens: int
    pages_per_block: int
    num_stages: int
    num_splits: int
    compute_wgs: int


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Code-path choices of the decode kernel (hashable; part of the compiled program).

    Every setting computes the same attention, up to the FP8 query's rounding on FP8
    caches (``fp8_heads``, ``heads_kernel``, ``heads_row_tile``); they differ in speed
    only, so benchmarks can compare them (``python -m jattn bench decode --set``).

    overlap_qk: software-pipelined block loop: block i+1's ``Q K^T`` wgmma is
      issued before block i's softmax, so the tensor cores and the softmax
      overlap. FP8 KV without the converter warpgroup always runs the plain loop
      (its K upcast sits on the same dependency chain).
    kernel_combine: merge the KV splits with one Triton kernel (through
      jax-triton, on a GPU where it is installed) instead of XLA ops. Without
      jax-triton, and under the Mosaic GPU interpreter, the XLA ops run.
    fp8_converter: FP8 KV only: a converter warpgroup upcasts each K and V tile
      of the FP8 ring into a ring of ``FP8_CONVERT_STAGES`` f16 tiles, so the
      compute warpgroup runs the 2-byte loop (``overlap_qk`` included) with no
      upcast on its chain (the default: faster on the H200, docs/PERF.md). Off:
      the compute warpgroup upcasts each tile itself, in the plain loop.
    heads_kernel: calls that :func:`prefer_heads_kernel` gives to the per-KV-head kernel
      (``mosaic_decode_heads``: one KV head per CTA, keys as the MMA rows) run there
      when it serves them and no ``block_sizes`` are given. Off: every call runs
      this kernel.
    heads_persistent: the per-KV-head kernel launches one CTA per SM slot, each walking
      several (split, request, KV head) items (``mha_decode_heads(persistent=...)``); off
      (the default: the hardware's own CTA scheduling balanced better on the H200,
      docs/PERF.md), one CTA per item.
    heads_row_tile: the per-KV-head kernel takes a KV head's query rows in tiles of this
      many (16 or 32), one item per tile beside its split's other tiles
      (``mha_decode_heads(row_tile=...)``); 0 (the default: the tiles measured slower on
      the H200, docs/PERF.md), all rows in one item.
    fp8_heads: FP8 K/V calls that the per-KV-head kernel serves (decode, target verify
      and draft blocks) run there with an e4m3 query (``S^T`` on the landed e4m3 K
      tile) over 64-token blocks (``mha_decode_heads(fp8_qk=True, block=64)``): faster
      than this kernel's FP8 path at every shape measured (docs/PERF.md). It changes
      FP8 results by the query's rounding to e4m3 (docs/SEMANTICS.md), and so do the
      options that move an FP8 call off that path (``heads_kernel=False``) or change its
      scales (``heads_row_tile``, one scale per tile). Off: FP8 runs here with the exact
      query.
    heads_v_regs: that FP8 path reads ``V^T`` from the landed e4m3 tile into registers
      (``mha_decode_heads(v_regs=True)``) instead of upcasting V into an f16 tile in
      shared memory. Off by default: the f16 tile measured faster at every query length
      (docs/PERF.md).
    heads_overlap: the per-KV-head kernel (its 2-byte path, and that FP8 path with
      ``heads_v_regs``) issues block ``i + 1``'s ``S^T`` before block ``i``'s softmax
      (``mha_decode_heads(overlap=True)``), as ``overlap_qk`` does here. Off by default:
      no faster at one token, slower at eight (docs/PERF.md).
    heads_glue: around the per-KV-head kernel, its FP8 path's e4m3 query comes from one
      Triton kernel and the split combine reads its partials in place
      (``mha_decode_heads(glue=True)``, where jax-triton runs); off, XLA ops gather the
      query and transpose the partials (one more kernel or more per call; the same
      results up to the order in which the two combines sum the splits).
    balanced_splits: this kernel cuts every request of a call into splits of one shared
      size, chosen on the device from the traced lengths
      (:func:`~jattn.pallas_kernels.combine.balanced_split_blocks`), over a static split
      count large enough for a request as long as the page table
      (:func:`~jattn.pallas_kernels.combine.balanced_split_count`): a long request takes
      more splits than a short one, so the CTAs of an uneven batch carry even work. Off,
      each request is cut into the same number of splits, so the longest request's CTAs
      set the call's time. None (the default): :func:`balanced_for` chooses by the call.
      A call routed to the per-KV-head kernel balances its splits only with True
      (``mha_decode_heads(balanced=True)``); None keeps them even there.
    """

    overlap_qk: bool = True
    kernel_combine: bool = True
    fp8_converter: bool = True
    heads_kernel: bool = True
    heads_persistent: bool = False
    heads_row_tile: int = 0
    fp8_heads: bool = True
    heads_v_regs: bool = False
    heads_overlap: bool = False
    heads_glue: bool = True
    balanced_splits: bool | None = None

    def __post_init__(self):
        # checked here: a bad value would otherwise pass on calls the option does not reach
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "heads_row_tile":
                if v not in (0, 16, 32) or isinstance(v, bool):
                    raise ValueError(f"KernelOptions.heads_row_tile={v!r} must be 0 (no tiles), 16 or 32")
            elif f.name == "balanced_splits" and v is None:
                pass
            elif not isinstance(v, (bool, np.bool_)):
                none = " (or None: chosen by the call)" if f.name == "balanced_splits" else ""
                raise ValueError(f"KernelOptions.{f.name}={v!r} must be True or False{none}")


def balanced_for(options: KernelOptions, batch: int, m_rows: int, kv_itemsize: int) -> bool:
    """Whether a call of ``batch`` requests of ``m_rows`` query rows each takes balanced
    splits: ``options.balanced_splits`` where set, else several requests (one request has
    nothing to balance against, and the balanced count only adds splits) whose query rows
    fit one 64-row tile, over a 2-byte cache. Those calls timed level with equal lengths
    and faster with uneven ones; FP8 caches and calls of two row tiles keep even splits
    until timed (docs/PERF.md)."""
    if options.balanced_splits is not None:
        return bool(options.balanced_splits)
    return batch > 1 and m_rows <= 64 and kv_itemsize == 2


def prefer_heads_kernel(q_len: int, num_q_heads: int, kv_itemsize: int) -> bool:
    """Whether the per-KV-head kernel is the faster of the two decode kernels for a call
    both serve (measured on an H200, docs/PERF.md): multi-token calls (verify, draft
    blocks) whose query rows ``q_len * num_q_heads`` fill at least one 64-row tile of
    this kernel. Each tile's warpgroup runs the whole wgmma -> softmax -> wgmma chain on
    every KV block (a block of all KV heads, most of its scores masked by GQA), while the
    per-KV-head kernel's MMA columns only widen. 2-byte KV only: its FP8 upcast sits on
    its chain and is slower than this kernel's converter warpgroup."""
    return q_len >= 2 and q_len * num_q_heads >= 64 and kv_itemsize == 2


def convert_stages_for(kv_itemsize: int, options: KernelOptions) -> int:
    """The FP8 converter's f16 ring slots for this KV width and these options (0: none)."""
    return FP8_CONVERT_STAGES if kv_itemsize == 1 and options.fp8_converter else 0


def block_reason(block_tokens, pages_per_block, num_kv_heads, page_size) -> str | None:
    """Why a KV block of ``pages_per_block`` pieces of ``block_tokens`` tokens of every KV head
    cannot be the kernel's, else None: a piece divides the page (one TMA box within one page
    id), several pieces only of whole pages, and the block a multiple of 64 rows (the P@V
    wgmma contracts over it in 64-element swizzle groups), at most 256 (one TMA box per piece)."""
    bt, ppb = block_tokens, pages_per_block
    if bt < 1 or page_size % bt or ppb < 1 or (ppb > 1 and bt != page_size):
        return (
            f"block_tokens must divide page_size={page_size}, and pages_per_block > 1 needs whole pages "
            "(block_tokens == page_size)"
        )
    n = bt * ppb * num_kv_heads
    if n % 64 or n > 256:
        return (
            f"a KV block of block_tokens x pages_per_block x {num_kv_heads} KV heads = {n} rows; it must be a "
            "multiple of 64 and at most 256"
        )
    return None


def block_shape(num_kv_heads, head_dim, page_size, target_n=None):
    """(block_tokens, pages_per_block) or None: the block :func:`block_reason` takes nearest
    ``target_n`` rows (128; 64 for head_dim 256: registers)."""
    if target_n is None:
        target_n = 128 if head_dim <= 128 else 64
    best = None
    for bt in [t for t in range(1, page_size + 1) if page_size % t == 0]:
        for ppb in [1] if bt < page_size else range(1, 17):
            if block_reason(bt, ppb, num_kv_heads, page_size):
                continue
            n = bt * ppb * num_kv_heads
            key = (abs(n - target_n), ppb)
            if best is None or key < best[0]:
                best = (key, (bt, ppb))
    return None if best is None else best[1]


def smem_bytes(block_n, head_dim, kv_itemsize, q_itemsize, compute_wgs, stages, convert_stages=0):
    """Shared memory of one CTA: K/V ring, q/output tiles, LSE rows, the boundary-block
    flag rows (several queries per request; counted always, at the largest block),
    barriers; for FP8 KV the f16 upcast tiles (``convert_stages`` slots each for K and
    V with the converter warpgroup, else one)."""
    ring = 2 * stages * block_n * head_dim * kv_itemsize
    if kv_itemsize == 1:
        ring += 2 * max(convert_stages, 1) * block_n * head_dim * q_itemsize
    q = compute_wgs * 64 * head_dim * q_itemsize
    flags = compute_wgs * (256 + 64) * 4
    return ring + q + compute_wgs * 64 * 4 + flags + 4096  # + lse, barriers, 1 KB alignments


def choose_block_sizes(
    *,
    batch,
    num_kv_heads,
    head_dim,
    page_size,
    max_pages,
    m_rows,
    kv_itemsize,
    q_itemsize=2,
    options: KernelOptions = KernelOptions(),
) -> BlockSizes:
    """The tiling used when the caller gives none.

    Prefers a KV block near 128 rows (64 for head_dim 256) with a ring of at least
    3 stages in shared memory, two compute warpgroups when there are two 64-row
    query tiles (2-byte KV only), and the split count of :func:`choose_num_splits`, or of
    :func:`~jattn.pallas_kernels.combine.balanced_split_count` where the call balances
    (:func:`balanced_for`; the same rule holds when these block sizes are passed back).
    ``options``: the kernel options the tiling is for (FP8 KV with the converter warpgroup
    holds its f16 ring in shared memory too).
    """
    convert_stages = convert_stages_for(kv_itemsize, options)
    m_tiles = -(-m_rows // 64)
    compute_wgs = 2 if (m_tiles % 2 == 0 and kv_itemsize == 2) else 1
    choice = None
    for target_n in (128, 64) if head_dim <= 128 else (64,):
        shape = block_shape(num_kv_heads, head_dim, page_size, target_n)
        if shape is None:
            continue
        block_n = shape[0] * shape[1] * num_kv_heads
        for c in sorted({compute_wgs, 1}, reverse=True):
            fits = [
                st
                for st in (4, 3, 2)
                if smem_bytes(block_n, head_dim, kv_itemsize, q_itemsize, c, st, convert_stages) <= SMEM_LIMIT
            ]
            if fits and (choice is None or (fits[0] >= 3 and choice[2] < 3)):
                choice = (shape, c, fits[0])
            if fits:
                break
        if choice is not None and choice[2] >= 3:
            break
    if choice is None:
        hint = ""
        if convert_stages:  # the converter warpgroup's f16 ring took the room
            try:
                choose_block_sizes(
                    batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                    max_pages=max_pages, m_rows=m_rows, kv_itemsize=kv_itemsize, q_itemsize=q_itemsize,
                    options=dataclasses.replace(options, fp8_converter=False),
                )  # fmt: skip
                hint = " beside the FP8 converter's f16 ring (KernelOptions(fp8_converter=False) fits)"
            except NotImplementedError:
                pass
        raise NotImplementedError(
            f"num_kv_heads={num_kv_heads}, head_dim={head_dim}, page_size={page_size}: no KV "
            f"block of a multiple of 64 rows (at most 256) fits in shared memory{hint}"
        )
    (bt, ppb), compute_wgs, num_stages = choice
    max_blocks = -(-max_pages * page_size // (bt * ppb))
    num_splits = choose_num_splits(batch, m_tiles // compute_wgs, max_blocks)
    if balanced_for(options, batch, m_rows, kv_itemsize):
        num_splits = balanced_split_count(num_splits, batch * (m_tiles // compute_wgs), max_blocks)
    return BlockSizes(bt, ppb, num_stages, num_splits, compute_wgs)


# ---------------------------------------------------------------------------
# Capability checks.
def unsupported_reason(
    q,
    k_cache,
    v_cache,
    *,
    max_seqlen_q=1,
    is_causal=True,
    window_left=-1,
    logit_cap=0.0,
    sinks=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    return_lse=False,
    page_table=None,
    cache_seqlens=None,
    options: KernelOptions = KernelOptions(),
    **unused,
) -> str | None:
    """None if the Mosaic GPU decode kernel (with ``options``) can serve this call, else why not."""
    del is_causal, logit_cap, softmax_scale, k_scale, v_scale, return_lse, unused
    del page_table, cache_seqlens
    if q.ndim != 3 or k_cache.ndim != 4 or v_cache.ndim != 4:
        return (
            f"expected q [tokens, Hq, D] and caches [pages, page_size, Hkv, D], got "
            f"q.ndim={q.ndim}, k_cache.ndim={k_cache.ndim}, v_cache.ndim={v_cache.ndim}"
        )
    if k_cache.shape != v_cache.shape:
        return f"k_cache.shape={k_cache.shape} != v_cache.shape={v_cache.shape}"
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    tokens, num_q_heads, head_dim_q = q.shape
    if head_dim_q != head_dim:
        return f"q head_dim={head_dim_q} != cache head_dim={head_dim}"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim={head_dim} not in {SUPPORTED_HEAD_DIMS}"
    if page_size not in SUPPORTED_PAGE_SIZES:
        return f"page_size={page_size} not in {SUPPORTED_PAGE_SIZES}"
    if num_q_heads % num_kv_heads:
        return f"num_q_heads={num_q_heads} not divisible by num_kv_heads={num_kv_heads}"
    group = num_q_heads // num_kv_heads
    if group > MAX_GROUP:
        return f"GQA group size {group} > {MAX_GROUP}"
    if block_shape(num_kv_heads, head_dim, page_size) is None:
        return (
            f"num_kv_heads={num_kv_heads} with page_size={page_size}: no KV block of a "
            "multiple of 64 rows and at most 256 rows"
        )
    if not 1 <= max_seqlen_q <= MAX_Q_LEN:
        return f"max_seqlen_q={max_seqlen_q} not in [1, {MAX_Q_LEN}]"
    if tokens % max_seqlen_q:
        return f"q rows {tokens} not a multiple of max_seqlen_q={max_seqlen_q}"
    if jnp.dtype(q.dtype) not in [jnp.dtype(d) for d in SUPPORTED_Q_DTYPES]:
        return f"q dtype {jnp.dtype(q.dtype).name} not in (bfloat16, float16)"
    kv_dt = jnp.dtype(k_cache.dtype)
    if kv_dt != jnp.dtype(v_cache.dtype):
        return f"k_cache dtype {kv_dt.name} != v_cache dtype {jnp.dtype(v_cache.dtype).name}"
    if kv_dt != jnp.dtype(q.dtype) and kv_dt != jnp.dtype(jnp.float8_e4m3fn):
        return f"KV dtype {kv_dt.name} must match q dtype {jnp.dtype(q.dtype).name} (or be float8_e4m3fn)"
    if window_left is not None and window_left < -1:
        return f"window_left={window_left} must be -1 (off) or >= 0"
    if sinks is not None and tuple(sinks.shape) != (num_q_heads,):
        return f"sinks shape {tuple(sinks.shape)} != (num_q_heads,)=({num_q_heads},)"
    try:  # a KV block and ring that fit in shared memory (FP8 adds the converter's f16 ring)
        choose_block_sizes(
            batch=1,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            max_pages=1,
            m_rows=group * max_seqlen_q,
            kv_itemsize=kv_dt.itemsize,
            q_itemsize=jnp.dtype(q.dtype).itemsize,
            options=options,
        )
    except NotImplementedError as e:
        return str(e)
    from jattn.pallas_kernels.interpret import no_gpu_reason

    return no_gpu_reason()


def auto_skip_reason(q, k_cache, v_cache, **unused) -> str | None:
    """Why automatic dispatch should not pick the mosaic decode for a call it can serve
    (measured slower than the next kernel in auto's order there, see docs/PERF.md), else
    None: auto then runs the Triton kernel where it runs, else xla. ``backend="mosaic"``
    still runs it."""
    del q, v_cache, unused
    num_kv_heads = k_cache.shape[2]
    if num_kv_heads % 8:
        # Few KV heads make small KV blocks (token * num_kv_heads rows) and the aligned
        # tail boxes of the all-heads kernel (measured slower than xla there); heads that
        # kernel cannot tile run on the per-KV-head kernel, measured slower than Triton.
        return (
            f"num_kv_heads={num_kv_heads} is not a multiple of 8: the mosaic decode is correct "
            "but measured slower than the next kernel in auto's order"
        )
    return None


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Everything static about one decode call: shapes, masks, block sizes, options."""

    batch: int
    num_pages: int
    page_size: int
    max_pages: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    q_len: int
    m_rows: int  # q_len * num_q_heads
    q_rows: int  # rows loaded per 64-row tile (m_rows rounded to 8 if one tile)
    m_tiles: int
    is_causal: bool
    window_left: int
    logit_cap: float
    bs: BlockSizes
    interpret: bool
    overlap_qk: bool  # KernelOptions.overlap_qk
    convert_stages: int = 0  # FP8 converter warpgroup's f16 ring slots (0: in-chain upcast)
    balanced: bool = False  # KernelOptions.balanced_splits: the split size follows the lengths

    @property
    def block_n(self):
        return self.bs.block_tokens * self.bs.pages_per_block * self.num_kv_heads

    @property
    def o_rows(self):  # rows of the partial output per (split, request)
        return self.q_rows if self.m_tiles == 1 else self.m_tiles * 64

    @property
    def group(self):
        return self.num_q_heads // self.num_kv_heads


def decode_config(
    *,
    batch,
    num_pages,
    page_size,
    max_pages,
    num_kv_heads,
    num_q_heads,
    head_dim,
    q_len,
    is_causal,
    window_left,
    logit_cap,
    block_sizes,
    kv_itemsize,
    q_itemsize,
    interpret,
    options,
) -> DecodeConfig:
    """The :class:`DecodeConfig` of a call: query rows per request ``q_len *
    num_q_heads`` packed into one tile rounded up to 8 rows (at most 64) or into
    64-row tiles; block sizes from :func:`choose_block_sizes` unless given."""
    m_rows = q_len * num_q_heads
    if m_rows <= 64:
        q_rows, m_tiles = -(-m_rows // 8) * 8, 1
    else:
        q_rows, m_tiles = 64, -(-m_rows // 64)
    convert_stages = convert_stages_for(kv_itemsize, options)
    if block_sizes is not None:
        if block_sizes.compute_wgs not in (1, 2) or m_tiles % block_sizes.compute_wgs:
            raise ValueError(
                f"block_sizes.compute_wgs={block_sizes.compute_wgs}: the {m_tiles} query tile(s) of 64 rows "
                "must split evenly over the compute warpgroups (1, or 2 for an even count)"
            )
        if block_sizes.num_splits < 1:
            raise ValueError(f"block_sizes.num_splits={block_sizes.num_splits} must be >= 1")
        if block_sizes.num_stages < 1:
            raise ValueError(f"block_sizes.num_stages={block_sizes.num_stages} must be >= 1 (the K/V ring's depth)")
        bt, ppb = block_sizes.block_tokens, block_sizes.pages_per_block
        reason = block_reason(bt, ppb, num_kv_heads, page_size)
        if reason:
            raise ValueError(f"block_sizes={block_sizes}: {reason}")
        n = bt * ppb * num_kv_heads
        need = smem_bytes(
            n, head_dim, kv_itemsize, q_itemsize, block_sizes.compute_wgs, block_sizes.num_stages, convert_stages
        )
        if need > SMEM_LIMIT:
            raise ValueError(
                f"block_sizes={block_sizes}: needs {need} bytes of shared memory per CTA, over the "
                f"{SMEM_LIMIT} available (fewer num_stages, a smaller block, or choose_block_sizes with "
                f"convert_stages={convert_stages})"
            )
    bsz = block_sizes or choose_block_sizes(
        options=options,
        batch=batch,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        max_pages=max_pages,
        m_rows=m_rows,
        kv_itemsize=kv_itemsize,
        q_itemsize=q_itemsize,
    )
    return DecodeConfig(
        batch=batch,
        num_pages=num_pages,
        page_size=page_size,
        max_pages=max_pages,
        num_kv_heads=num_kv_heads,
        num_q_heads=num_q_heads,
        head_dim=head_dim,
        q_len=q_len,
        m_rows=m_rows,
        q_rows=q_rows,
        m_tiles=m_tiles,
        is_causal=bool(is_causal),
        window_left=int(window_left if window_left is not None else -1),
        logit_cap=float(logit_cap or 0.0),
        bs=bsz,
        interpret=interpret,
        overlap_qk=options.overlap_qk,
        convert_stages=convert_stages,
        balanced=balanced_for(options, batch, m_rows, kv_itemsize),
    )
