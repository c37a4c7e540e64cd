"""A synthetic continuous-batching attention loop that checks itself.

Requests arrive at different steps with different prompt lengths; each step is
either a prefill (extend) batch of the newly arrived requests or a decode batch
of the running ones. Pages come from a :class:`PageAllocator` and go back when a
request finishes. Each decode batch bucket, and each prefill batch and token bucket,
compiles once into a jitted step with the KV cache donated. At the end every output row
is compared with a dense float64 computation over that request's own keys.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jattn.backends import ForwardMode, LayerSpec, MHABackend, MHAConfig
from jattn.dispatch import MHA_OPS
from jattn.kv_cache import PageAllocator, PagedKVCache, cache_dtype
from jattn.ops import KERNELS, device_kind, op_backend


def backend_choices() -> tuple[str, ...]:
    """What ``--backend`` accepts: auto, the kernel backends with a kernel built, xla."""
    return ("auto", *KERNELS, "xla")


def choose_backend(name: str | None, ops=MHA_OPS) -> tuple[str | None, str | None]:
    """``(kernel_backend, notice)`` for ``--backend name`` in a loop that calls ``ops``.

    A backend named on the command line is the preference for the ops it serves on this
    device; the others run on xla, and ``notice`` (one line) says which. When it cannot serve
    every op, the loop runs on auto (which takes ``name`` for the ops it serves, call by call,
    except where measured slower). Raises ``SystemExit`` with one line when one backend
    setting cannot express the preference (auto would not pick ``name`` for the ops it serves).
    """
    if name in (None, "auto", "xla"):
        return (None if name in (None, "auto") else name), None
    if device_kind() == "cpu":
        return None, (
            f"--backend {name}: its kernels need a GPU (on this CPU they run only under "
            "the interpreter, for tests); every op runs on xla"
        )
    picks = {op: op_backend(op, name) for op in ops}
    missing = [op for op, (b, _) in picks.items() if b != name]
    if not missing:
        return name, None
    served = [op for op in ops if op not in missing]
    if any(op_backend(op)[0] != name for op in served):
        raise SystemExit(
            f"--backend {name}: serves {', '.join(served)} but not {', '.join(missing)} "
            "here, and one loop takes one backend; use --backend auto or xla"
        )
    reasons = sorted({picks[op][1].split(": ", 1)[-1] for op in missing})
    # one setting for all ops: auto, which picks ``name`` for these ops where it serves the call
    # and is not measured slower than xla (see jattn.ops)
    where = f"; {', '.join(served)} on {name} where auto picks it" if served else ""
    return None, f"--backend {name}: {', '.join(missing)} on xla ({'; '.join(reasons)}){where}"


class _Request:
    def __init__(self, rid, prompt_len, gen_len, arrival, rng, hq, hkv, d):
        self.rid, self.prompt_len, self.gen_len, self.arrival = rid, prompt_len, gen_len, arrival
        total = prompt_len + gen_len
        self.q = rng.standard_normal((total, hq, d)).astype(np.float32)
        self.k = rng.standard_normal((total, hkv, d)).astype(np.float32)
        self.v = rng.standard_normal((total, hkv, d)).astype(np.float32)
        self.out = np.full((total, hq, d), np.nan, np.float32)
        self.pages: list[int] = []
        self.len = 0  # tokens in the cache

    @property
    def done(self):
        return self.len >= self.prompt_len + self.gen_len


def _dense(req, window_left):
    """float64 causal attention of every position over the request's own keys."""
    total = req.len
    hq, d = req.q.shape[1:]
    g = hq // req.k.shape[1]
    k = np.repeat(req.k[:total].astype(np.float64), g, axis=1)
    v = np.repeat(req.v[:total].astype(np.float64), g, axis=1)
    s = np.einsum("qhd,khd->hqk", req.q[:total].astype(np.float64), k) / np.sqrt(d)
    i = np.arange(total)
    mask = i[None, :] <= i[:, None]
    if window_left >= 0:
        mask &= i[None, :] >= i[:, None] - window_left
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


_MAX_PROMPT = 100  # prompts of 1 to 99 tokens
MAX_REQUESTS = 256


