"""Why Mosaic GPU's layout inference finds no solution for the MLA decode kernel.

Wraps the solver's recursive search to remember the deepest point it reached (the
fewest unknowns left) and prints, on failure, those unknowns' ops and source lines
and the constraints still open there. JATTN_DIAG_FUEL sets the solver's fuel (default
20,000: a failing build stops in about a minute; Mosaic GPU's own default is 100,000).
Needs a GPU (the layout pass runs when the kernel is compiled).
Usage: python scripts/diag_mla_layout.py [--q-len N] [--page P] [--heads H]
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import layout_inference as li

state = {"best": None, "calls": 0}
_orig = li.find_assignments_for


def _describe(var):
    key = var.key
    try:
        op = key.operation
        name = op.OPERATION_NAME if hasattr(op, "OPERATION_NAME") else op.operation.name
        loc = str(op.location)
        return f"{name} {key.type.name}[{key.index}] {getattr(key, 'value', None) and key.value.type} @ {loc}"
    except Exception as e:  # noqa: BLE001
        return f"{var!r} ({e})"


def traced(unknowns, constraint_system, *, fuel, arch):
    state["calls"] += 1
    try:
        reduced = li.cs.reduce(constraint_system)
    except Exception:  # noqa: BLE001
        reduced = None
    if reduced is not None and not isinstance(reduced, li.cs.Unsatisfiable):
        remaining = [u for u in unknowns if u not in reduced.assignments]
        best = state["best"]
        if best is None or len(remaining) < len(best[0]):
            state["best"] = (remaining, list(reduced.constraints))
    return _orig(unknowns, constraint_system, fuel=fuel, arch=arch)


li.find_assignments_for = traced
fuel = int(os.environ.get("JATTN_DIAG_FUEL", "20000"))
li.infer_layout.__kwdefaults__["fuel"] = fuel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--q-len", type=int, default=1)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args()
    from jattn.pallas_kernels import mosaic_mla

    key = jax.random.PRNGKey(0)
    bs, L, ps = 2, 300, args.page
    pages = -(-L // ps) * bs + 1
    q = jax.random.normal(key, (bs * args.q_len, args.heads, 576), jnp.bfloat16)
    kv = jax.random.normal(key, (pages, ps, 576), jnp.bfloat16)
    pt = jnp.arange(1, pages, dtype=jnp.int32).reshape(bs, -1)
    lens = jnp.full((bs,), L, jnp.int32)
    t0 = time.time()
    try:
        out = mosaic_mla.mla_decode(q, kv, pt, lens, kv_lora_rank=512, softmax_scale=0.1, max_seqlen_q=args.q_len)
        jax.block_until_ready(out)
        print(f"COMPILED in {time.time() - t0:.0f}s", flush=True)
        from jattn import reference

        ref = reference.mla_decode(q, kv, pt, lens, kv_lora_rank=512, softmax_scale=0.1, max_seqlen_q=args.q_len)
        print("max abs err vs reference:", float(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)).max()))
    except Exception as e:  # noqa: BLE001
        print(f"FAILED in {time.time() - t0:.0f}s: {str(e)[:300]}", flush=True)
        best = state["best"]
        if best is not None:
            remaining, constraints = best
            print(f"solver calls {state['calls']}; deepest point: {len(remaining)} unknowns left")
            for v in remaining[:60]:
                print("  U", _describe(v))
            print(f"  {len(constraints)} open constraints:")
            for c in constraints[:80]:
                print("  C", str(c)[:400])
        sys.exit(1)


if __name__ == "__main__":
    main()
