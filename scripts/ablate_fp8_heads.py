"""Probe (not a test): where the FP8 per-KV-head decode (``fp8_qk``) spends its time.

Builds in-memory variants of ``pallas_kernels/mosaic_decode_heads_kernel.py`` (its source with one
piece of the consumer's chain removed, or another ring depth or occupancy; the variants'
outputs are wrong on purpose) and prints the GPU time per call of each, beside the
unchanged kernel, at 64 x 4096 and 1 x 32768 (32/8 heads, d128, FP8 e4m3 K/V, page 16,
q_len 1). ``kernel`` rows time the Mosaic kernel alone (the query prepared outside the
timed calls, no transposes, no split combine); ``op`` rows time the whole op.

    python scripts/ablate_fp8_heads.py            # on the GPU (gpu.sh)
    python scripts/ablate_fp8_heads.py --check    # CPU: build every variant, trace only

Variants (block 128 unless named):
* ``full``: ``fp8_qk=True, block=128`` with the f16 V tile (two CTAs per SM, two slots);
* ``stream``: the consumer waits for each slot and frees it, no math (the ring's floor);
* ``no_upcast``: the V upcast removed (``O^T`` reads a stale f16 tile);
* ``no_pv``: the ``O^T += V^T P^T`` MMA removed (the softmax and ``P^T`` store stay);
* ``no_qk``: the ``S^T`` MMA removed (scores are zeros; the V upcast stays);
* ``solo``: one CTA per SM (232 registers) with as many slots as fit (up to 6);
* ``b64``: 64-token blocks with the shipped ring (the routed FP8 path: the f16 V tile);
* ``b64_deep``: 64-token blocks, two CTAs per SM, as many slots as fit half the SM (up to 6);
* ``b64_deep-stream``: the same ring, no math;
* ``vregs``: ``v_regs=True`` (V^T read into registers, no upcast tile: as many slots as
  fit, up to 6), and ``vregs-stream`` its ring with no math, ``vregs_b64`` at 64-token blocks
  (``KernelOptions.heads_v_regs``), ``vregs_b64_ovl`` with the pipelined loop (``overlap``),
  ``vregs_b64-stream`` its ring with no math.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

from jattn.pallas_kernels import e4m3_query
from jattn.pallas_kernels import mosaic_decode_heads as mh
from jattn.pallas_kernels import mosaic_decode_heads_config as mc
from jattn.pallas_kernels import mosaic_decode_heads_kernel as mk

_STEP_HEAD = "                plgpu.barrier_wait(kv_bar.at[slot])\n                if cfg.fp8_qk:"
_QK = "x, vs = s_t(k_s.at[slot], during=lambda: load_vt(slot) if cfg.v_regs else upcast_v(slot))"
_PATCHES = {
    "stream": [
        (
            _STEP_HEAD,
            "                plgpu.barrier_wait(kv_bar.at[slot])\n"
            "                plgpu.barrier_arrive(kv_free.at[slot])\n"
            "                return carry\n"
            "                if cfg.fp8_qk:",
        )
    ],
    "no_upcast": [("if cfg.v_regs else upcast_v(slot))", "if cfg.v_regs else None)")],
    "no_pv": [
        ("acc = o_t(tuple(a * alpha_o for a in acc), v_tile)", "acc = tuple(a * alpha_o for a in acc)"),
    ],
    "no_qk": [
        (
            _QK,
            "vs = load_vt(slot) if cfg.v_regs else upcast_v(slot)\n"
            "                    x = cast_layout(jnp.zeros((B, N), jnp.float32), "
            "plgpu.Layout.WGMMA, interpret=interp)",
        )
    ],
}


def _exec_module(name: str, src: str, path: str):
    """A fresh module run from ``src`` (its own jit caches)."""
    mod = types.ModuleType(name)
    mod.__file__ = path
    exec(compile(src, f"<{name}>", "exec"), mod.__dict__)
    return mod


def _variant_module(
    name: str, max_stages: int = 0, paired: bool | None = None, v_regs: bool = False, overlap: bool = False
):
    """``mosaic_decode_heads`` rebuilt from its source, calling the kernel of
    ``mosaic_decode_heads_kernel`` rebuilt with ``name``'s patches, and a ``HeadsConfig``
    whose ring takes up to ``max_stages`` slots, whose pairing is ``paired`` (None: as
    shipped) and with ``v_regs`` / ``overlap`` as given."""
    src = open(mk.__file__).read()
    for old, new in _PATCHES.get(name.split("-")[-1], []):
        if src.count(old) != 1:
            raise SystemExit(f"ablate: patch of {name!r} does not match the kernel source once: {old!r}")
        src = src.replace(old, new)
    kernel = _exec_module(f"jattn_ablate_kernel_{name}", src, mk.__file__)
    mod = _exec_module(f"jattn_ablate_{name}", open(mh.__file__).read(), mh.__file__)
    mod._run = kernel._run
    if v_regs:
        max_stages = max_stages or 6
    if max_stages or paired is not None or v_regs:

        @dataclasses.dataclass(frozen=True)
        class Config(mc.HeadsConfig):
            def __post_init__(self):
                object.__setattr__(self, "v_regs", v_regs)
                object.__setattr__(self, "overlap", overlap)

            @property
            def paired(self) -> bool:
                return super().paired if paired is None else paired

            @property
            def stages(self) -> int:
                limit = mc._SMEM_HALF if self.paired else mc._SMEM_SOLO
                top = max_stages or mc.STAGES
                return max([s for s in range(2, top + 1) if self.smem_bytes(s) <= limit], default=2)

        mod.HeadsConfig = Config
    return mod


VARIANTS = {
    "full": dict(),
    "stream": dict(),
    "no_upcast": dict(),
    "no_pv": dict(),
    "no_qk": dict(),
    "solo": dict(max_stages=6, paired=False),
    "b64": dict(block=64),
    "b64_deep": dict(max_stages=6, block=64),
    "b64_deep-stream": dict(max_stages=6, block=64),
    "vregs": dict(v_regs=True),
    "vregs-stream": dict(v_regs=True),
    "vregs_b64": dict(v_regs=True, block=64),
    "vregs_b64_ovl": dict(v_regs=True, block=64, overlap=True),
    "vregs_b64-stream": dict(v_regs=True, block=64),
}


def _config(mod, k, tables, block: int):
    """The kernel's build configuration for these pools and tables (q_len 1, 32/8 heads)."""
    num_pages, ps, hkv, d = k.shape
    bs = tables.shape[1]
    cfg = mod.HeadsConfig(
        head_dim=d, group=4, kv_heads=hkv, q_len=1, is_causal=False, page_size=ps, num_pages=num_pages,
        max_pages=tables.shape[2], num_splits=mc.choose_num_splits(bs, hkv, tables.shape[2] * ps, 1, block),
        batch=bs, ctas=0, scale=1.0 / math.sqrt(d), fp8=True, interpret=False, block=block, fp8_qk=True,
    )  # fmt: skip
    return dataclasses.replace(cfg, ctas=mc.launch_ctas(cfg, -1))


