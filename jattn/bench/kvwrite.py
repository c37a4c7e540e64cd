"""``python -m jattn bench kvwrite``: the KV-cache writes (``set_kv_buffer``,
``set_mla_kv_buffer``) on each backend, against the copy bandwidth.

Each row writes ``tokens`` new tokens at distinct random slots of a pool of
``--pool-tokens`` slots (as a decode step scatters its tokens over many requests'
pages): the MHA write at the Llama-3-8B shape (8 KV heads x 128, K and V) and the MLA
latent write (rows of 512 + 64), into a bf16 or an FP8 cache (quantised by the write,
scale 0.5). Inputs are bf16.

Timing: ``n`` writes chained inside one jit by a ``fori_loop`` that carries the cache,
as a serving step updates its donated cache layer after layer, so every write is in
place and none is dead code; the per-write time is the differential between two loop
lengths (the entry copy of the cache and the dispatch cancel). Each write takes the
next of four rotations of inputs and slots. Bytes: the inputs read, the cache rows
written and the slots read; TB/s counts those against the device-to-device copy.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jattn.bench import common

TOKENS = (64, 1024, 16384)
HKV, D = 8, 128  # Llama-3-8B K/V heads
R, RPE = 512, 64  # DeepSeek latent row
NUM_ROT = 4
SCALE = 0.5
HEADER = ("write", "cache", "tokens", "backend", "us", "TB/s", "% of copy", "matches xla")


def _bytes(kind: str, tokens: int, cache_itemsize: int) -> int:
    """Bytes moved by one write: bf16 inputs read, cache rows written, int32 slots read."""
    width = 2 * HKV * D if kind == "mha" else R + RPE
    return tokens * (width * (2 + cache_itemsize) + 4)


def _setup(kind: str, cache_dtype, tokens: int, pool: int, rng):
    """(cache pytree, inputs stacked per rotation, slots [NUM_ROT, tokens])."""
    page = 64
    pages = -(-pool // page)
    slots = np.stack([rng.permutation(pages * page)[:tokens] for _ in range(NUM_ROT)]).astype(np.int32)
    key = jax.random.key(7)
    if kind == "mha":
        caches = tuple(jnp.zeros((pages, page, HKV, D), cache_dtype) for _ in range(2))
        ins = tuple(
            jax.random.normal(jax.random.fold_in(key, i), (NUM_ROT, tokens, HKV, D), jnp.bfloat16) for i in range(2)
        )
    else:
        caches = (jnp.zeros((pages, page, R + RPE), cache_dtype),)
        ins = tuple(
            jax.random.normal(jax.random.fold_in(key, i), (NUM_ROT, tokens, w), jnp.bfloat16)
            for i, w in enumerate((R, RPE))
        )
    return caches, ins, jnp.asarray(slots)


def _write(kind: str, backend, fp8: bool):
    """One write ``(caches, inputs, slots) -> caches`` on ``backend``."""
    import jattn

    scale = SCALE if fp8 else None
    if kind == "mha":
        return lambda c, x, loc: jattn.set_kv_buffer(
            c[0], c[1], loc, x[0], x[1], k_scale=scale, v_scale=scale, backend=backend
        )
    return lambda c, x, loc: (jattn.set_mla_kv_buffer(c[0], loc, x[0], x[1], kv_scale=scale, backend=backend),)


def time_write(write, caches, ins, slots, n_lo: int = 4, n_hi: int = 68, reps: int = 7) -> common.Timing:
    """Per-write time of ``write`` chained ``n`` times in a ``fori_loop`` carrying the cache."""

    def make(n):
        def many(caches, ins, slots):
            def body(i, c):
                r = i % NUM_ROT
                return tuple(write(c, tuple(x[r] for x in ins), slots[r]))

            return jax.lax.fori_loop(0, n, body, tuple(caches))

        return jax.jit(many)

    return common._differential(make, (caches, ins, slots), n_lo, n_hi, reps)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m jattn bench kvwrite", description=__doc__)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="tokens per write, comma-separated")
    ap.add_argument("--pool-tokens", type=int, default=1 << 16, help="slots in the pool (default 65536)")
    ap.add_argument("--backends", default="xla,triton", help="backends to time, comma-separated")
    ap.add_argument("--kinds", default="mha,mla", help="mha, mla or both")
    common.add_output_args(ap)
    args = ap.parse_args(argv if argv is not None else sys.argv[1:])

    if common.no_gpu("kvwrite"):
        return 1
    copy_bw, how, dev = common.announce_device()
    rng = np.random.default_rng(0)
    rows = []
    for kind in args.kinds.split(","):
        for cache_dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
            fp8 = cache_dtype == jnp.float8_e4m3fn
            for tokens in (int(t) for t in args.tokens.split(",")):
                caches, ins, slots = _setup(kind, cache_dtype, tokens, args.pool_tokens, rng)
                once = {}
                for backend in args.backends.split(","):
                    write = _write(kind, backend, fp8)
                    label = [kind, jnp.dtype(cache_dtype).name, tokens, backend]
                    try:
                        t = time_write(write, caches, ins, slots)
                        once[backend] = jax.jit(write)(caches, tuple(x[0] for x in ins), slots[0])
                    except Exception as e:  # noqa: BLE001 - a backend this device lacks
                        print(f"{' '.join(map(str, label))}: failed {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                        continue
                    tbs = _bytes(kind, tokens, jnp.dtype(cache_dtype).itemsize) / t.seconds / 1e12
                    same = "-"
                    if "xla" in once and backend != "xla":
                        same = str(all(bool(jnp.array_equal(a, b)) for a, b in zip(once["xla"], once[backend])))
                    rows.append(
                        label + [f"{t.seconds * 1e6:.1f}", f"{tbs:.2f}", f"{100 * tbs * 1e12 / copy_bw:.0f}%", same]
                    )
                    print(" | ".join(map(str, rows[-1])), flush=True)
                del caches, ins, once
    caption = (
        f"KV writes: MHA {HKV}x{D} K and V, MLA {R}+{RPE}; bf16 inputs; pool {args.pool_tokens} slots; "
        f"random distinct slots; per write, chained in a loop; copy {copy_bw / 1e12:.2f} TB/s ({how}); {dev}"
    )
    common.print_table(args, "kvwrite", caption, HEADER, rows, dict(device=dev, copy_tbs=copy_bw / 1e12))


if __name__ == "__main__":
    main()
