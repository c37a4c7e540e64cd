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
  bench NAME [...]           GPU benchmarks: decode, bridge, serving
  info                       devices and the backends jattn would pick
"""


def _info() -> int:
    import jax

    from jattn import registered_backends
    from jattn.ops import BACKENDS, device_kind

    print(f"jax {jax.__version__}, default backend {jax.default_backend()}, devices {jax.devices()}")
    print(f"device kind: {device_kind()}; kernel backends: {BACKENDS}")
    print(f"registered attention backends: {registered_backends()}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(
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
        return _info()
    if cmd == "bench":
        if not rest or rest[0].startswith("-"):
            ap.error("bench needs a benchmark name: decode, bridge, serving")
        try:
            mod = importlib.import_module(f"jattn.bench.{rest[0]}")
        except ModuleNotFoundError:
            ap.error(f"no benchmark named {rest[0]!r}")
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
