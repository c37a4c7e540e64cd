"""Benchmarks, run as ``python -m jattn bench {decode,bridge,serving}`` (tools: they may import
``jattn.models``, ``jattn.bridge`` and torch; the library never imports them)."""
