"""``python -m jattn bench bridge``: the torch bridge's overhead (GPU; ``--device cpu``: host time only).

1. Decode throughput at batch 64, length 4096, Llama-3-8B attention shape (GQA
   32/8, head_dim 128, page 16, bf16), called from torch through
   ``TorchMHABackend.forward_decode`` versus the same jitted JAX decode called
   natively; many back-to-back calls over several layers (different pools), the
   per-call time is wall time / calls after a sync (the GPU-bound regime).
2. Host time of one torch-side ``forward_decode`` at batch 1 (median of many calls,
   no sync inside the timed region) and its parts.
Targets: <= 5% slower than native at B64 x 4096; <= 80 us at batch 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def _host_us(fn, n=300, warm=20):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


TORCH_MISSING = (
    'bench bridge needs PyTorch: pip install -e ".[torch]" in the jattn checkout; on a '
    "CPU-only machine: pip install torch --index-url https://download.pytorch.org/whl/cpu"
)


def _setup(bs, seqlen, layers, sync, kv_writer="auto", device="cuda", heads=(32, 8, 128), **bekw):
    import torch

    from jattn import ForwardMode, MHAConfig
    from jattn.bridge import AttentionLayer, TorchKVPool, TorchMHABackend

    (hq, hkv, d), ps = heads, 16
    pages_per = seqlen // ps
    num_pages = bs * pages_per + 1
    cfg = MHAConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps, context_len=seqlen, num_pages=num_pages)
    pool = TorchKVPool(
        num_layers=layers, num_pages=num_pages, page_size=ps, num_kv_heads=hkv, head_dim=d, device=device
    )
    for i in range(layers):
        pool.get_key_buffer(i).normal_()
        pool.get_value_buffer(i).normal_()
    be = TorchMHABackend(cfg, sync=sync, kv_writer=kv_writer, **bekw)
    be.init_cuda_graph_state(max(bs, 1))
    rng = np.random.default_rng(0)
    r2p = torch.from_numpy(
        rng.permutation(np.arange(1, num_pages))[: bs * pages_per].reshape(bs, pages_per).astype(np.int32)
    )
    be.init_forward_metadata(bs, 0, torch.arange(bs), torch.full((bs,), seqlen), r2p, ForwardMode.DECODE)
    lys = [AttentionLayer(i, hq, hkv, d) for i in range(layers)]
    q = torch.randn(bs, hq * d, dtype=torch.bfloat16, device=device)
    k = torch.randn(bs, hkv * d, dtype=torch.bfloat16, device=device)
    return be, pool, lys, q, k, cfg


def _sync_all():
    import torch

    if torch.cuda.is_available() and jax.default_backend() == "gpu":
        torch.cuda.synchronize()


def bench_throughput(bs=64, seqlen=4096, layers=4, calls=64, sync="auto"):
    """(torch-side s/call, JAX-native s/call, the sync mode the backend used)."""
    import torch

    from jattn import ops

    be, pool, lys, q, k, cfg = _setup(bs, seqlen, layers, sync)

    def torch_side():
        for i in range(calls):
            be.forward_decode(q, k, k, lys[i % layers], None, pool, bs, save_kv_cache=True)

    torch_side()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch_side()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    t_torch = statistics.median(ts) / calls

    # the same jitted decode + write, JAX-native on JAX-owned arrays (donated caches)
    md = be.forward_metadata
    kcs = [
        jax.random.normal(jax.random.key(i), pool.get_key_buffer(0).shape, jnp.bfloat16).reshape(-1, 16, 8, 128)
        for i in range(layers)
    ]
    vcs = [c + 0 for c in kcs]
    qj = jnp.ones((bs, 32, 128), jnp.bfloat16)
    kj = jnp.ones((bs, 8, 128), jnp.bfloat16)

    def step(qj, kj, kc, vc, md):
        kc, vc = ops.set_kv_buffer(kc, vc, md.out_cache_loc, kj, kj)
        o = ops.mha_decode_with_kvcache(qj, kc, vc, md.page_table, md.cache_seqlens, backend=cfg.kernel_backend)
        return o, kc, vc

    step = jax.jit(step, donate_argnums=(2, 3))

    def native():
        out = None
        for i in range(calls):
            j = i % layers
            out, kcs[j], vcs[j] = step(qj, kj, kcs[j], vcs[j], md)
        return out

    jax.block_until_ready(native())
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(native())
        ts.append(time.perf_counter() - t0)
    t_native = statistics.median(ts) / calls
    return t_torch, t_native, be.sync.mode


def _bare_call(be):
    """A no-argument call of the cached jitted function of the last ``forward_decode`` on
    its cached arguments: the bridge's call machinery without staging or fences."""
    fenced = be.sync.jax_fence
    fn = next(f for key, f in be._fns.items() if key[-1] == fenced)
    ent = next(iter(be._stage.values()))
    md, views = be._md_call, list(be._views.values())
    fence = (be.sync._fence_j,) if fenced else ()
    if be.alias_out:
        ov = next(iter(be._outs.values()))

        def bare():
            out, kvs, *_ = fn(ent[1], [v.jax for v in views], ov.jax, md, (None,), *fence)
            ov.jax = out
            for v, a in zip(views, kvs):
                v.jax = a
    else:  # CPU: the torch writer; the jitted call only reads

        def bare():
            return fn(ent[1], [], md, (None, views[0].jax, views[1].jax), *fence)

    return bare


