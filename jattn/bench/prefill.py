"""``python -m jattn bench prefill``: ragged prefill / paged extend on the GPU.

Rows are (head dims, heads, request lengths). Each row times jattn's Mosaic GPU
kernel beside the peers that run here: FlashAttention-3 (``flash-attn3-jax``,
varlen) and cuDNN (``jax.nn.dot_product_attention``, equal lengths only), and
reports TFLOP/s (causal FLOPs count only the visible half) against the measured
bf16 matmul rate. Calls are timed inside one jit with distinct inputs
(``jattn.bench.common.time_rotated``).
"""

from __future__ import annotations

import argparse
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jattn.bench import common

# (label, Hq, Hkv, D, Dv, causal, lengths)
ROWS = (
    ("1x4096", 32, 8, 128, 128, True, (4096,)),
    ("4x4096", 32, 8, 128, 128, True, (4096,) * 4),
    ("1x16384", 32, 8, 128, 128, True, (16384,)),
    ("ragged mix", 32, 8, 128, 128, True, (8192, 2048, 1000, 512, 512, 97, 1)),
    ("4x4096 nc", 32, 8, 128, 128, False, (4096,) * 4),
    ("4x4096 d64", 32, 8, 64, 64, True, (4096,) * 4),
    ("4x4096 d256", 16, 4, 256, 256, True, (4096,) * 4),
    ("4x4096 mla", 16, 16, 192, 128, True, (4096,) * 4),
)


def _flops(lens, hq, d, dv, causal):
    pairs = sum(n * (n + 1) / 2 if causal else n * n for n in lens)
    return 2 * pairs * hq * (d + dv)


def matmul_rate(n: int = 8192) -> float:
    """bf16 matmul FLOP/s of this device (one large square product)."""
    a = jnp.ones((n, n), jnp.bfloat16)

    def step(i, a):
        return (a * (1 + i)) @ a

    t = common.time_rotated(step, (a,), n_lo=1, n_hi=4, reps=3)
    return 2 * n**3 / t.seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m jattn bench prefill", description=__doc__)
    ap.add_argument("--rows", default="", help="comma-separated row labels (default: all)")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument(
        "--clean-edges",
        default="default",
        help="the kernel's clean_edges option: default, on, off, or both (two jattn columns)",
    )
    args = ap.parse_args(argv if argv is not None else sys.argv[1:])
    if jax.default_backend() != "gpu":
        print(f"bench prefill needs a GPU (jax default backend is {jax.default_backend()}); nothing to do")
        return
    from jattn.pallas_kernels import mosaic_prefill as mp

    rate = matmul_rate()
    print(f"device {jax.devices()[0].device_kind}; jax {jax.__version__}; bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    try:
        import flash_attn3_jax as fa3
    except ImportError:
        fa3 = None
    want = {r.strip() for r in args.rows.split(",") if r.strip()}
    rng = np.random.default_rng(0)
    variants = {"default": [None], "on": [True], "off": [False], "both": [False, True]}.get(args.clean_edges)
    if variants is None:
        ap.error(f"--clean-edges {args.clean_edges!r}: choose default, on, off or both")
    header = ["row", "Hq/Hkv", "D/Dv", "tokens", "jattn ms", "TFLOP/s", "% matmul"]
    if len(variants) > 1:
        header += ["clean ms", "clean TFLOP/s"]
    header += ["FA3 TFLOP/s", "cuDNN TFLOP/s"]
    out = []
    for label, hq, hkv, d, dv, causal, lens in ROWS:
        if want and label not in want:
            continue
        t_tok = sum(lens)
        q = jnp.asarray(rng.standard_normal((t_tok, hq, d)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((t_tok, hkv, d)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((t_tok, hkv, dv)), jnp.bfloat16)
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
        flops = _flops(lens, hq, d, dv, causal)

        def timed(fn):
            try:
                t = common.time_rotated(fn, (q, k, v, cu), n_lo=1, n_hi=4, reps=3)
                return t.seconds
            except Exception as e:  # noqa: BLE001 - a peer that cannot run this row
                print(f"{label}: {type(e).__name__}: {str(e)[:300]}")
                return None

        row = [label, f"{hq}/{hkv}", f"{d}/{dv}", t_tok]
        for n, clean in enumerate(variants):

            def ours(i, q, k, v, cu, clean=clean):
                return mp.mha_prefill(q, k, v, cu, is_causal=causal, k_scale=1.0 + 1e-3 * i, clean_edges=clean)

            s = timed(ours)
            cols = [f"{s * 1e3:.3f}", f"{flops / s / 1e12:.0f}"] if s is not None else ["-", "-"]
            if n == 0:
                cols.append("-" if s is None else f"{100 * flops / s / rate:.0f}")
            row += cols
        peers = []
        if fa3 is not None and not args.no_peers:

            def fa(i, q, k, v, cu):
                return fa3.flash_mha_varlen(
                    q,
                    k,
                    v,
                    cu,
                    cu,
                    max_seqlen_q=max(lens),
                    max_seqlen_k=max(lens),
                    softmax_scale=(1.0 + 1e-3 * i) / math.sqrt(d),
                    is_causal=causal,
                )

            peers.append(timed(fa))
        else:
            peers.append(None)
        if len(set(lens)) == 1 and not args.no_peers and d == dv:
            b, n = len(lens), lens[0]

            def cudnn(i, q, k, v, cu):
                shape = lambda x: x.reshape(b, n, x.shape[1], x.shape[2])  # noqa: E731
                return jax.nn.dot_product_attention(
                    shape(q),
                    shape(k),
                    shape(v),
                    scale=(1.0 + 1e-3 * i) / math.sqrt(d),
                    is_causal=causal,
                    implementation="cudnn",
                )

            peers.append(timed(cudnn))
        else:
            peers.append(None)
        row += ["-" if p is None else f"{flops / p / 1e12:.0f}" for p in peers]
        out.append(row)
        print(" | ".join(str(x) for x in row), flush=True)
    print(common.fmt_table(header, out))
    if not want or "merge" in want:
        _merge_row(rng)


def _merge_row(rng, tokens: int = 16384, hq: int = 32, d: int = 128) -> None:
    """``attn_merge_state`` (the chunked-prefix merge): achieved bandwidth against the
    device's copy bandwidth, and how many kernels XLA made of it."""
    import jattn

    o_a, o_b = (jnp.asarray(rng.standard_normal((tokens, hq, d)), jnp.bfloat16) for _ in range(2))
    l_a, l_b = (jnp.asarray(rng.standard_normal((tokens, hq)), jnp.float32) for _ in range(2))

    def step(i, o_a, l_a, o_b, l_b):
        return jattn.attn_merge_state(o_a, l_a + i, o_b, l_b)

    t = common.time_rotated(step, (o_a, l_a, o_b, l_b), n_lo=2, n_hi=12, reps=5)
    nbytes = 3 * o_a.size * 2 + 3 * l_a.size * 4
    copy_bw, _ = common.copy_bandwidth()
    hlo = jax.jit(jattn.attn_merge_state).lower(o_a, l_a, o_b, l_b).compile().as_text()
    kernels = hlo.count("kind=kLoop") + hlo.count("kind=kInput") + hlo.count("custom_call_target")
    print(
        f"attn_merge_state [{tokens}, {hq}, {d}] bf16: {t.seconds * 1e6:.1f} us, "
        f"{nbytes / t.seconds / 1e12:.2f} TB/s ({100 * nbytes / t.seconds / copy_bw:.0f}% of copy "
        f"{copy_bw / 1e12:.2f} TB/s); XLA fusions: {kernels}"
    )


if __name__ == "__main__":
    main()
