"""``python -m jattn bench serving``: the continuous-batching serving loop, end to end.

For each model (SmolLM2-135M: the GGUF when installed, else the same shapes with random
weights; a Llama-3-8B-shaped random model) and batch size: ``bs`` requests of
``--prompt-len`` tokens each generate ``--gen-len`` tokens through :class:`Engine`
(bf16, page 16, programs compiled beforehand by a warm-up). Reported:

* decode tokens/s of the engine (steps that compiled excluded), overall tokens/s (generated
  tokens over the whole run, prefill included) and their ratio;
* engine decode step time (host planning + dispatch + device + fetching the tokens);
* device time of the same jitted decode step called back to back with no host sync in
  between (the GPU's busy time per step: kernels plus launch gaps, an upper bound on the
  sum of kernel times), so the difference is host overhead;
* prefill tokens/s (extend steps that did not compile) and time to first token.

``--long-context`` runs the long-prompt rows where the attention kernels decide the
result: Llama-3-8B shapes, prompts of 4096 and 16384 tokens at batch 8 and 32, 16
generated tokens, backends auto and xla side by side (each default can be overridden,
e.g. ``--prompt-lens``). It warms up with a few full-length prompts and one decode step
of the batch instead of the whole batch, and skips xla rows of more than
``--xla-max-tokens`` prompt tokens (the reference attention visits every key of the
context for every query, in f32). It prints an estimate of the run's GPU time first.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jattn.bench import common
from jattn.bench.serving_estimate import estimate, extend_batch
from jattn.metadata import plan_decode
from jattn.models.config import LlamaConfig
from jattn.models.engine import Engine, EngineConfig, SamplingParams
from jattn.models.llama import Llama


def _config(name: str, dtype: str = "bfloat16") -> LlamaConfig:
    """The model shapes of ``name`` (SmolLM2's GGUF has the same shapes as its config)."""
    if name == "smollm2":
        return LlamaConfig.smollm2_135m(dtype=dtype, param_dtype=dtype)
    if name == "llama3-8b":
        return LlamaConfig.llama3_8b(dtype=dtype, param_dtype=dtype)
    if name == "tiny":
        return LlamaConfig.tiny(dtype=dtype, param_dtype=dtype)
    raise SystemExit(f"unknown model {name!r}: smollm2, llama3-8b, tiny")


def _model(name: str, dtype: str):
    if name == "smollm2":
        from jattn.models.loading import find_smollm2_gguf, load_gguf

        path = find_smollm2_gguf()
        if path is not None:
            model, _, _ = load_gguf(path, dtype=dtype, param_dtype=dtype)
            return model, "SmolLM2-135M (GGUF weights)"
        cfg = LlamaConfig.smollm2_135m(dtype=dtype, param_dtype=dtype)
        return Llama(cfg, rngs=nnx.Rngs(0)), "SmolLM2-135M shapes, random weights"
    if name == "llama3-8b":
        cfg = LlamaConfig.llama3_8b(dtype=dtype, param_dtype=dtype)
        return Llama(cfg, rngs=nnx.Rngs(0)), "Llama-3-8B shapes, random weights"
    if name == "tiny":
        return Llama(LlamaConfig.tiny(dtype=dtype, param_dtype=dtype), rngs=nnx.Rngs(0)), "tiny Llama"
    raise SystemExit(f"unknown model {name!r}: smollm2, llama3-8b, tiny")


def _decode_step_call(engine: Engine, bs: int, seq_len: int):
    """A no-argument call of the engine's decode program of bucket ``bs`` (the cache
    is donated and replaced on every call, as in the engine)."""
    c = engine.config
    pages = -(-seq_len // c.page_size)
    # Reads may share pages (timing only), but each request writes its own last page, which
    # no other request reads: the planner refuses a write into a page another one holds.
    # Pages 1..bs are the written ones, the rest of the pool is read (the pool holds a
    # request's pages per request, so at least bs more).
    read_pages = max(1, c.num_pages - 1 - bs)
    table = (np.arange(bs * pages, dtype=np.int32).reshape(bs, pages) % read_pages + 1 + bs) % c.num_pages
    table[:, -1] = np.arange(1, bs + 1)
    md = plan_decode(
        np.full(bs, seq_len),
        page_size=c.page_size,
        page_table=table,
        batch_buckets=c.batch_buckets,
        max_pages=engine.max_pages,
        num_pages=c.num_pages,
    )
    tokens = np.zeros(md.num_tokens, np.int32)
    z = np.zeros(md.batch_size, np.float32)
    zi = np.zeros(md.batch_size, np.int32)
    md = jax.device_put(md)
    args = (tokens, md, z, z + 1, zi, zi, zi, z)  # temperature, top_p, seeds, counters, top_k, min_p

    def call():
        out, engine.kv_cache = engine._step(engine.params, engine.kv_cache, *args, greedy_only=True)
        return out

    return call


def _device_step_ms(engine: Engine, bs: int, seq_len: int, n: int = 20) -> float:
    """Per-step device time of the decode program of bucket ``bs``, back to back."""
    call = _decode_step_call(engine, bs, seq_len)
    before = engine._traces[0]
    jax.block_until_ready(call())
    t0 = time.perf_counter()
    for _ in range(n):
        out = call()
    jax.block_until_ready(out)
    dt = (time.perf_counter() - t0) / n
    if engine._traces[0] != before:
        print("  (note: the device-time probe compiled a program)", flush=True)
    return 1e3 * dt


def _attention_kernel(name: str) -> bool:
    return "jattn_paged_decode" in name or "attention" in name.lower() or "mosaic" in name.lower()


def _profile_step(engine: Engine, bs: int, seq_len: int, n: int = 6) -> dict:
    """Kernel times of one decode step (profiler): span, busy, attention share."""
    from jattn.bench import profile as prof

    call = _decode_step_call(engine, bs, seq_len)
    summ = prof.summarize(prof.profile_calls(call, [()] * n))
    attn = sum(us for name, _, us in summ.kernels if _attention_kernel(name))
    kernel_sum = sum(us for _, _, us in summ.kernels)
    count = sum(c for _, c, _ in summ.kernels)
    print(summ.table(top=10), flush=True)
    return dict(
        span_us=summ.span_us, busy_us=summ.busy_us, kernel_sum_us=kernel_sum, attention_us=attn, kernels_per_step=count
    )


def run_one(
    model,
    bs: int,
    prompt_len: int,
    gen_len: int,
    page_size: int,
    backend,
    profile: bool = False,
    command_buffers: bool | str = True,
    prefill_tokens: int = 16384,
    light_warmup: bool = False,
    num_pages: int | None = None,
    batch_buckets: tuple | None = None,
    samples: int = 1,
    cascade: bool | None = None,
    overlap: bool = True,
    fuse_projections: bool | None = None,
    scan_layers: bool = False,
) -> dict:
    """One row. ``light_warmup``: compile with as many full-length prompts as one
    extend step takes (the batch bucket of that size is added) and one decode step of
    the batch, instead of generating for the whole batch twice (long prompts).
    ``num_pages`` / ``batch_buckets``: the pool and buckets (default: what this row
    needs); rows that share them share their extend program. ``samples``: the batch is
    ``bs // samples`` prompts of ``samples`` parallel samples each (``SamplingParams.n``,
    temperature 0.8), whose decode steps are cascade plans unless ``cascade=False``.
    ``overlap``: the engine's overlap scheduling (``EngineConfig.overlap``).
    ``fuse_projections``: q/k/v and gate/up as one matmul each (``EngineConfig.
    fuse_projections``; True or None may fuse ``model`` in place). ``scan_layers``: the
    layers as one scan (``EngineConfig.scan_layers``; stacks ``model`` in place)."""
    max_context = prompt_len + gen_len + page_size
    pages_per = -(-max_context // page_size)
    budget, per_step = extend_batch(bs, prompt_len, prefill_tokens)
    buckets = batch_buckets or tuple(sorted({1, bs} | ({per_step} if light_warmup else set())))
    ecfg = EngineConfig(
        page_size=page_size,
        num_pages=num_pages or 1 + bs * pages_per,
        max_context=max_context,
        max_running=bs,
        max_prefill_tokens=budget,
        batch_buckets=buckets,
        token_buckets=None,
        kernel_backend=backend,
        command_buffers=command_buffers,
        cascade=cascade,
        overlap=overlap,
        fuse_projections=fuse_projections,
        scan_layers=scan_layers,
    )
    engine = Engine(model, ecfg)
    n_prompts = max(1, bs // samples)
    params = SamplingParams(max_new_tokens=gen_len)
    if samples > 1:
        params = SamplingParams(max_new_tokens=gen_len, n=samples, temperature=0.8, seed=1)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    traces = engine._traces[0]
    t0 = time.perf_counter()
    if light_warmup:
        # the extend program(s) of a full step of prompts (all chunks of a long one), no decode
        prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(per_step)]
        engine.generate(prompts, SamplingParams(max_new_tokens=1))
        # the decode program of the batch's bucket
        jax.block_until_ready(_decode_step_call(engine, bs, prompt_len + 1)())
    else:
        # the same shapes (compiles the extend and decode programs of this batch size)
        prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(n_prompts)]
        engine.generate(prompts, dataclasses.replace(params, max_new_tokens=3))
    warm = time.perf_counter() - t0
    warm_traces = engine._traces[0] - traces
    compiled = engine.metrics.compilations
    engine.metrics = type(engine.metrics)(compilations=compiled)
    t0 = time.perf_counter()
    firsts = engine.generate([rng.integers(0, vocab, prompt_len).tolist() for _ in range(n_prompts)], params)
    wall = time.perf_counter() - t0
    reqs = [s for r in firsts for s in engine.samples(r.rid)]
    m = engine.metrics
    assert all(r.status == "finished" for r in reqs), [r.error for r in reqs if r.error]
    ttft = sorted(1e3 * (r.first_token_time - r.arrival_time) for r in reqs)
    recompiles = m.compilations - compiled
    # the probe times a plain decode plan: not the cascade plans of sample rows (nan there)
    dev_ms = _device_step_ms(engine, bs, prompt_len + gen_len // 2) if samples == 1 else float("nan")
    extra = _profile_step(engine, bs, prompt_len + gen_len // 2) if profile else {}
    del engine
    return dict(
        **extra,
        batch=bs,
        prompt_len=prompt_len,
        gen_len=gen_len,
        prefill_tokens_per_step=budget,
        prefill_tok_s=m.timed_prompt_tokens / m.prefill_time if m.prefill_time else 0.0,
        decode_tok_s=m.decode_tokens_per_s,
        overall_tok_s=m.generated_tokens / wall,
        total_tok_s=(m.prompt_tokens + m.generated_tokens) / wall,
        engine_step_ms=m.median_decode_step_ms,
        ttft_ms_median=ttft[len(ttft) // 2],
        ttft_ms_max=ttft[-1],
        prefill_s=m.prefill_time,
        wall_s=wall,
        device_step_ms=dev_ms,
        recompiles_in_timed_run=recompiles,
        samples=samples,
        overlap=overlap,
        fused_projections=fuse_projections,
        scan_layers=scan_layers,
        cascade_steps=m.cascade_steps,
        shared_prompt_tokens=m.shared_tokens,
        warmup_s=warm,
        warmup_programs=warm_traces,
    )


def main(argv=None) -> int:
    from jattn.demo import backend_choices

    ap = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="python -m jattn bench serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--models",
        default=None,
        help="comma-separated: smollm2 (SmolLM2-135M), llama3-8b (its shapes, random "
        "weights), tiny (default: smollm2,llama3-8b; llama3-8b in the long-context preset)",
    )
    ap.add_argument(
        "--batch", default=None, help="comma-separated batch sizes (default 1,32,128; 8,32 in the long-context preset)"
    )
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    ap.add_argument(
        "--prompt-lens",
        default=None,
        help="comma-separated prompt lengths, each a row per batch and backend (instead of the one "
        "prompt length; 4096,16384 in the long-context preset)",
    )
    ap.add_argument(
        "--gen-len",
        default=None,
        help="generated tokens per request, comma-separated for a row each (default 64; 16 in the long-context preset)",
    )
    ap.add_argument("--page-size", type=int, default=16, help="KV cache page size in tokens (default 16)")
    ap.add_argument(
        "--prefill-tokens",
        type=int,
        default=16384,
        help="new tokens per extend step (longer prompts are prefilled in chunks; default 16384)",
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="model and KV cache dtype (default bfloat16)",
    )
    ap.add_argument(
        "--backend",
        default=None,
        help=f"attention kernel backend(s), comma-separated to compare side by side, each one of "
        f"{', '.join(backend_choices())} (default auto; auto,xla in the long-context preset)",
    )
    ap.add_argument(
        "--long-context",
        action="store_true",
        help="the long-context preset: llama3-8b, prompts 4096,16384 at batch 8,32, gen 16, backends "
        "auto,xla (options given explicitly win), a light warm-up, xla rows over the xla token limit "
        "skipped; prints an estimate of the GPU time first",
    )
    ap.add_argument(
        "--xla-max-tokens",
        type=int,
        default=None,
        help="skip xla-backend rows of more than this many prompt tokens, batch x prompt "
        "(default 131072 in the long-context preset, else 0: no limit)",
    )
    ap.add_argument(
        "--cpu", action="store_true", help="run on the CPU anyway (minutes with the default models; try --models tiny)"
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="profile the decode step: kernel-time sum and attention share vs step time",
    )
    ap.add_argument(
        "--command-buffers",
        default="engine",
        help="XLA command-buffer settings to compare, separated by ';': 'engine' "
        "(the engine's choice), 'xla' (XLA's defaults), 'off', or a type list "
        "such as FUSION,CUSTOM_CALL",
    )
    ap.add_argument(
        "--samples",
        type=int,
        default=1,
        help="parallel samples per prompt (SamplingParams.n): each batch is batch / samples prompts (default 1)",
    )
    ap.add_argument(
        "--overlap",
        default="on",
        help="overlap scheduling (EngineConfig.overlap) settings to compare, comma-separated: off, on "
        "(default on, the engine's; off,on runs each row both ways)",
    )
    ap.add_argument(
        "--fuse-projections",
        default="on",
        help="fused q/k/v and gate/up matmuls (EngineConfig.fuse_projections) settings to compare: off, on "
        "(default on, the engine's on a GPU; off,on runs each row both ways, the fused rows on a fused "
        "copy of the model)",
    )
    ap.add_argument(
        "--scan-layers",
        default="off",
        help="layers as one scan (EngineConfig.scan_layers) settings to compare: off, on (default off, the "
        "engine's; off,on runs each row both ways, the scanned rows on a stacked copy of the model; the "
        "warm-up time is the compile time)",
    )
    ap.add_argument(
        "--cascade",
        default="auto",
        help="with --samples: cascade decode settings to compare, comma-separated: auto (the engine's "
        "rule), on, off (default auto)",
    )
    ap.add_argument(
        "--json", default=None, help="write the rows to this file (default: $OUT/serving.json when OUT is set)"
    )
    args = ap.parse_args(argv)
    long = args.long_context
    models = args.models or ("llama3-8b" if long else "smollm2,llama3-8b")

    def counts(option: str, text: str) -> list[int]:
        """A comma-separated list of positive integers, or an argparse error naming ``option``."""
        try:
            vals = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            vals = []
        if not vals or min(vals) < 1:
            ap.error(f"{option} takes positive integers, comma-separated (got {text!r})")
        return vals

    batches = counts("--batch", args.batch or ("8,32" if long else "1,32,128"))
    prompt_lens = counts(
        "--prompt-lens" if args.prompt_lens else "--prompt-len",
        args.prompt_lens or ("4096,16384" if long else str(args.prompt_len)),
    )
    gen_lens = counts("--gen-len", args.gen_len or ("16" if long else "64"))
    for option, value in (("--page-size", args.page_size), ("--prefill-tokens", args.prefill_tokens)):
        if value < 1:
            ap.error(f"{option} takes a positive integer (got {value})")
    if args.xla_max_tokens is not None and args.xla_max_tokens < 0:
        ap.error(f"--xla-max-tokens takes an integer >= 0 (got {args.xla_max_tokens})")
    backend_arg = args.backend or ("auto,xla" if long else "auto")
    xla_max = args.xla_max_tokens if args.xla_max_tokens is not None else (131072 if long else 0)
    for name in models.split(","):
        _config(name)  # an unknown name fails here, before anything runs
    if not args.cpu and common.no_gpu("serving", "--cpu runs it anyway"):
        return 1
    from jattn.demo import choose_backend
    from jattn.dispatch import MHA_OPS

    backends = []
    for name in backend_arg.split(","):
        if name not in backend_choices():
            ap.error(f"--backend {name!r}: choose from {', '.join(backend_choices())}")
        backend, notice = choose_backend(name, MHA_OPS)
        if notice:
            print(notice)
        backends.append((name, backend))
    settings = [True if s == "engine" else s for s in args.command_buffers.split(";") if s]
    cascades = {"auto": None, "on": True, "off": False}
    bad = [c for c in args.cascade.split(",") if c not in cascades]
    if bad or args.samples < 1:
        ap.error(f"--cascade takes auto, on, off (got {args.cascade!r}); --samples >= 1 (got {args.samples})")
    cascade_modes = [c for c in args.cascade.split(",") if c]
    overlaps = {"off": False, "on": True}
    overlap_modes = [o for o in args.overlap.split(",") if o]
    if not overlap_modes or any(o not in overlaps for o in overlap_modes):
        ap.error(f"--overlap takes off, on or off,on (got {args.overlap!r})")
    fuse_modes = [o for o in args.fuse_projections.split(",") if o]
    if not fuse_modes or any(o not in overlaps for o in fuse_modes):
        ap.error(f"--fuse-projections takes off, on or off,on (got {args.fuse_projections!r})")
    scan_modes = [o for o in args.scan_layers.split(",") if o]
    if not scan_modes or any(o not in overlaps for o in scan_modes):
        ap.error(f"--scan-layers takes off, on or off,on (got {args.scan_layers!r})")
    dev = jax.devices()[0]
    print(
        f"device {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"backend {backend_arg}, dtype {args.dtype}",
        flush=True,
    )

    def skip_reason(bs, prompt, be_name):
        if be_name == "xla" and xla_max and bs * prompt > xla_max:
            return (
                f"xla: {bs} x {prompt} = {bs * prompt} prompt tokens > --xla-max-tokens {xla_max} (its "
                "reference attention visits every key of the context for each query in f32: no [q x k] "
                "matrix beyond a 16M-element tile, but minutes of GPU time; --xla-max-tokens 0 runs it)"
            )
        return None

    plan = {}
    for name in models.split(","):
        plan[name] = [
            (bs, p, cb, be, casc, ov, fu, sc, g)
            for g in gen_lens
            for p in prompt_lens
            for bs in batches
            for cb in settings
            for be in backends
            for casc in cascade_modes
            for ov in overlap_modes
            for fu in fuse_modes
            for sc in scan_modes
            if skip_reason(bs, p, be[0]) is None
        ]
        est = estimate(
            _config(name, args.dtype),
            [(bs, p, be[0], g) for bs, p, _, be, *_, g in plan[name]],
            gen_lens[0],
            args.page_size,
            args.prefill_tokens,
            light_warmup=long,
            itemsize=jnp.dtype(args.dtype).itemsize,
        )
        print(f"{name}: {len(plan[name])} rows; {est.line()}", flush=True)
    rows, failures = [], 0
    for name in models.split(","):
        t0 = time.perf_counter()
        model, desc = _model(name, args.dtype)
        print(f"\n{desc}: built in {time.perf_counter() - t0:.1f} s", flush=True)
        for p in prompt_lens:
            for bs in batches:
                for be_name in dict.fromkeys(b[0] for b in backends):
                    why = skip_reason(bs, p, be_name)
                    if why:
                        print(f"  bs={bs} prompt={p} [backend {be_name}]: skipped: {why}", flush=True)
        shared = _shared_pools(plan[name], max(gen_lens), args.page_size, args.prefill_tokens) if long else {}
        fused_model = None
        if "on" in fuse_modes:  # the fused rows' model: a fused copy when unfused rows run too
            from flax import nnx

            from jattn.models.layers import fuse_projections

            fused_model = nnx.clone(model) if "off" in fuse_modes else model
            fuse_projections(fused_model)
        stacked = {}  # the scanned rows' models: stacked copies when unscanned rows run too
        if "on" in scan_modes:
            from flax import nnx

            for fu in fuse_modes:
                base = fused_model if fu == "on" else model
                stacked[fu] = nnx.clone(base) if "off" in scan_modes else base
                stacked[fu].stack_layers()
        for bs, prompt_len, cb, (be_name, backend), casc, ov, fu, sc, gen_len in plan[name]:
            pool, buckets = shared.get((prompt_len, cb, be_name), (None, None))
            tag = f" [gen {gen_len}]" if len(gen_lens) > 1 else ""
            tag += f" [command buffers: {'engine' if cb is True else cb}]" if len(settings) > 1 else ""
            tag += f" [backend {be_name}]" if len(backends) > 1 else ""
            tag += f" [{args.samples} samples, cascade {casc}]" if args.samples > 1 else ""
            tag += f" [overlap {ov}]" if len(overlap_modes) > 1 or ov == "on" else ""
            tag += f" [fused {fu}]" if len(fuse_modes) > 1 or fu == "on" else ""
            tag += f" [scan {sc}]" if len(scan_modes) > 1 or sc == "on" else ""
            try:
                r = run_one(
                    stacked[fu] if sc == "on" else fused_model if fu == "on" else model,
                    bs,
                    prompt_len,
                    gen_len,
                    args.page_size,
                    backend,
                    profile=args.profile,
                    command_buffers=cb,
                    prefill_tokens=args.prefill_tokens,
                    light_warmup=long,
                    num_pages=pool,
                    batch_buckets=buckets,
                    samples=args.samples,
                    cascade=cascades[casc],
                    overlap=overlaps[ov],
                    fuse_projections=fu == "on",
                    scan_layers=sc == "on",
                )
            except Exception as e:  # keep going: report what ran
                print(f"  bs={bs} prompt={prompt_len}{tag}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                failures += 1
                continue
            finally:
                gc.collect()  # the row's KV pool goes before the next one is made
            r["model"] = desc + tag
            r["backend"] = be_name
            rows.append(r)
            print(
                f"  bs={bs:4d} prompt={prompt_len}{tag}: prefill {r['prefill_tok_s']:9.0f} tok/s, "
                f"decode {r['decode_tok_s']:9.1f} tok/s, overall {r['overall_tok_s']:9.1f} tok/s, "
                f"engine step {r['engine_step_ms']:7.2f} ms, device step {r['device_step_ms']:7.2f} ms, "
                f"TTFT median {r['ttft_ms_median']:.0f} ms (max {r['ttft_ms_max']:.0f}), "
                f"recompiles {r['recompiles_in_timed_run']}, warm-up {r['warmup_s']:.1f} s "
                f"({r['warmup_programs']} programs), "
                f"timed run {r['wall_s']:.1f} s"
                + (
                    f", cascade steps {r['cascade_steps']}, shared prompt tokens {r['shared_prompt_tokens']}"
                    if args.samples > 1
                    else ""
                ),
                flush=True,
            )
        del model, fused_model, stacked
    out = args.json or (os.path.join(os.environ["OUT"], "serving.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    print(
        "\n| model | batch | prompt | gen | prefill tok/s | decode tok/s | overall tok/s | overall / decode "
        "| engine step ms | device step ms | TTFT ms median / max |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['model']} | {r['batch']} | {r['prompt_len']} | {r['gen_len']} | {r['prefill_tok_s']:.0f} | "
            f"{r['decode_tok_s']:.0f} | {r['overall_tok_s']:.0f} | {_ratio(r['overall_tok_s'], r['decode_tok_s'])} | "
            f"{r['engine_step_ms']:.2f} | {r['device_step_ms']:.2f} | "
            f"{r['ttft_ms_median']:.0f} / {r['ttft_ms_max']:.0f} |"
        )
    if len(backends) > 1:
        _side_by_side(rows, [b[0] for b in backends])
    prof_rows = [r for r in rows if "span_us" in r]
    if prof_rows:
        print("\n| model | batch | engine step ms | device span ms | kernel sum ms | attention ms | kernels/step |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in prof_rows:
            print(
                f"| {r['model']} | {r['batch']} | {r['engine_step_ms']:.2f} | {r['span_us'] / 1e3:.3f} | "
                f"{r['kernel_sum_us'] / 1e3:.3f} | {r['attention_us'] / 1e3:.3f} | {r['kernels_per_step']} |"
            )
    if failures:
        print(f"\n{failures} row(s) FAILED (above)")
    return 1 if failures else 0


def _ratio(a: float, b: float) -> str:
    """``a / b`` to two places, or "-" where ``b`` is 0 (a row of one generated token has no
    decode steps)."""
    return f"{a / b:.2f}" if b else "-"


def _shared_pools(plan, gen_len: int, page_size: int, prefill_tokens: int) -> dict:
    """``{(prompt_len, command buffers, backend name): (num_pages, batch buckets)}``: one
    pool (for the largest batch) and one bucket set for the rows of one prompt length
    and backend, so that they compile one extend program between them."""
    groups: dict = {}
    for bs, p, cb, (be_name, _), *_ in plan:
        groups.setdefault((p, cb, be_name), []).append(bs)
    out = {}
    for (p, cb, be_name), sizes in groups.items():
        pages_per = -(-(p + gen_len + page_size) // page_size)
        buckets = {1} | set(sizes) | {extend_batch(bs, p, prefill_tokens)[1] for bs in sizes}
        out[(p, cb, be_name)] = (1 + max(sizes) * pages_per, tuple(sorted(buckets)))
    return out


def _side_by_side(rows, names) -> None:
    """One line per (model, batch, prompt): each backend's prefill tok/s, decode tok/s
    and median TTFT beside the others ('-': skipped or failed)."""
    key = lambda r: (r["model"].split(" [backend")[0], r["batch"], r["prompt_len"])  # noqa: E731
    by = {}
    for r in rows:
        by.setdefault(key(r), {})[r["backend"]] = r
    cols = [f"{n} {what}" for what in ("prefill tok/s", "decode tok/s", "TTFT ms") for n in names]
    print("\n| model | batch | prompt | " + " | ".join(cols) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in cols) + " |")
    for (model, bs, p), per in by.items():
        cells = []
        for field, fmt in (("prefill_tok_s", "{:.0f}"), ("decode_tok_s", "{:.0f}"), ("ttft_ms_median", "{:.0f}")):
            cells += [fmt.format(per[n][field]) if n in per else "-" for n in names]
        print(f"| {model} | {bs} | {p} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
