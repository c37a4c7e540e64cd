"""A small torch serving loop that uses jattn as its attention backend.

The engine owns a torch KV pool (per layer ``[num_pages * page_size, num_kv_heads, head_dim]``,
as tokenspeed's and SGLang's pools), allocates pages on the host, runs a prefill of several
requests and then decode steps, and calls ``jattn.bridge.TorchMHABackend`` exactly like
tokenspeed calls its MHA backend (``MHAAttnBackend``).
Every output is checked against a plain torch attention over the K/V the engine
produced. Runs on the CPU (torch CPU + JAX CPU) or a GPU.

    python examples/torch_bridge.py
"""

from __future__ import annotations

import contextlib
import math

try:
    import torch
except ImportError:
    raise SystemExit(
        'examples/torch_bridge.py needs PyTorch: pip install -e ".[torch]" in the jattn '
        "checkout; on a CPU-only machine: pip install torch --index-url "
        "https://download.pytorch.org/whl/cpu"
    ) from None

from jattn import ForwardMode, MHAConfig
from jattn.bridge import AttentionLayer, TorchKVPool, TorchMHABackend


def torch_attention(q, K, V, n_new):
    """q [n, Hq, D], K/V [L, Hkv, D] of one request; causal; f32."""
    g = q.shape[1] // K.shape[1]
    K, V = K.repeat_interleave(g, 1), V.repeat_interleave(g, 1)
    s = torch.einsum("nhd,lhd->hnl", q, K) / math.sqrt(q.shape[-1])
    L = K.shape[0]
    pos = torch.arange(q.shape[0])[:, None] + (L - n_new)
    s = s.masked_fill(torch.arange(L)[None, :] > pos, -float("inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), V)


def main():
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() and __import__("jax").default_backend() == "gpu" else "cpu"
    hq, hkv, d, ps, num_layers, num_pages = 8, 2, 64, 16, 2, 64
    cfg = MHAConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps, context_len=256, num_pages=num_pages)
    pool = TorchKVPool(
        num_layers=num_layers, num_pages=num_pages, page_size=ps, num_kv_heads=hkv, head_dim=d, device=dev
    )
    backend = TorchMHABackend(cfg)
    layers = [AttentionLayer(i, hq, hkv, d) for i in range(num_layers)]
    wq = [torch.randn(d * hq, d * hq, device=dev, dtype=torch.bfloat16) / math.sqrt(d * hq) for _ in layers]

    prompt_lens = [37, 5, 20]
    req_to_page = torch.zeros(len(prompt_lens), cfg.max_num_pages, dtype=torch.int32)
    free = list(range(num_pages - 1, 0, -1))  # page 0 is the dummy page
    for r, n in enumerate(prompt_lens):
        req_to_page[r, : -(-(n + 8) // ps)] = torch.tensor([free.pop() for _ in range(-(-(n + 8) // ps))])
    rpi = torch.arange(len(prompt_lens), dtype=torch.int32)
    history = {(l, r): ([], []) for l in range(num_layers) for r in range(len(prompt_lens))}
    lens = [0] * len(prompt_lens)
    worst = 0.0

    def step(mode, new):
        nonlocal lens, worst
        lens = [a + b for a, b in zip(lens, new)]
        backend.init_forward_metadata(
            len(new), len(new), rpi, torch.tensor(lens), req_to_page, mode, extend_seq_lens=torch.tensor(new)
        )
        T = sum(new)
        x = torch.randn(T, hq * d, device=dev, dtype=torch.bfloat16)
        for layer in layers:
            q = x @ wq[layer.layer_id]
            k = torch.randn(T, hkv * d, device=dev, dtype=torch.bfloat16)
            v = torch.randn(T, hkv * d, device=dev, dtype=torch.bfloat16)
            fwd = backend.forward_extend if mode is ForwardMode.EXTEND else backend.forward_decode
            out = fwd(q, k, v, layer, None, pool, len(new), save_kv_cache=True)
            row = 0
            for r, n in enumerate(new):
                hk, hv = history[(layer.layer_id, r)]
                hk.append(k[row : row + n].float().cpu().view(n, hkv, d))
                hv.append(v[row : row + n].float().cpu().view(n, hkv, d))
                ref = torch_attention(q[row : row + n].float().cpu().view(n, hq, d), torch.cat(hk), torch.cat(hv), n)
                err = (out[row : row + n].float().cpu().view(n, hq, d) - ref).abs().max().item()
                worst = max(worst, err)
                row += n
            x = out  # the next layer's input (an engine would apply o_proj, MLP, ...)

    # On a GPU with sync="stream" (what the default "auto" picks where a one-time check passes)
    # the engine can run its torch work on XLA's compute stream: one stream orders torch and
    # jattn, and no fences are made.
    shared = torch.cuda.stream(backend.stream) if backend.stream is not None else contextlib.nullcontext()
    with shared:
        step(ForwardMode.EXTEND, prompt_lens)
        for _ in range(6):
            step(ForwardMode.DECODE, [1] * len(prompt_lens))
    ok = worst < 3e-2
    print(
        f"torch engine via jattn.bridge on {dev}: prefill {prompt_lens} + 6 decode steps, "
        f"{num_layers} layers; max |out - torch reference| = {worst:.2e} -> {'OK' if ok else 'MISMATCH'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
