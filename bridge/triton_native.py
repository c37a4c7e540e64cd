"""jattn's Triton kernels launched natively on torch tensors: no JAX in the call.

:func:`mha_decode` (and :func:`mla_decode`, the MLA absorbed decode) runs the paged
decode kernel and the split combine
(``jattn.pallas_kernels.triton_decode`` / ``combine``) as plain Triton launches on
torch's current CUDA stream: no DLPack views, no XLA dispatch, and the launches
can be captured in a torch CUDA graph. Results equal ``jattn.mha_decode_with_kvcache``
on the same data (the JAX path launches the same kernel sources through jax-triton).
On CPU tensors it runs only in a process started with ``TRITON_INTERPRET=1``
(Triton's interpreter, as the CPU tests do).

Example (CUDA)::

    from jattn.bridge import triton_native
    out = triton_native.mha_decode(q, k_cache, v_cache, page_table, cache_seqlens)
"""

from __future__ import annotations

import os

import torch

from .convert import BridgeError

__all__ = [
    "mha_decode",
    "mla_decode",
    "decode_partials",
    "mla_decode_partials",
    "prefill",
    "prefill_tile_plan",
    "set_kv_buffer",
    "set_mla_kv_buffer",
]

_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(t, name, dtypes, ndim, device):
    if not isinstance(t, torch.Tensor):
        raise BridgeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise BridgeError(f"{name}.dtype={t.dtype} must be one of {', '.join(map(str, dtypes))}")
    if t.ndim != ndim:
        raise BridgeError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.device != device:
        raise BridgeError(f"{name} is on {t.device}, q on {device}: all tensors must be on one device")
    if not t.is_contiguous():
        raise BridgeError(
            f"{name} with shape {tuple(t.shape)} and strides {t.stride()} is not contiguous: the kernels "
            "address rows by the dense layout"
        )
    if t.dtype == torch.float8_e4m3fn and t.is_cuda:
        cc = torch.cuda.get_device_capability(t.device)
        if cc < (8, 9):
            raise BridgeError(
                f"{name} is FP8 e4m3, which Triton loads on compute capability 8.9 or newer (this GPU: {cc[0]}.{cc[1]})"
            )


