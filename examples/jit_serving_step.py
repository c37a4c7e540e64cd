"""The jitted serving step with several concurrent requests (continuous batching).

Requests arrive at different steps with different prompt lengths and budgets; each engine
step is one jitted call (an extend batch of newly admitted requests, or a decode batch of
all running ones) with the paged KV cache donated. The step is compiled once per bucket:
the compilation count stops growing once every bucket was seen.

    python examples/jit_serving_step.py            # tiny random Llama (fast)
    python examples/jit_serving_step.py --mla      # tiny random DeepSeek-style MLA model
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from flax import nnx

from jattn.models.config import DeepseekConfig, LlamaConfig
from jattn.models.deepseek import Deepseek
from jattn.models.engine import Engine, EngineConfig, SamplingParams
from jattn.models.llama import Llama


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mla", action="store_true")
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args()
    if args.mla:
        model = Deepseek(DeepseekConfig.tiny(), rngs=nnx.Rngs(0), std=0.3)
    else:
        model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0), std=0.3)
    engine = Engine(
        model,
        EngineConfig(
            page_size=8, num_pages=128, max_context=96, batch_buckets=(1, 2, 4, 8), token_buckets=(32, 64, 128)
        ),
    )
    rng = np.random.default_rng(0)
    # (arrival step, prompt length, max new tokens); one bad request: an empty prompt
    arrivals = [(int(2 * i), int(rng.integers(3, 30)), int(rng.integers(4, 20))) for i in range(args.requests)]
    arrivals.append((3, 0, 5))
    step = 0
    while arrivals or engine.has_work():
        for a in [a for a in arrivals if a[0] <= step]:
            arrivals.remove(a)
            sp = SamplingParams(max_new_tokens=a[2], temperature=0.8, top_p=0.95, seed=a[0])
            rid = engine.add_request(rng.integers(0, model.config.vocab_size, a[1]).tolist(), sp)
            req = engine.requests[rid]
            print(
                f"step {step:3d}: + request {rid} ({a[1]} prompt tokens)"
                + (f" -> error: {req.error}" if req.status == "error" else "")
            )
        info = engine.step()
        print(
            f"step {step:3d}: {info.mode:6s} batch={len(info.rids):2d} running={len(engine.running):2d} "
            f"free pages={engine.allocator.num_free:3d} compilations={engine.metrics.compilations}"
            + (
                " (compiled)"
                if info.compiled
                else " (in flight)"  # overlap: launched, read back by the next step() call
                if info.seconds is None
                else f" {1e3 * info.seconds:6.2f} ms"
            )
            + "".join(
                f"  [request {i} done: {len(engine.requests[i].output_tokens)} tokens, "
                f"{engine.requests[i].finish_reason}]"
                for i in info.finished
            )
        )
        step += 1
    print(engine.metrics.summary())
    print(f"device: {jax.devices()[0].device_kind}")


if __name__ == "__main__":
    main()