def bench_host(sync="auto", device="cuda", seqlen=4096, n=300):
    """Host time of one batch-1 ``forward_decode`` (no sync in the timed region).

    Returns ``(t_call, parts)``: the whole call with ``sync`` and its parts. On the
    CPU the JAX -> torch fence waits for the result (torch CPU ops are synchronous),
    so ``sync="none"`` there isolates the Python overhead."""
    import torch

    heads = (32, 8, 128) if device == "cuda" else (8, 2, 64)  # CPU: small, so the compute is tiny
    be, pool, lys, q, k, _ = _setup(1, seqlen, 1, sync, device=device, heads=heads)
    sync = be.sync.mode  # "auto" resolved
    layer = lys[0]
    call = lambda: be.forward_decode(q, k, k, layer, None, pool, 1, save_kv_cache=True)  # noqa: E731
    t_call = _host_us(call, n)
    _sync_all()
    parts = {}
    parts["forward_decode, save_kv_cache=False (read-only)"] = _host_us(
        lambda: be.forward_decode(q, None, None, layer, None, pool, 1), n
    )
    for mode in ("none", "host", "event") + (("stream",) if jax.default_backend() == "gpu" else ()):
        if mode == sync:
            continue
        be.sync.mode = mode
        parts[f"forward_decode with sync={mode}"] = _host_us(call, n)
        parts[f"forward_decode with sync={mode}, read-only"] = _host_us(
            lambda: be.forward_decode(q, None, None, layer, None, pool, 1), n
        )
    be.sync.mode = sync
    if be.stream is not None:
        with torch.cuda.stream(be.stream):
            parts["forward_decode with torch on XLA's stream (backend.stream): no fences"] = _host_us(call, n)
            parts["the same, read-only"] = _host_us(lambda: be.forward_decode(q, None, None, layer, None, pool, 1), n)
        _sync_all()
    if jax.default_backend() == "gpu" and sync in ("event", "stream"):
        # Which fence makes the whole call slower than the sum of its parts.
        before, after = be.sync.before_jax, be.sync.after_jax
        be.sync.after_jax = lambda out: None
        parts["forward_decode with the torch->jax fence only"] = _host_us(call, n)
        be.sync.after_jax, be.sync.before_jax = after, (lambda: be.sync._fence_j)
        parts["forward_decode with the jax->torch fence only"] = _host_us(call, n)
        be.sync.after_jax = lambda out: out.block_until_ready()
        parts["forward_decode with block_until_ready instead of the jax->torch fence, no torch->jax"] = _host_us(
            call, n
        )
        be.sync.before_jax, be.sync.after_jax = before, after
        _sync_all()
    be.fast_path = False  # the path before the per-layer closures: everything re-derived per call
    for mode in ("none", sync):
        be.sync.mode = mode
        parts[f"slow path (fast_path=False), sync={mode}"] = _host_us(call, n)
    be.sync.mode, be.fast_path = sync, True
    stage = torch.empty_like(q)
    parts["torch copy_ of q (the staging copy)"] = _host_us(lambda: stage.copy_(q), n)
    parts["fence torch->jax"] = _host_us(be.sync.before_jax, n)
    out = jnp.ones((1, 4096), jnp.bfloat16)
    tiny = jax.jit(lambda x: x + 1)
    x1 = jnp.ones((4,), jnp.float32)
    parts["reference: a trivial jitted call (jit dispatch floor)"] = _host_us(lambda: tiny(x1), n)
    if jax.default_backend() == "gpu":
        parts["fence jax->torch"] = _host_us(lambda: be.sync.after_jax(out), n)
        t = torch.ones(8, device=device)
        parts["jax.dlpack.from_dlpack (reference)"] = _host_us(lambda: jax.dlpack.from_dlpack(t), n)
        parts["torch.from_dlpack (reference)"] = _host_us(lambda: torch.from_dlpack(out), n)
    try:  # the jitted body alone; this reads the bridge's private call cache (jattn.bridge.call)
        bare = _bare_call(be)
        parts["bare jitted call on cached arguments (no fences)"] = _host_us(bare, n)
    except Exception as e:  # noqa: BLE001 - a diagnostic row; the bridge's internals may have moved
        print(f"(bare jitted call row skipped: the bridge's call cache changed: {type(e).__name__}: {e})")
    _sync_all()
    return t_call, parts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="python -m jattn bench bridge",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--bs", type=int, default=64, help="batch of the throughput part (GPU; default 64)")
    ap.add_argument("--seqlen", type=int, default=4096, help="context of the throughput part (default 4096)")
    ap.add_argument("--layers", type=int, default=4, help="layers (pools) the calls rotate over (default 4)")
    ap.add_argument("--calls", type=int, default=64, help="back-to-back calls per timing (default 64)")
    ap.add_argument(
        "--sync",
        default="auto",
        choices=["auto", "event", "stream", "host", "none"],
        help="the bridge's torch/JAX ordering mode (default auto)",
    )
    ap.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cuda", "cpu"],
        help="cpu: host-time part only, small shapes (the Python overhead; JAX on the CPU)",
    )
    ap.add_argument("--host-seqlen", type=int, default=None, help="context of the batch-1 host-time call")
    ap.add_argument("--reps", type=int, default=300, help="timed calls per host-time figure")
    a = ap.parse_args(argv)
    for option, value in (("--bs", a.bs), ("--seqlen", a.seqlen), ("--layers", a.layers), ("--calls", a.calls)):
        if value < 1:
            ap.error(f"{option} takes a positive integer (got {value})")
    if a.reps < 1 or (a.host_seqlen is not None and a.host_seqlen < 1):
        ap.error(f"--reps and --host-seqlen take positive integers (got {a.reps}, {a.host_seqlen})")
    try:
        import torch  # noqa: F401
    except ImportError:
        print(TORCH_MISSING, file=sys.stderr)
        return 1
    on_gpu = jax.default_backend() == "gpu"
    device = a.device if a.device != "auto" else ("cuda" if on_gpu else "cpu")
    if (device == "cuda") != on_gpu:
        print(
            f"bench bridge --device {device} needs JAX on the same platform (JAX backend is "
            f"{jax.default_backend()}); use --device {'cuda' if on_gpu else 'cpu'}"
        )
        return 1
    heads = "32/8 D128" if on_gpu else "8/2 D64"
    host_seqlen = a.host_seqlen if a.host_seqlen is not None else (4096 if on_gpu else 64)
    t_call, parts = bench_host(a.sync, device, host_seqlen, a.reps)
    what = f"host: forward_decode B1 L{host_seqlen} H{heads} save_kv_cache=True, sync={a.sync} (target <= 80)"
    rows = [(what, t_call)]
    rows += [("host: " + k_, v_) for k_, v_ in parts.items()]
    if on_gpu:
        shape = f"B{a.bs} L{a.seqlen} GQA 32/8 D128 page 16 bf16, {a.calls} calls / {a.layers} layers"
        for i, mode in enumerate(dict.fromkeys([a.sync, "event", "stream"])):
            t_torch, t_native, used = bench_throughput(a.bs, a.seqlen, a.layers, a.calls, mode)
            if i == 0:
                rows.append((f"decode {shape}: JAX native, us/call", t_native * 1e6))
            rows += [
                (f"decode {shape}: torch bridge sync={mode} ({used}), us/call", t_torch * 1e6),
                (f"decode overhead vs native, sync={mode}, % (target <= +5)", (t_torch / t_native - 1) * 100),
            ]
    w = max(len(r[0]) for r in rows)
    print(f"\nbench bridge ({jax.default_backend()}, jax {jax.__version__})")
    print(f"{'what'.ljust(w)}  {'us':>8}")
    for k_, v_ in rows:
        print(f"{k_.ljust(w)}  {v_:8.1f}")
    return 0