def _kernel_only(mod, block: int):
    """A step that runs only the Mosaic kernel of ``mod`` on a prepared query."""

    def step(i, q_arrs, qfs, k, v, tables, lens):
        cfg = _config(mod, k, tables, block)
        k2d, v2d = (x.reshape(-1, x.shape[2] * x.shape[3]) for x in (k, v))
        return mod._run(cfg, jnp.float16, tables[i % tables.shape[0]], lens, q_arrs[i], k2d, v2d, qfs[i])

    return step


def _op(mod, block: int):
    def step(i, qs, k, v, tables, lens):
        bs = tables.shape[1]
        return mod.decode(
            qs[i], k, v, tables[i % tables.shape[0]], lens, softmax_scale=1.0 / math.sqrt(k.shape[-1]),
            k_scale=1.0, v_scale=1.0, max_seqlen_q=1, is_causal=False, return_lse=False,
            num_splits=mc.choose_num_splits(bs, k.shape[2], tables.shape[2] * k.shape[1], 1, block),
            num_ctas=-1, latent=0, interpret=False, block=block, fp8_qk=True,
        )  # fmt: skip

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="CPU: build and trace every variant (no timing)")
    ap.add_argument("--shapes", default="64x4096,1x32768")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    from jattn.bench import common
    from jattn.bench.decode import _setup

    rng = np.random.default_rng(0)
    names = args.variants.split(",")
    for shape in args.shapes.split(","):
        bs, length = (int(x) for x in shape.split("x"))
        if args.check:
            bs, length = min(bs, 2), min(length, 512)
        n_hi = 12
        qs, k, v, tables, lens, kv_bytes = _setup(bs, length, 16, 1, jnp.float8_e4m3fn, rng, n_hi)
        q8, qf, _ = jax.vmap(lambda q: e4m3_query.query_tiles(q, 8, 1, 1, 16, use_kernel=False))(qs)
        print(f"== {bs}x{length}, FP8 K/V {kv_bytes / 1e6:.0f} MB, page 16, q_len 1", flush=True)
        for name in names:
            kw = dict(VARIANTS[name])
            block = kw.pop("block", 128)
            mod = _variant_module(name, **kw)
            cfg = _config(mod, k, tables, block)
            print(f"{name}: block {block}, {cfg.stages} slots, {'two CTAs' if cfg.paired else 'one CTA'} per SM, "
                  f"{cfg.num_splits} splits, {cfg.smem_bytes(cfg.stages) // 1024} KB", flush=True)  # fmt: skip
            for label, step, targs in (
                ("kernel", _kernel_only(mod, block), (q8, qf, k, v, tables, lens)),
                ("op", _op(mod, block), (qs, k, v, tables, lens)),
            ):
                if label == "op" and name not in ("full", "stream", "b64", "vregs_b64", "vregs_b64_ovl"):
                    continue
                if args.check:
                    jax.jit(lambda *a: step(0, *a)).trace(*targs).lower(lowering_platforms=("cuda",))
                    print(f"{name:16s} {label:6s} lowered", flush=True)
                    continue
                try:
                    t = common.time_rotated(step, targs, n_hi=n_hi, device=True)
                except Exception as e:  # noqa: BLE001 - one variant failing should not stop the rest
                    print(f"{name:16s} {label:6s} failed: {str(e).splitlines()[0][:200]}", flush=True)
                    continue
                s = t.device_seconds or t.seconds
                print(f"{name:16s} {label:6s} {s * 1e6:8.1f} us  {kv_bytes / s / 1e12:5.2f} TB/s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
