"""Flax NNX models served by jattn: Llama-family (GQA) and DeepSeek MLA, weight loading
(Hugging Face state dicts / safetensors, GGUF), and a continuous-batching serving engine."""

from jattn.models.config import DeepseekConfig, LlamaConfig, RopeScaling

__all__ = ["DeepseekConfig", "LlamaConfig", "RopeScaling"]