def _desc(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _scalars(device, *values) -> torch.Tensor:
    """An f32 vector of Python scalars on ``device``, filled by kernels rather than
    copied from the host, so that a launch using it can be captured in a CUDA graph."""
    out = torch.empty((len(values),), dtype=torch.float32, device=device)
    for i, x in enumerate(values):
        out[i].fill_(float(x))
    return out


def decode_partials(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    *,
    max_seqlen_q=1,
    is_causal=True,
    window_left=-1,
    logit_cap=0.0,
    softmax_scale=None,
    k_scale=1.0,
    num_splits=None,
):
    """The decode kernel alone, launched on torch tensors (unchecked; :func:`mha_decode`
    checks first): the split partials ``(o f32 [S, bs, q_len * Hq, D], lse f32 [S, bs,
    q_len * Hq])`` (base-2 LSE) for the combine. With several splits, a split without keys
    (LSE -inf) leaves its output rows unwritten: a merge must not read them."""
    import math

    from jattn.pallas_kernels import triton_decode, triton_glue

    bs = page_table.shape[0]
    _, page, hkv, d = k_cache.shape
    hq = q.shape[1]
    grid, params = triton_decode.launch_params(bs, hq, hkv, d, max_seqlen_q, page_table.shape[1] * page, num_splits)
    splits, rows = params["SPLITS"], max_seqlen_q * hq
    sm = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    scale = _scalars(q.device, float(k_scale) * sm)
    o = torch.empty((splits, bs, rows, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((splits, bs, rows), dtype=torch.float32, device=q.device)
    kw = triton_decode._constexprs(
        q,
        k_cache,
        page_table,
        q_len=max_seqlen_q,
        is_causal=is_causal,
        window_left=window_left,
        logit_cap=logit_cap,
        params=params,
    )
    fn = triton_glue.jit(triton_decode._decode_kernel)
    fn[grid](q, k_cache, v_cache, page_table, cache_seqlens, scale, o, lse, num_warps=4, num_stages=2, **kw)
    return o, lse


def mha_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    max_seqlen_q: int = 1,
    is_causal: bool = True,
    window_left: int = -1,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    return_lse: bool = False,
    num_splits: int | None = None,
):
    """Paged decode on torch tensors; arguments and results as ``jattn.mha_decode_with_kvcache``
    (q ``[bs * max_seqlen_q, Hq, D]``, caches ``[pages, page_size, Hkv, D]`` in q's dtype or
    FP8 e4m3, int32 ``page_table [bs, max_pages]`` and ``cache_seqlens [bs]``; scales are
    Python floats). Returns ``out`` in q's dtype, and with ``return_lse`` the natural-log
    LSE f32 ``[bs * max_seqlen_q, Hq]``. Raises :class:`BridgeError` naming the argument
    that breaks a rule (dtype, rank, device, contiguity, shapes)."""
    from jattn.pallas_kernels import triton_decode

    dev = q.device if isinstance(q, torch.Tensor) else None
    _check(q, "q", _Q_DTYPES, 3, dev)
    kv_dtypes = (q.dtype, torch.float8_e4m3fn)
    _check(k_cache, "k_cache", kv_dtypes, 4, dev)
    _check(v_cache, "v_cache", (k_cache.dtype,), 4, dev)
    _check(page_table, "page_table", (torch.int32,), 2, dev)
    _check(cache_seqlens, "cache_seqlens", (torch.int32,), 1, dev)
    bs, hq, d = page_table.shape[0], q.shape[1], q.shape[2]
    if v_cache.shape != k_cache.shape:
        raise BridgeError(f"v_cache.shape={tuple(v_cache.shape)} must equal k_cache.shape={tuple(k_cache.shape)}")
    if k_cache.shape[3] != d:
        raise BridgeError(f"k_cache head_dim={k_cache.shape[3]} must equal q's head_dim={d}")
    if cache_seqlens.shape[0] != bs:
        raise BridgeError(f"cache_seqlens has {cache_seqlens.shape[0]} rows, page_table {bs}")
    if q.shape[0] != bs * max_seqlen_q:
        raise BridgeError(f"q has {q.shape[0]} rows; it must be batch ({bs}) * max_seqlen_q ({max_seqlen_q})")
    if hq % k_cache.shape[2]:
        raise BridgeError(f"num_q_heads={hq} must be a multiple of num_kv_heads={k_cache.shape[2]}")
    if d not in triton_decode.SUPPORTED_HEAD_DIMS or not 1 <= max_seqlen_q <= triton_decode.MAX_Q_LEN:
        raise BridgeError(
            f"head_dim={d} / max_seqlen_q={max_seqlen_q}: the kernel takes head_dim "
            f"{triton_decode.SUPPORTED_HEAD_DIMS} and max_seqlen_q 1..{triton_decode.MAX_Q_LEN}"
        )
    if sinks is not None:  # read densely by the combine kernel
        _check(sinks, "sinks", (torch.float32,), 1, dev)
        if sinks.shape != (hq,):
            raise BridgeError(f"sinks must be f32 [{hq}] (one per query head), got shape {tuple(sinks.shape)}")
    _check_launch_device(dev)

    o_part, lse_part = decode_partials(
        q,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        max_seqlen_q=max_seqlen_q,
        is_causal=is_causal,
        window_left=window_left,
        logit_cap=logit_cap,
        softmax_scale=softmax_scale,
        k_scale=k_scale,
        num_splits=num_splits,
    )
    out, lse = _combine(o_part, lse_part, hq=hq, out_dtype=q.dtype, sinks=sinks, v_scale=v_scale)
    out = out.reshape(bs * max_seqlen_q, hq, d)
    return (out, lse.reshape(bs * max_seqlen_q, hq)) if return_lse else out


def prefill_tile_plan(cu_q, kv_len, num_tiles: int, *, block_m: int, is_causal: bool, window_left: int):
    """``triton_prefill.tile_plan`` on torch tensors, on their device (no host sync,
    capturable in a CUDA graph)."""
    cu_q, kv_len = cu_q.long(), kv_len.long()
    n_q = cu_q[1:] - cu_q[:-1]
    nreq = n_q.shape[0]
    tiles = (n_q + block_m - 1).clamp(min=0) // block_m
    cum = tiles.cumsum(0)
    ids = cum.new_ones(num_tiles).cumsum(0) - 1
    marks = cum.new_zeros(num_tiles + 1)  # segment count: request b ends at tile cum[b]
    marks.index_add_(0, cum[:-1].clamp(max=num_tiles), cum.new_ones(nreq - 1))
    req = marks[:num_tiles].cumsum(0).clamp(max=nreq - 1)
    valid = ids < cum[-1]
    q0 = (ids - (cum - tiles)[req]) * block_m
    n_b, l_b = n_q[req], kv_len[req]
    hi = (l_b - n_b + (q0 + block_m).minimum(n_b)).minimum(l_b) if is_causal else l_b
    lo = (l_b - n_b + q0 - window_left).clamp(min=0) if window_left >= 0 else 0
    work = ((hi - lo).clamp(min=0) + 1).where(valid, -1)
    order = (-work).argsort(stable=True)
    return req.where(valid, -1)[order].int(), q0[order].int()


def prefill(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_kv=None,
    *,
    page_table=None,
    cache_seqlens=None,
    is_causal=True,
    window_left=-1,
    logit_cap=0.0,
    sinks=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    block_m=None,
    block_n=None,
):
    """The kernel launched natively on torch tensors (no JAX): returns ``(out [T, Hq, Dv]
    in q's dtype, lse f32 [T, Hq])``. A prefill with ragged ``k``/``v`` (``cu_seqlens_kv``
    defaults to ``cu_seqlens_q``), or, given ``page_table`` and ``cache_seqlens``, an
    extend over the paged caches ``k``/``v``. Tensors must be contiguous; on CUDA tensors
    it runs on torch's current stream with the tile list computed there (no host sync),
    on CPU tensors only under ``TRITON_INTERPRET=1``."""
    import math

    from jattn.pallas_kernels import triton_glue
    from jattn.pallas_kernels import triton_prefill as tp

    dev = q.device if isinstance(q, torch.Tensor) else None
    _check(q, "q", _Q_DTYPES, 3, dev)
    _check(k, "k", (q.dtype, torch.float8_e4m3fn), 4 if page_table is not None else 3, dev)
    _check(v, "v", (k.dtype,), k.ndim, dev)
    i32 = lambda a: a.int().to(dev).contiguous()  # noqa: E731
    t, hq, d = q.shape
    dv, hkv = v.shape[-1], k.shape[-2]
    if k.shape[-1] != d or tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise BridgeError(
            f"k {tuple(k.shape)} must have q's head_dim={d}, and v {tuple(v.shape)} k's shape but for the last "
            "dimension (head_dim_v)"
        )
    if hkv == 0 or hq % hkv:
        raise BridgeError(f"num_q_heads={hq} must be a multiple of num_kv_heads={hkv} (k's heads)")
    if sinks is not None and len(sinks) != hq:
        raise BridgeError(f"sinks must have {hq} entries (one per query head), got {len(sinks)}")
    paged = page_table is not None
    cu_in = i32(cu_seqlens_q)
    nreq = cu_in.shape[0] - 1
    # The rows past cu_q[-1] (padding) are one more request without keys.
    cu_q = cu_in.new_full((nreq + 2,), t)
    cu_q[: nreq + 1] = cu_in
    kv_start, kv_len = cu_in.new_zeros((nreq + 1,)), cu_in.new_zeros((nreq + 1,))
    if paged:
        kv_len[:nreq] = i32(cache_seqlens)
        pt = cu_in.new_zeros((nreq + 1, page_table.shape[1]))
        pt[:nreq] = i32(page_table)
    else:
        cu_kv = cu_in if cu_seqlens_kv is None else i32(cu_seqlens_kv)
        kv_start[:nreq], kv_len[:nreq] = cu_kv[:-1], cu_kv[1:] - cu_kv[:-1]
        pt = cu_in.new_zeros((nreq + 1, 1))
    sm = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    # Filled by kernels (no host copy), so that a CUDA graph can capture the call.
    params = torch.zeros((2 + hq,), dtype=torch.float32, device=dev)
    params[0:1].fill_(float(k_scale) * sm)
    params[1:2].fill_(float(v_scale))
    if sinks is not None:
        params[2:].copy_(sinks.float().to(dev) if hasattr(sinks, "data_ptr") else _scalars(dev, *sinks))
    major, minor = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else (8, 0)
    bm, bn, warps, stages = tp.launch_params(
        d, dv, sm=10 * major + minor, paged=paged, block_m=block_m, block_n=block_n
    )
    num_tiles = tp.num_tiles_bound(t, nreq + 1, bm)
    tile_req, tile_q0 = prefill_tile_plan(
        cu_q, kv_len, num_tiles, block_m=bm, is_causal=is_causal, window_left=int(window_left)
    )
    o = q.new_empty((t, hq, dv))
    lse = params.new_empty((t, hq))
    kw = tp._constexprs(
        q,
        k,
        v,
        pt,
        paged=paged,
        is_causal=is_causal,
        window_left=window_left,
        logit_cap=logit_cap,
        has_sinks=sinks is not None,
        bm=bm,
        bn=bn,
    )
    fn = triton_glue.jit(tp._prefill_kernel)
    fn[(num_tiles, hq)](
        tile_req.contiguous(),
        tile_q0.contiguous(),
        cu_q,
        kv_start,
        kv_len,
        pt,
        params,
        q,
        k,
        v,
        o,
        lse,
        num_warps=warps,
        num_stages=stages,
        **kw,
    )
    return o, lse


def mla_decode_partials(
    q,
    kv_cache,
    page_table,
    cache_seqlens,
    *,
    kv_lora_rank,
    softmax_scale,
    max_seqlen_q=1,
    is_causal=True,
    kv_scale=1.0,
    num_splits=None,
    tuning=None,
):
    """The Triton MLA decode kernel alone, launched on torch tensors (unchecked): the split
    partials ``(o f32 [S, bs, q_len * H, R], lse f32 [S, bs, q_len * H])`` (base-2 LSE; with
    several splits a split without keys leaves its output rows unwritten); ``tuning``: a
    ``triton_mla.Tuning`` (``triton_mla.choose_tuning``'s when None)."""
    from jattn.pallas_kernels import triton_glue, triton_mla

    bs, h = page_table.shape[0], q.shape[1]
    if tuning is None:
        major, minor = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else (8, 0)
        tuning = triton_mla.choose_tuning(h, max_seqlen_q, kv_cache.element_size(), 10 * major + minor)
    grid, params, launch = triton_mla.launch_params(
        bs, h, max_seqlen_q, page_table.shape[1] * kv_cache.shape[1], num_splits, tuning
    )
    rows = max_seqlen_q * h
    scale = _scalars(q.device, float(softmax_scale) * float(kv_scale))
    o = torch.empty((params["SPLITS"], bs, rows, kv_lora_rank), dtype=torch.float32, device=q.device)
    lse = torch.empty((params["SPLITS"], bs, rows), dtype=torch.float32, device=q.device)
    kw = triton_mla.constexprs(
        q, kv_cache, page_table, kv_lora_rank=kv_lora_rank, q_len=max_seqlen_q, is_causal=is_causal, params=params
    )
    triton_glue.jit(triton_mla._mla_kernel)[grid](q, kv_cache, page_table, cache_seqlens, scale, o, lse, **launch, **kw)
    return o, lse


def _check_launch_device(dev) -> None:
    if dev.type not in ("cpu", "cuda"):
        raise BridgeError(f"q is on {dev}: CUDA tensors only")
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise BridgeError("tensors on the CPU run only under Triton's interpreter (TRITON_INTERPRET=1)")


def _combine(o_part, lse_part, *, hq, out_dtype, sinks=None, v_scale=1.0):
    """The split combine kernel on the partials ``o f32 [S, bs, rows, D]`` / base-2
    ``lse [S, bs, rows]``: ``(out [bs, rows, D] in out_dtype, natural-log lse f32 [bs,
    rows])``, sinks (f32 ``[hq]``) and ``v_scale`` applied."""
    from jattn.pallas_kernels import combine, triton_glue

    splits, bs, rows, d = o_part.shape
    dev = o_part.device
    grid, params = combine.combine_launch_params(splits, bs, rows, d)
    out = torch.empty((bs, rows, d), dtype=out_dtype, device=dev)
    lse = torch.empty((bs, rows), dtype=torch.float32, device=dev)
    sk = sinks if sinks is not None else torch.zeros((hq,), dtype=torch.float32, device=dev)
    vs = _scalars(dev, v_scale)
    triton_glue.jit(combine._combine_kernel)[grid](
        lse_part,
        o_part,
        sk,
        vs,
        out,
        lse,
        NUM_SPLITS=splits,
        BS=bs,
        ROWS=rows,
        ROWS_LSE=rows,
        M_ROWS=rows,
        D=d,
        HQ=hq,
        HAS_SINKS=sinks is not None,
        HAS_VSCALE=float(v_scale) != 1.0,
        num_warps=1,
        num_stages=1,
        **params,
    )
    return out, lse


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    kv_lora_rank: int,
    softmax_scale: float,
    max_seqlen_q: int = 1,
    is_causal: bool = True,
    kv_scale: float = 1.0,
    return_lse: bool = False,
    num_splits: int | None = None,
):
    """MLA absorbed decode on torch tensors; arguments and results as
    ``jattn.mla_decode_with_kvcache``: q ``[bs * max_seqlen_q, H, R + r]`` (the absorbed
    query), the latent cache ``[pages, page_size, R + r]`` in q's dtype or FP8 e4m3
    (``kv_scale``), int32 ``page_table [bs, max_pages]`` and ``cache_seqlens [bs]``.
    Returns the latent output ``[bs * max_seqlen_q, H, R]`` in q's dtype (and the
    natural-log LSE f32 ``[bs * max_seqlen_q, H]``). The decode kernel and the split
    combine run as plain Triton launches on torch's current stream (capturable in a
    CUDA graph). Raises :class:`BridgeError` naming the argument that breaks a rule."""
    from jattn.pallas_kernels import triton_mla

    dev = q.device if isinstance(q, torch.Tensor) else None
    _check(q, "q", _Q_DTYPES, 3, dev)
    _check(kv_cache, "kv_cache", (q.dtype, torch.float8_e4m3fn), 3, dev)
    _check(page_table, "page_table", (torch.int32,), 2, dev)
    _check(cache_seqlens, "cache_seqlens", (torch.int32,), 1, dev)
    bs, h, w = page_table.shape[0], q.shape[1], q.shape[2]
    R, rope = int(kv_lora_rank), kv_cache.shape[2] - int(kv_lora_rank)
    if kv_cache.shape[2] != w:
        raise BridgeError(f"kv_cache is {kv_cache.shape[2]} wide per row, q {w}: both must be kv_lora_rank + rope")
    if R & (R - 1) or rope & (rope - 1) or R < 16 or rope < 16:
        raise BridgeError(f"kv_lora_rank={R} and rope width {rope} must be powers of two >= 16")
    if cache_seqlens.shape[0] != bs:
        raise BridgeError(f"cache_seqlens has {cache_seqlens.shape[0]} rows, page_table {bs}")
    if not 1 <= max_seqlen_q <= triton_mla.MAX_Q_LEN:
        raise BridgeError(f"max_seqlen_q={max_seqlen_q} must be in 1..{triton_mla.MAX_Q_LEN}")
    if q.shape[0] != bs * max_seqlen_q:
        raise BridgeError(f"q has {q.shape[0]} rows; it must be batch ({bs}) * max_seqlen_q ({max_seqlen_q})")
    _check_launch_device(dev)
    o_part, lse_part = mla_decode_partials(
        q,
        kv_cache,
        page_table,
        cache_seqlens,
        kv_lora_rank=R,
        softmax_scale=softmax_scale,
        max_seqlen_q=max_seqlen_q,
        is_causal=is_causal,
        kv_scale=kv_scale,
        num_splits=num_splits,
    )
    out, lse = _combine(o_part, lse_part, hq=h, out_dtype=q.dtype, v_scale=kv_scale)
    out = out.reshape(bs * max_seqlen_q, h, R)
    return (out, lse.reshape(bs * max_seqlen_q, h)) if return_lse else out


def set_kv_buffer(k_cache, v_cache, out_cache_loc, k, v, *, k_scale=None, v_scale=None):
    """``jattn.set_kv_buffer`` on a torch pool, in place: the Triton KV write (FP8
    quantisation fused) launched natively. Caches ``[pages, page_size, Hkv, D]``, k/v
    ``[T, Hkv, D]``, int32 ``out_cache_loc [T]``; slots outside the pool are dropped."""
    from jattn.pallas_kernels import triton_glue, triton_kv_write

    dev = k_cache.device
    _check(out_cache_loc, "out_cache_loc", (torch.int32,), 1, dev)
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        _check(cache, f"{name}_cache", (cache.dtype,), 4, dev)
        _check(t, name, (t.dtype,), 3, dev)
        if t.shape[0] != out_cache_loc.shape[0] or tuple(t.shape[1:]) != tuple(cache.shape[2:]):
            raise BridgeError(
                f"{name} {tuple(t.shape)} must be [{out_cache_loc.shape[0]}, {', '.join(map(str, cache.shape[2:]))}]"
            )
    if v_cache.dtype != k_cache.dtype or v_cache.shape[:3] != k_cache.shape[:3]:  # one slot count, one FP8 flag
        raise BridgeError(
            f"v_cache {v_cache.dtype} {tuple(v_cache.shape)} must have k_cache's dtype ({k_cache.dtype}) and "
            f"pages, page size and heads {tuple(k_cache.shape[:3])}"
        )
    if k.shape[0] == 0 or 0 in k_cache.shape[:3]:  # nothing to write (and no empty launch)
        return k_cache, v_cache
    num_pages, page, hkv, d = k_cache.shape
    dv = v_cache.shape[3]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    grid, params = triton_kv_write.launch_params(k.shape[0], num_pages * page, hkv * d, hkv * dv, fp8)
    scales = _scalars(dev, 1.0 if k_scale is None else k_scale, 1.0 if v_scale is None else v_scale)
    triton_glue.jit(triton_kv_write._kv_write_kernel)[grid](
        k,
        v,
        out_cache_loc,
        scales,
        k_cache,
        v_cache,
        ROW_K=hkv * d,
        ROW_V=hkv * dv,
        **params,
    )
    return k_cache, v_cache


def set_mla_kv_buffer(kv_cache, out_cache_loc, c_kv, k_pe, *, kv_scale=None):
    """``jattn.set_mla_kv_buffer`` on a torch latent pool, in place: the Triton latent write
    (FP8 quantisation fused) launched natively. Cache ``[pages, page_size, R + r]``, c_kv
    ``[T, R]`` or ``[T, 1, R]``, k_pe ``[T, r]`` or ``[T, 1, r]``, int32
    ``out_cache_loc [T]``; slots outside the pool are dropped."""
    from jattn.pallas_kernels import triton_glue, triton_kv_write, triton_mla_kv_write

    dev = kv_cache.device
    _check(kv_cache, "kv_cache", (kv_cache.dtype,), 3, dev)
    _check(out_cache_loc, "out_cache_loc", (torch.int32,), 1, dev)
    t = out_cache_loc.shape[0]
    widths = []
    for name, x in (("c_kv", c_kv), ("k_pe", k_pe)):
        if not isinstance(x, torch.Tensor) or x.ndim not in (2, 3):
            raise BridgeError(f"{name} must be a torch.Tensor [{t}, width] or [{t}, 1, width], got {_desc(x)}")
        _check(x, name, (x.dtype,), x.ndim, dev)
        if not x.is_floating_point() or x.shape[0] != t or (x.ndim == 3 and x.shape[1] != 1):
            raise BridgeError(f"{name} {tuple(x.shape)} must be float rows [{t}, width] or [{t}, 1, width]")
        widths.append(x.shape[-1])
    if sum(widths) != kv_cache.shape[2]:
        raise BridgeError(
            f"c_kv {tuple(c_kv.shape)} + k_pe {tuple(k_pe.shape)} must give rows of width {kv_cache.shape[2]}"
        )
    if t == 0 or 0 in kv_cache.shape[:2]:  # nothing to write (and no empty launch)
        return kv_cache
    num_pages, page, w = kv_cache.shape
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    grid, params = triton_kv_write.launch_params(t, num_pages * page, w, w, fp8)
    triton_glue.jit(triton_mla_kv_write._mla_kv_write_kernel)[grid](
        c_kv,
        k_pe,
        out_cache_loc,
        _scalars(dev, 1.0 if kv_scale is None else kv_scale),
        kv_cache,
        R=widths[0],
        RPE=widths[1],
        **params,
    )
    return kv_cache
