"""Command line: ``python -m jattn {demo,generate,bench,info}``."""

from __future__ import annotations

import argparse
import importlib
import sys

_HELP = """\
subcommands:
  demo [--synthetic] [...]   generate text with a model served by jattn (SmolLM2-135M when
                             installed, else a tiny random model); --synthetic runs the
                             self-checking continuous-batching attention loop instead
  generate --prompt TEXT     generate from your own prompt
  bench NAME [...]           GPU benchmarks: decode, prefill, mla, cascade, kvwrite, bridge, serving
                             (bridge --device cpu: the torch bridge's host time on the CPU)
  info                       this device, and the backend each op would run on here

`python -m jattn COMMAND --help` lists a command's options.
"""

# op -> what ``info`` calls it
_OP_LABELS = {
    "mha_decode": "mha decode",
    "mha_extend": "mha extend",
    "mha_prefill": "mha prefill",
    "mla_decode": "mla decode",
    "attn_merge_state": "merge state",
    "set_kv_buffer": "kv write (mha)",
    "set_mla_kv_buffer": "kv write (mla)",
}

_BACKEND_LABELS = {
    "mosaic": "Pallas Mosaic GPU kernels, Hopper",
    "triton": "Triton kernels through jax-triton, Ampere and newer",
    "xla": "plain JAX, any device",
}


def _info() -> int:
    import jax

    import jattn
    from jattn.ops import KERNELS, OPS, device_kind, op_backend

    dev = jax.devices()[0]
    kind = device_kind()
    print(
        f"jattn {jattn.__version__}, jax {jax.__version__}; device: {dev.device_kind} "
        f"({jax.default_backend()}, {len(jax.devices())} device(s)); jattn device kind: {kind}"
    )
    print("what each op runs on this device with backend=None (auto):")
    w = max(len(v) for v in _OP_LABELS.values())
    for op in OPS:
        picked, _ = op_backend(op)
        kernels = [b for b in KERNELS if op in KERNELS[b]]
        if picked != "xla":
            note = "calls outside the kernel's limits (shape, dtype, options) run on xla"
        elif kernels and kind == "cpu":
            note = f"{' / '.join(kernels)} kernel: needs a GPU (runs on the CPU only interpreted, for tests)"
        elif kernels:
            note = "; ".join(op_backend(op, b)[1] or f"{b} kernel: on request (backend={b!r})" for b in kernels)
        else:
            note = "plain JAX (no kernel yet)"
        print(f"  {_OP_LABELS[op].ljust(w)}  {picked:6s}  {note}")
    print("backends: " + "; ".join(f"{b} ({_BACKEND_LABELS.get(b, 'kernels')})" for b in (*KERNELS, "xla")))
    return 0


_BENCHES = ("decode", "prefill", "mla", "cascade", "kvwrite", "bridge", "serving")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="python -m jattn",
        description="jattn: JAX attention backends for LLM serving",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_HELP,
    )
    ap.add_argument("command", choices=["demo", "generate", "bench", "info"])
    if not argv or argv[0] in ("-h", "--help"):
        ap.print_help()
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in ("demo", "generate", "bench", "info"):
        ap.error(f"unknown command {cmd!r}")
    if cmd == "info":
        if rest[:1] in (["-h"], ["--help"]):
            print("usage: python -m jattn info: the device, and the backend each op would use on it (no options)")
            return 0
        if rest:
            ap.error(f"info takes no options (got {' '.join(rest)})")
        return _info()
    if cmd == "bench":
        if rest[:1] in (["-h"], ["--help"]):
            print(
                f"usage: python -m jattn bench {{{','.join(_BENCHES)}}} [options]; "
                "python -m jattn bench NAME --help lists a benchmark's options"
            )
            return 0
        if not rest or rest[0] not in _BENCHES:
            ap.error(f"bench needs a benchmark name: {', '.join(_BENCHES)} (got {' '.join(rest[:1]) or 'none'})")
        mod = importlib.import_module(f"jattn.bench.{rest[0]}")
        return mod.main(rest[1:]) or 0
    if cmd == "demo" and "--synthetic" in rest:
        from jattn import demo

        return demo.main([a for a in rest if a != "--synthetic"])
    try:
        models_demo = importlib.import_module("jattn.models.demo")
    except ModuleNotFoundError:
        if cmd == "generate":
            ap.error("generate needs jattn.models, which is not in this build")
        from jattn import demo

        return demo.main(rest)
    fn = models_demo.main if cmd == "demo" else models_demo.generate_main
    return fn(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
