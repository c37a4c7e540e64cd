"""``python -m jattn bench cascade``: shared-prefix (cascade) decode against the plain decode.

Llama-3-8B attention shape (32 q heads, 8 kv heads, head_dim 128, bf16, page 64).
Each row is ``groups x group_size`` requests whose group shares a ``prefix``-token
prefix and continues with a ``suffix``-token suffix of its own, one new token each.
Timed in one run, GPU time per call (``common.time_rotated(device=True)``):

* plain: ``mha_decode_with_kvcache`` over each request's full page row (the shared
  prefix pages appear in every row of its group, as the engine's plan holds them);
* cascade, each prefix pass (``decode``: chunks of at most 8 query rows;
  ``extend``: the whole group as one prefill tile per head over page ranges of
  the prefix) and the automatic choice.

Speedup is plain / cascade. Bytes: the plain call reads every row's K/V
(``bs * (prefix + suffix)`` tokens), the cascade the distinct pages once
(``groups * prefix + bs * suffix``); TB/s columns count those. The plain call's
figure is the rate of the bytes it asks for, not of HBM traffic: the requests of a group
read the same prefix pages, mostly from L2, so it can pass the copy rate. Rotations use
disjoint pages (a pool larger than L2) so no call finds the last one's pages in L2.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jattn.bench import common

ROWS = ((1, 64, 16384, 256), (8, 8, 16384, 256), (4, 16, 4096, 256), (16, 4, 4096, 512))
HQ, HKV, D = 32, 8, 128
NUM_ROT = 4
HEADER = (
    "groups x size",
    "prefix + suffix",
    "plain us",
    "plain TB/s",
    "decode-pass us",
    "extend-pass us",
    "suffix-pass us",
    "auto us",
    "auto TB/s (distinct)",
    "speedup (auto)",
    "max |auto - plain|",
)


def _setup(groups, gs, prefix, suffix, page_size, n_q, rng):
    bs = groups * gs
    wp, ws = -(-prefix // page_size), -(-(suffix) // page_size)
    per_rot = groups * wp + bs * ws
    page_bytes = 2 * page_size * HKV * D * 2
    num_pages = common.rotation_pages(NUM_ROT * per_rot, page_bytes)
    k = jax.random.normal(jax.random.key(1), (num_pages, page_size, HKV, D), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(2), (num_pages, page_size, HKV, D), jnp.bfloat16)
    perm = rng.permutation(num_pages)[: NUM_ROT * per_rot].reshape(NUM_ROT, per_rot).astype(np.int32)
    ptab = perm[:, : groups * wp].reshape(NUM_ROT, groups, wp)
    stab = perm[:, groups * wp :].reshape(NUM_ROT, bs, ws)
    joined = np.concatenate([np.repeat(ptab, gs, axis=1), stab], axis=2)
    qs = jax.random.normal(jax.random.key(3), (n_q, bs, HQ, D), jnp.bfloat16)
    lens = dict(
        plens=jnp.full((groups,), prefix, jnp.int32),
        slens=jnp.full((bs,), suffix, jnp.int32),
        lens=jnp.full((bs,), prefix + suffix, jnp.int32),
    )
    return qs, k, v, jnp.asarray(ptab), jnp.asarray(stab), jnp.asarray(joined), lens


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m jattn bench cascade", description=__doc__)
    ap.add_argument(
        "--rows", default=None, help="GROUPSxSIZExPREFIXxSUFFIX,... e.g. 1x64x16384x256 (default: four rows)"
    )
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--backend", default=None, help="jattn backend for every call (default: automatic)")
    ap.add_argument("--n-hi", type=int, default=12, help="calls per jit")
    common.add_output_args(ap)
    ap.add_argument(
        "--prefix-splits", default="", help="e.g. 4,8,16: also time the extend pass with these page ranges per prefix"
    )
    args = ap.parse_args(argv if argv is not None else sys.argv[1:])

    import jattn

    if common.no_gpu("cascade"):
        return 1
    copy_bw, how, dev = common.announce_device()
    rows_spec = ROWS if args.rows is None else [tuple(int(x) for x in r.split("x")) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    ps, be = args.page_size, args.backend
    header = list(HEADER)
    rows = []
    for groups, gs, prefix, suffix in rows_spec:
        bs = groups * gs
        qs, k, v, ptab, stab, joined, ln = _setup(groups, gs, prefix, suffix, ps, args.n_hi, rng)
        token_bytes = 2 * HKV * D * 2
        plain_bytes = bs * (prefix + suffix) * token_bytes
        distinct_bytes = (groups * prefix + bs * suffix) * token_bytes
        targs = (qs, k, v, ptab, stab, joined, ln["plens"], ln["slens"], ln["lens"])

        def plain(i, qs, k, v, ptab, stab, joined, plens, slens, lens):
            return jattn.mha_decode_with_kvcache(qs[i], k, v, joined[i % NUM_ROT], lens, backend=be)

        def suffix_only(i, qs, k, v, ptab, stab, joined, plens, slens, lens):
            return jattn.mha_decode_with_kvcache(qs[i], k, v, stab[i % NUM_ROT], slens, backend=be)

        def cascade(i, qs, k, v, ptab, stab, joined, plens, slens, lens, prefix_pass=None, prefix_splits=None):
            return jattn.cascade_decode(
                qs[i],
                k,
                v,
                ptab[i % NUM_ROT],
                plens,
                stab[i % NUM_ROT],
                slens,
                group_size=gs,
                prefix_pass=prefix_pass,
                prefix_splits=prefix_splits,
                backend=be,
            )

        times = {}
        for name, fn in (
            ("plain", plain),
            ("decode", lambda *a: cascade(*a, prefix_pass="decode")),
            ("extend", lambda *a: cascade(*a, prefix_pass="extend")),
            ("suffix", suffix_only),
            ("auto", cascade),
        ) + tuple(
            (f"extend, {n} ranges", lambda *a, n=n: cascade(*a, prefix_pass="extend", prefix_splits=n))
            for n in (int(x) for x in args.prefix_splits.split(",") if x)
        ):
            try:
                t = common.time_rotated(fn, targs, n_hi=args.n_hi, device=True)
                times[name] = common.device_or_wall(t)
            except Exception as e:  # noqa: BLE001
                times[name] = None
                print(f"{groups}x{gs} {name}: failed {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
        a = jnp.asarray(plain(0, *targs), jnp.float32)
        b = jnp.asarray(cascade(0, *targs), jnp.float32)
        err = float(jnp.max(jnp.abs(a - b)))
        us = lambda s: "-" if s is None else f"{s * 1e6:.1f}"
        ok = times["plain"] is not None and times["auto"] is not None
        rows.append(
            [
                f"{groups}x{gs}",
                f"{prefix}+{suffix}",
                us(times["plain"]),
                "-" if times["plain"] is None else f"{plain_bytes / times['plain'] / 1e12:.2f}",
                us(times["decode"]),
                us(times["extend"]),
                us(times["suffix"]),
                us(times["auto"]),
                "-" if times["auto"] is None else f"{distinct_bytes / times['auto'] / 1e12:.2f}",
                f"{times['plain'] / times['auto']:.1f}x" if ok else "-",
                f"{err:.2e}",
            ]
        )
        print(" | ".join(rows[-1]), flush=True)
        for name, t in times.items():
            if name.startswith("extend, "):
                print(f"{groups}x{gs} {name}: {us(t)} us", flush=True)
        del qs, k, v, targs
    caption = (
        f"cascade decode: Hq={HQ} Hkv={HKV} D={D}, bf16, page {ps}, q_len 1, backend {be or 'auto'}; "
        f"GPU time per call; copy {copy_bw / 1e12:.2f} TB/s ({how}); {dev}"
    )
    common.print_table(args, "cascade", caption, header, rows, dict(device=dev, copy_tbs=copy_bw / 1e12))


if __name__ == "__main__":
    main()
