"""The GPU-time estimate that ``python -m jattn bench serving`` prints before its rows:
prefill tokens, FLOPs and seconds of a plan of rows, from rough H200 rates, and how the
bench batches prompts into extend steps (shared with its rows)."""

from __future__ import annotations

import dataclasses

from jattn.models.config import LlamaConfig


def extend_batch(bs: int, prompt_len: int, prefill_tokens: int) -> tuple[int, int]:
    """(new tokens per extend step, requests per extend step) of ``bs`` prompts of
    ``prompt_len`` tokens: prompts longer than ``prefill_tokens`` go in chunks."""
    budget = max(1, min(min(bs, 32) * prompt_len, prefill_tokens))
    return budget, max(1, min(bs, budget // prompt_len))


# Rough device rates for the time estimate (H200, bf16): big GEMMs, jattn's Mosaic
# attention, and the xla reference's f32 attention (bound by the elementwise passes over
# its 16M-element score tiles, counted over every key it visits).
EST_GEMM_FLOPS = 550e12
EST_KERNEL_ATTN_FLOPS = 400e12
EST_XLA_ATTN_FLOPS = 20e12
EST_HBM_BYTES = 3.5e12
EST_COMPILE_S = 40.0  # per program of an 8B model (a row compiles 2-3)


@dataclasses.dataclass
class Estimate:
    prefill_tokens: int = 0
    gemm_flops: float = 0.0
    attn_flops: float = 0.0  # causal, what a kernel computes
    xla_attn_flops: float = 0.0  # every key of the context, what the reference computes
    seconds: float = 0.0
    programs: int = 0

    def line(self) -> str:
        return (
            f"estimate: {self.prefill_tokens:,} prefill tokens (warm-ups included), "
            f"{self.gemm_flops / 1e15:.1f} PFLOP in the linear layers, {self.attn_flops / 1e15:.2f} PFLOP "
            f"causal attention on the kernel backends + {self.xla_attn_flops / 1e15:.2f} PFLOP visited by "
            f"the xla reference; ~{self.seconds:.0f} s of GPU time with {self.programs} programs to "
            f"compile at ~{EST_COMPILE_S:.0f} s each (assumed rates: GEMM {EST_GEMM_FLOPS / 1e12:.0f}, "
            f"kernel attention {EST_KERNEL_ATTN_FLOPS / 1e12:.0f}, xla attention {EST_XLA_ATTN_FLOPS / 1e12:.0f} "
            f"TFLOP/s, HBM {EST_HBM_BYTES / 1e12:.1f} TB/s)"
        )


def estimate(
    cfg: LlamaConfig, runs, gen_len: int, page_size: int, prefill_tokens: int, light_warmup: bool, itemsize: int = 2
):
    """Rough GPU work of ``runs`` ((bs, prompt_len, backend name) triples, or with a
    fourth element, that run's generated tokens instead of ``gen_len``) on a model of
    ``cfg``'s shapes: prefill tokens, FLOPs, seconds. With ``light_warmup`` the rows of one
    prompt length and backend share their extend program (a shared pool). ``itemsize``:
    bytes per weight and KV element (the model's dtype)."""
    h, hq, hkv, d, L = cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    layer_params = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * cfg.intermediate_size
    weight_bytes = itemsize * (L * layer_params + 2 * h * cfg.vocab_size)
    kv_bytes_per_token = itemsize * L * 2 * hkv * d
    est = Estimate()
    programs = set()
    default_gen = gen_len
    for run in runs:
        bs, prompt, be = run[:3]
        gen_len = run[3] if len(run) > 3 else default_gen
        ctx = prompt + gen_len + page_size
        budget, per_step = extend_batch(bs, prompt, prefill_tokens)
        n_req = bs + (per_step if light_warmup else bs)
        toks = n_req * prompt
        gemm = 2 * L * layer_params * toks + 2 * h * cfg.vocab_size * n_req
        attn = 2 * L * hq * 2 * d * (prompt * (prompt + 1) / 2) * n_req
        xla = 2 * L * hq * 2 * d * prompt * ctx * n_req if be == "xla" else 0.0
        decode_steps = gen_len + (1 if light_warmup else 3) + 21
        decode_s = decode_steps * (weight_bytes + bs * (prompt + gen_len) * kv_bytes_per_token) / EST_HBM_BYTES
        if be == "xla":
            decode_s *= 3  # the reference decode reads the cache in f32 chunks
        est.prefill_tokens += toks
        est.gemm_flops += gemm
        est.attn_flops += attn if be != "xla" else 0.0
        est.xla_attn_flops += xla
        shared = (prompt, be, per_step) if light_warmup else (bs, prompt, be)
        programs |= {("extend",) + shared, ("decode", bs, prompt, be)}
        if prompt > budget:  # chunks after the first extend over a prefix: a second program
            programs.add(("extend prefix",) + shared)
        est.seconds += gemm / EST_GEMM_FLOPS + decode_s
        est.seconds += xla / EST_XLA_ATTN_FLOPS if be == "xla" else attn / EST_KERNEL_ATTN_FLOPS
    est.programs = len(programs)
    est.seconds += est.programs * EST_COMPILE_S
    return est