def run(
    *,
    num_requests=12,
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=64,
    page_size=16,
    num_pages=None,
    max_new=24,
    window_left=-1,
    dtype="bfloat16",
    backend=None,
    seed=0,
    verbose=True,
    asked=None,
):
    """The synthetic serving loop and its self-check against dense attention: ``(passed, the
    largest error, jitted step compilations)``. ``asked``: the ``--backend`` the command line
    named, shown beside ``backend`` (what the loop runs) where they differ."""
    rng = np.random.default_rng(seed)
    if num_pages is None:  # every request at its longest at once, and the reserved page 0
        num_pages = num_requests * PageAllocator.pages_for(_MAX_PROMPT + max_new, page_size) + 1
    cfg = MHAConfig(
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        context_len=512,
        num_pages=num_pages,
        kv_cache_dtype=dtype,
        kernel_backend=backend,
        batch_buckets=tuple(1 << i for i in range(max(4, (num_requests - 1).bit_length()) + 1)),
    )
    be = MHABackend(cfg)
    layer = LayerSpec(0, num_q_heads, num_kv_heads, head_dim, sliding_window_size=window_left)
    cache = PagedKVCache.create(
        num_layers=1,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
    )
    alloc = PageAllocator(num_pages)
    pending = [
        _Request(
            i,
            int(rng.integers(1, _MAX_PROMPT)),
            int(rng.integers(1, max_new)),
            int(rng.integers(0, 16)),
            rng,
            num_q_heads,
            num_kv_heads,
            head_dim,
        )
        for i in range(num_requests)
    ]
    pending.sort(key=lambda r: r.arrival)
    running: list[_Request] = []
    finished: list[_Request] = []
    req_to_page = np.zeros((num_requests, cfg.max_num_pages), np.int32)
    compiles = {"n": 0}
    dtype = cache_dtype(dtype)
    qdt = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16

    def _decode(cache, md, q, k, v):
        compiles["n"] += 1  # runs only while tracing
        return be.forward_decode(q, k, v, layer, cache, md)

    def _extend(cache, md, q, k, v):
        compiles["n"] += 1
        return be.forward_extend(q, k, v, layer, cache, md)

    decode_step = jax.jit(_decode, donate_argnums=0)
    extend_step = jax.jit(_extend, donate_argnums=0)

    def grow(req, new_len):
        need = PageAllocator.pages_for(new_len, page_size) - len(req.pages)
        if need > 0:
            req.pages += alloc.alloc(need)
            req_to_page[req.rid, : len(req.pages)] = req.pages

    step, tokens, t0 = 0, 0, time.perf_counter()
    while pending or running:
        arrived = [r for r in pending if r.arrival <= step]
        if arrived:  # prefill the newcomers
            pending = [r for r in pending if r.arrival > step]
            for r in arrived:
                grow(r, r.prompt_len)
            md = be.init_forward_metadata(
                len(arrived),
                np.array([r.rid for r in arrived]),
                np.array([r.prompt_len for r in arrived]),
                req_to_page,
                ForwardMode.EXTEND,
                extend_seq_lens=np.array([r.prompt_len for r in arrived]),
            )
            t = md.num_tokens
            q = np.zeros((t, num_q_heads, head_dim), np.float32)
            k = np.zeros((t, num_kv_heads, head_dim), np.float32)
            v = np.zeros_like(k)
            cu = np.asarray(md.cu_seqlens_q)
            for b, r in enumerate(arrived):
                sl = slice(cu[b], cu[b + 1])
                q[sl], k[sl], v[sl] = r.q[: r.prompt_len], r.k[: r.prompt_len], r.v[: r.prompt_len]
            out, cache = extend_step(cache, md, jnp.asarray(q, qdt), jnp.asarray(k, qdt), jnp.asarray(v, qdt))
            out = np.asarray(out, np.float32).reshape(t, num_q_heads, head_dim)
            for b, r in enumerate(arrived):
                r.out[: r.prompt_len] = out[cu[b] : cu[b + 1]]
                r.len = r.prompt_len
            tokens += int(cu[len(arrived)])
            running += arrived
        elif running:  # one decode token for every running request
            for r in running:
                grow(r, r.len + 1)
            md = be.init_forward_metadata(
                len(running),
                np.array([r.rid for r in running]),
                np.array([r.len + 1 for r in running]),
                req_to_page,
                ForwardMode.DECODE,
            )
            bs = md.batch_size
            q = np.zeros((bs, num_q_heads, head_dim), np.float32)
            k = np.zeros((bs, num_kv_heads, head_dim), np.float32)
            v = np.zeros_like(k)
            for b, r in enumerate(running):
                q[b], k[b], v[b] = r.q[r.len], r.k[r.len], r.v[r.len]
            out, cache = decode_step(cache, md, jnp.asarray(q, qdt), jnp.asarray(k, qdt), jnp.asarray(v, qdt))
            out = np.asarray(out, np.float32).reshape(bs, num_q_heads, head_dim)
            for b, r in enumerate(running):
                r.out[r.len] = out[b]
                r.len += 1
            tokens += len(running)
        for r in [r for r in running if r.done]:
            alloc.free(r.pages)
            r.pages = []
            running.remove(r)
            finished.append(r)
        step += 1
    jax.block_until_ready(cache)
    elapsed = time.perf_counter() - t0

    worst = 0.0
    for r in finished:
        ref = _dense(r, window_left)
        worst = max(worst, float(np.abs(r.out - ref).max()))
    tol = {1: 0.25, 2: 3e-2}.get(dtype.itemsize, 1e-4)
    ok = worst <= tol and alloc.num_free == num_pages - 1
    if verbose:
        print(f"jattn synthetic serving demo: {num_requests} requests, {step} steps, {tokens} tokens")
        label = backend or ("auto: every op on xla here" if device_kind() == "cpu" else "auto")
        if asked not in (None, "auto", backend):
            label += f" (--backend {asked} asked for: see the line above)"
        print(f"  device: {jax.devices()[0].device_kind} ({device_kind()}), kernel backend: {label}")
        print(
            f"  attention: {num_q_heads} q heads / {num_kv_heads} kv heads, head_dim {head_dim}, "
            f"page {page_size}, kv cache {dtype}"
        )
        print(
            f"  jitted step compilations: {compiles['n']} (one per decode batch bucket, one per prefill batch "
            "and token bucket)"
        )
        print(f"  throughput: {tokens / elapsed:,.0f} tokens/s (wall {elapsed:.2f} s, compiles included)")
        print(
            f"  max |out - dense float64| = {worst:.2e} (tolerance {tol:.2g}); pages all freed: "
            f"{alloc.num_free == num_pages - 1}"
        )
        print("  check:", "PASSED" if ok else "FAILED")
    return ok, worst, compiles["n"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="python -m jattn demo --synthetic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--requests", type=int, default=12, help="number of requests (default 12)")
    ap.add_argument("--window", type=int, default=-1, help="sliding window, window_left (-1: off)")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32", "float8_e4m3fn"],
        help="KV cache dtype (default bfloat16)",
    )
    ap.add_argument(
        "--backend",
        default="auto",
        choices=backend_choices(),
        help="kernel backend preferred for the ops it serves (default auto)",
    )
    ap.add_argument("--seed", type=int, default=0, help="random seed of the requests")
    a = ap.parse_args(argv)
    if not 1 <= a.requests <= MAX_REQUESTS:
        ap.error(
            f"--requests {a.requests}: must be an integer from 1 (a check over no requests checks nothing) "
            f"to {MAX_REQUESTS}"
        )
    if a.seed < 0:
        ap.error(f"--seed {a.seed}: must be an integer >= 0")
    if a.window < -1:
        ap.error(f"--window {a.window}: must be an integer >= -1 (-1: no window)")
    backend, notice = choose_backend(a.backend, MHA_OPS)
    if notice:
        print(notice, file=sys.stderr)
    ok, _, _ = run(
        num_requests=a.requests, window_left=a.window, dtype=a.dtype, backend=backend, seed=a.seed, asked=a.backend
    )
    return 0 if ok else 1
