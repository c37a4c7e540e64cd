"""``python -m jattn bench serving``: the continuous-batching serving loop, end to end.

For each model (SmolLM2-135M: the GGUF when installed, else the same shapes with random
weights; a Llama-3-8B-shaped random model) and batch size: ``bs`` requests of
``--prompt-len`` tokens each generate ``--gen-len`` tokens through :class:`Engine`
(bf16, page 16, programs compiled beforehand by a warm-up). Reported:

* decode tokens/s of the engine (steps that compiled excluded), overall tokens/s;
* engine decode step time (host planning + dispatch + device + fetching the tokens);
* device time of the same jitted decode step called back to back with no host sync in
  between (the GPU's busy time per step: kernels plus launch gaps, an upper bound on the
  sum of kernel times), so the difference is host overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

from jattn.metadata import plan_decode
from jattn.models.config import LlamaConfig
from jattn.models.engine import Engine, EngineConfig, SamplingParams
from jattn.models.llama import Llama


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
    table = np.arange(1, 1 + bs * pages, dtype=np.int32).reshape(bs, pages) % (c.num_pages - 1) + 1
    # Reads may share pages (timing only), but each request writes its own last page:
    # the planner refuses two tokens on one slot.
    table[:, -1] = np.arange(1, bs + 1) % (c.num_pages - 1) + 1
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
    args = (tokens, md, z, z + 1, zi, zi)

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
) -> dict:
    max_context = prompt_len + gen_len + page_size
    pages_per = -(-max_context // page_size)
    buckets = tuple(sorted({1, bs}))
    ecfg = EngineConfig(
        page_size=page_size,
        num_pages=1 + bs * pages_per,
        max_context=max_context,
        max_running=bs,
        max_prefill_tokens=min(min(bs, 32) * prompt_len, max(prefill_tokens, prompt_len)),
        batch_buckets=buckets,
        token_buckets=None,
        kernel_backend=backend,
        command_buffers=command_buffers,
    )
    engine = Engine(model, ecfg)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    t0 = time.perf_counter()
    # warm-up: the same shapes (compiles the extend and decode programs of this batch size)
    engine.generate([rng.integers(0, vocab, prompt_len).tolist() for _ in range(bs)], SamplingParams(max_new_tokens=3))
    warm = time.perf_counter() - t0
    compiled = engine.metrics.compilations
    engine.metrics = type(engine.metrics)(compilations=compiled)
    t0 = time.perf_counter()
    reqs = engine.generate(
        [rng.integers(0, vocab, prompt_len).tolist() for _ in range(bs)], SamplingParams(max_new_tokens=gen_len)
    )
    wall = time.perf_counter() - t0
    m = engine.metrics
    assert all(r.status == "finished" for r in reqs), [r.error for r in reqs if r.error]
    ttft = sorted(1e3 * (r.first_token_time - r.arrival_time) for r in reqs)
    dev_ms = _device_step_ms(engine, bs, prompt_len + gen_len // 2)
    extra = _profile_step(engine, bs, prompt_len + gen_len // 2) if profile else {}
    return dict(
        **extra,
        batch=bs,
        prompt_len=prompt_len,
        gen_len=gen_len,
        decode_tok_s=m.decode_tokens_per_s,
        overall_tok_s=m.generated_tokens / wall,
        engine_step_ms=m.median_decode_step_ms,
        ttft_ms_median=ttft[len(ttft) // 2],
        ttft_ms_max=ttft[-1],
        prefill_s=m.prefill_time,
        device_step_ms=dev_ms,
        recompiles_in_timed_run=m.compilations - compiled,
        warmup_s=warm,
    )


def main(argv=None) -> int:
    from jattn.demo import backend_choices

    ap = argparse.ArgumentParser(
        prog="python -m jattn bench serving", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--models",
        default="smollm2,llama3-8b",
        help="comma-separated: smollm2 (SmolLM2-135M), llama3-8b (its shapes, random "
        "weights), tiny (default: smollm2,llama3-8b)",
    )
    ap.add_argument("--batch", default="1,32,128", help="comma-separated batch sizes (default 1,32,128)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    ap.add_argument("--gen-len", type=int, default=64, help="generated tokens per request (default 64)")
    ap.add_argument("--page-size", type=int, default=16, help="KV cache page size in tokens (default 16)")
    ap.add_argument(
        "--prefill-tokens",
        type=int,
        default=16384,
        help="new tokens per extend step (longer prompts are prefilled in chunks; default 16384)",
    )
    ap.add_argument("--dtype", default="bfloat16", help="model and KV cache dtype (default bfloat16)")
    ap.add_argument(
        "--backend",
        default="auto",
        help=f"attention kernel backend(s), comma-separated to compare side by side, each one of "
        f"{', '.join(backend_choices())} (default auto)",
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
        "--json", default=None, help="write the rows to this file (default: $OUT/serving.json when OUT is set)"
    )
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.cpu:
        print(
            f"bench serving needs a GPU (jax default backend is {jax.default_backend()}); nothing to do "
            "(--cpu runs it anyway)"
        )
        return 1
    from jattn.demo import MHA_OPS, choose_backend

    backends = []
    for name in args.backend.split(","):
        if name not in backend_choices():
            ap.error(f"--backend {name!r}: choose from {', '.join(backend_choices())}")
        backend, notice = choose_backend(name, MHA_OPS)
        if notice:
            print(notice)
        backends.append((name, backend))
    settings = [True if s == "engine" else s for s in args.command_buffers.split(";") if s]
    dev = jax.devices()[0]
    print(
        f"device {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"backend {args.backend}, dtype {args.dtype}",
        flush=True,
    )
    rows = []
    for name in args.models.split(","):
        t0 = time.perf_counter()
        model, desc = _model(name, args.dtype)
        print(f"\n{desc}: built in {time.perf_counter() - t0:.1f} s", flush=True)
        runs = [(int(b), cb, be) for b in args.batch.split(",") for cb in settings for be in backends]
        for bs, cb, (be_name, backend) in runs:
            tag = f" [command buffers: {'engine' if cb is True else cb}]" if len(settings) > 1 else ""
            tag += f" [backend {be_name}]" if len(backends) > 1 else ""
            try:
                r = run_one(
                    model,
                    bs,
                    args.prompt_len,
                    args.gen_len,
                    args.page_size,
                    backend,
                    profile=args.profile,
                    command_buffers=cb,
                    prefill_tokens=args.prefill_tokens,
                )
            except Exception as e:  # keep going: report what ran
                print(f"  bs={bs}{tag}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            r["model"] = desc + tag
            rows.append(r)
            print(
                f"  bs={bs:4d}{tag}: decode {r['decode_tok_s']:9.1f} tok/s, overall {r['overall_tok_s']:9.1f} tok/s, "
                f"engine step {r['engine_step_ms']:7.2f} ms, device step {r['device_step_ms']:7.2f} ms, "
                f"TTFT median {r['ttft_ms_median']:.0f} ms (max {r['ttft_ms_max']:.0f}), "
                f"recompiles {r['recompiles_in_timed_run']}, warm-up {r['warmup_s']:.1f} s",
                flush=True,
            )
        del model
    out = args.json or (os.path.join(os.environ["OUT"], "serving.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    print("\n| model | batch | prompt | decode tok/s | overall tok/s | engine step ms | device step ms | TTFT ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['model']} | {r['batch']} | {r['prompt_len']} | {r['decode_tok_s']:.0f} | {r['overall_tok_s']:.0f} | "
            f"{r['engine_step_ms']:.2f} | {r['device_step_ms']:.2f} | {r['ttft_ms_median']:.0f} |"
        )
    prof_rows = [r for r in rows if "span_us" in r]
    if prof_rows:
        print("\n| model | batch | engine step ms | device span ms | kernel sum ms | attention ms | kernels/step |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in prof_rows:
            print(
                f"| {r['model']} | {r['batch']} | {r['engine_step_ms']:.2f} | {r['span_us'] / 1e3:.3f} | "
                f"{r['kernel_sum_us'] / 1e3:.3f} | {r['attention_us'] / 1e3:.3f} | {r['kernels_per_step']} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
