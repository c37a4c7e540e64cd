"""``python -m jattn bench bridge``: the torch bridge's overhead (GPU).

1. Decode throughput at batch 64, length 4096, Llama-3-8B attention shape (GQA
   32/8, head_dim 128, page 16, bf16), called from torch through
   ``TorchMHABackend.forward_decode`` versus the same jitted JAX decode called
   natively; many back-to-back calls over several layers (different pools), the
   per-call time is wall time / calls after a sync (the GPU-bound regime).
2. Host time of one torch-side ``forward_decode`` at batch 1 (median of many calls,
   no sync inside the timed region) and its parts.
Targets (issue 4): <= 5% slower than native at B64 x 4096; <= 80 us at batch 1.
"""

from __future__ import annotations

import argparse
import statistics
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


def _setup(bs, seqlen, layers, sync, kv_writer="auto"):
    import torch

    from jattn import ForwardMode, MHAConfig
    from jattn.bridge import AttentionLayer, TorchKVPool, TorchMHABackend

    hq, hkv, d, ps = 32, 8, 128, 16
    pages_per = seqlen // ps
    num_pages = bs * pages_per + 1
    cfg = MHAConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps, context_len=seqlen,
                    num_pages=num_pages)
    pool = TorchKVPool(num_layers=layers, num_pages=num_pages, page_size=ps, num_kv_heads=hkv, head_dim=d,
                       device="cuda")
    for i in range(layers):
        pool.get_key_buffer(i).normal_()
        pool.get_value_buffer(i).normal_()
    be = TorchMHABackend(cfg, sync=sync, kv_writer=kv_writer)
    be.init_cuda_graph_state(max(bs, 1))
    rng = np.random.default_rng(0)
    r2p = torch.from_numpy(rng.permutation(np.arange(1, num_pages))[: bs * pages_per].reshape(bs, pages_per)
                           .astype(np.int32))
    be.init_forward_metadata(bs, 0, torch.arange(bs), torch.full((bs,), seqlen), r2p, ForwardMode.DECODE)
    lys = [AttentionLayer(i, hq, hkv, d) for i in range(layers)]
    q = torch.randn(bs, hq * d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(bs, hkv * d, dtype=torch.bfloat16, device="cuda")
    return be, pool, lys, q, k, cfg


def bench_throughput(bs=64, seqlen=4096, layers=4, calls=64, sync="event"):
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
    kcs = [jax.random.normal(jax.random.key(i), pool.get_key_buffer(0).shape, jnp.bfloat16).reshape(-1, 16, 8, 128)
           for i in range(layers)]
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
    return t_torch, t_native


def bench_host(sync="event"):
    import torch

    be, pool, lys, q, k, _ = _setup(1, 4096, 1, sync)
    layer = lys[0]
    call = lambda: be.forward_decode(q, k, k, layer, None, pool, 1, save_kv_cache=True)  # noqa: E731
    t_call = _host_us(call)
    torch.cuda.synchronize()
    # parts
    parts = {}
    parts["torch.cat staging"] = _host_us(lambda: be._staged(("mha", "decode", 32, 8, 128), [q, k, k], 1))
    parts["fence torch->jax (import)"] = _host_us(be.sync.before_jax)
    out = jnp.ones((1, 4096), jnp.bfloat16)
    parts["fence jax->torch (__dlpack__ stream)"] = _host_us(lambda: be.sync.after_jax(out))
    t = torch.ones(8, device="cuda")
    parts["jax.dlpack.from_dlpack (reference)"] = _host_us(lambda: jax.dlpack.from_dlpack(t))
    parts["torch.from_dlpack (reference)"] = _host_us(lambda: torch.from_dlpack(out))
    parts["forward_decode, save_kv_cache=False (no KV donation)"] = _host_us(
        lambda: be.forward_decode(q, None, None, layer, None, pool, 1))
    for mode in ("none", "host"):
        be.sync.mode = mode
        parts[f"forward_decode with sync={mode}"] = _host_us(call)
    be.sync.mode = sync
    # the bare jitted call on cached arguments
    fkey, fn = next(iter(be._fns.items()))
    stage = next(iter(be._stage.values()))[1]
    views = [v for v in be._views.values()]
    ov = next(iter(be._outs.values()))
    md = be.forward_metadata
    fence = be.sync._fence_j

    def bare():
        out, kvs, _ = fn(stage, [v.jax for v in views], ov.jax, md, (None,), fence)
        ov.jax = out
        for v, a in zip(views, kvs):
            v.jax = a
    parts["bare jitted call (donating, cached args)"] = _host_us(bare)
    torch.cuda.synchronize()
    return t_call, parts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jattn bench bridge")
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--sync", default="event", choices=["event", "host", "none"])
    a = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("bench bridge needs a GPU (JAX backend is %s)" % jax.default_backend())
        return 1
    t_call, parts = bench_host(a.sync)
    print(f"host time of one torch-side forward_decode at batch 1 (sync={a.sync}): {t_call:.1f} us (target <= 80)")
    for k_, v_ in parts.items():
        print(f"  {k_}: {v_:.1f} us")
    t_torch, t_native = bench_throughput(a.bs, a.seqlen, a.layers, a.calls, a.sync)
    rel = t_torch / t_native - 1
    print(f"decode B{a.bs} L{a.seqlen} GQA 32/8 D128 page 16 bf16, {a.calls} calls over {a.layers} layers:")
    print(f"  torch bridge {t_torch * 1e6:.1f} us/call, JAX native {t_native * 1e6:.1f} us/call, "
          f"overhead {rel * 100:+.1f}% (target <= +5%)")
    return 0
