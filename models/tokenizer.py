"""A byte-level BPE tokenizer built from a GGUF file's vocabulary (``tokenizers`` package),
so the demo needs no ``transformers``. Covers GGUF ``tokenizer.ggml.model == "gpt2"`` with
the pre-tokenizers of ``tokenizer.ggml.pre`` listed in ``PRE_TOKENIZERS`` (SmolLM2, Llama 3,
Qwen 2, GPT-2); another pre-tokenizer is refused, since its words would split differently."""

from __future__ import annotations

import numpy as np

_CONTROL = 3  # llama.cpp token type of special / control tokens
_USER_DEFINED = 4  # llama.cpp token type matched whole in text, not special (e.g. <think>)

# Word-splitting patterns: the contractions, letters with one leading non-letter, digits
# (Llama 3: up to three at a time; Qwen 2: one), punctuation runs, newlines, spaces.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

# tokenizer.ggml.pre -> (split pattern or None for GPT-2's byte-level regex, digits one by one)
PRE_TOKENIZERS = {
    "smollm": (None, True),
    "gpt-2": (None, False),
    "llama-bpe": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False),
}


# llama.cpp's settings per pre-tokenizer where the file does not say: Llama 3 takes a word
# found whole in the vocabulary as one token whatever the merges build (its tokenizer.json's
# "ignore_merges"), and starts a prompt with BOS unless tokenizer.ggml.add_bos_token says no.
_DEFAULTS = {"llama-bpe": dict(ignore_merges=True, add_bos=True)}


def _pre_tokenizer(pre):
    """The ``tokenizers`` pre-tokenizer of GGUF ``tokenizer.ggml.pre`` = ``pre``."""
    from tokenizers import Regex, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
        raise NotImplementedError(
            f"GGUF tokenizer.ggml.pre={pre!r} is not supported (one of {sorted(PRE_TOKENIZERS)}): "
            "its words would split differently from the model's own tokenizer"
        )
    split, digits = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    return pre_tokenizers.Sequence(steps)


_SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def render_chat_template(template, user: str, system: str | None, token_text) -> str | None:
    """``template`` (a Hugging Face chat template, Jinja) rendered for one ``user`` turn
    (after a ``system`` one where given) with the generation prompt, ``bos_token`` /
    ``eos_token`` from ``token_text("bos" | "eos")``; None where there is no template or
    ``jinja2`` is not installed."""
    if not template:
        return None
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None
    import datetime
    import json

    def raise_exception(message):
        raise ValueError(f"the chat template refused the messages: {message}")

    # Hugging Face's environment: loop controls, its own tojson (no HTML escaping), the date
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    try:
        return env.from_string(str(template)).render(
            messages=messages, add_generation_prompt=True, bos_token=token_text("bos"), eos_token=token_text("eos")
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template could not be rendered: {type(e).__name__}: {e}") from None


class GGUFTokenizer:
    def __init__(self, reader):
        from tokenizers import Tokenizer, decoders, models

        field = lambda k: reader.fields[k].contents() if k in reader.fields else None  # noqa: E731
        kind = field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise NotImplementedError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
        tokens = field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
        types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        pre = field("tokenizer.ggml.pre")
        defaults = _DEFAULTS.get(pre, {})
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=defaults.get("ignore_merges", False)))
        tk.pre_tokenizer = _pre_tokenizer(pre)
        tk.decoder = decoders.ByteLevel()
        specials = [t for t, ty in zip(tokens, types) if ty == _CONTROL]
        user = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
        if specials or user:
            from tokenizers import AddedToken

            tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
            tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        self._tk = tk
        self.vocab_size = len(tokens)
        self.bos_token_id = field("tokenizer.ggml.bos_token_id")
        self.eos_token_id = field("tokenizer.ggml.eos_token_id")
        # llama.cpp and Hugging Face start a prompt with BOS where the file says so (Llama 3),
        # or, where it does not say, where the pre-tokenizer's default does
        add_bos = field("tokenizer.ggml.add_bos_token")
        add_bos = defaults.get("add_bos", False) if add_bos is None else add_bos
        self.add_bos = bool(add_bos) and self.bos_token_id is not None
        self.chat_template = field("tokenizer.chat_template")
        self.special_ids = {vocab[t] for t in specials}

    def encode(self, text: str) -> list[int]:
        """``text``'s ids, no BOS (a piece of text); :meth:`prompt` for a whole prompt."""
        return self._tk.encode(text, add_special_tokens=False).ids

    def prompt(self, text: str) -> list[int]:
        """A whole prompt's ids: BOS first where the file's ``add_bos_token`` asks for it."""
        return ([int(self.bos_token_id)] if self.add_bos else []) + self.encode(text)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tk.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def chat_prompt(self, user: str, system: str | None = None) -> list[int]:
        """The prompt of one user turn ending with the assistant's: the file's own
        ``tokenizer.chat_template`` rendered (Jinja, as Hugging Face renders it) where it
        has one and ``jinja2`` is installed; else ChatML (SmolLM2-Instruct, Qwen) or Llama
        3's header format, whichever the vocabulary's tokens name, or the plain
        :meth:`prompt`."""
        text = render_chat_template(self.chat_template, user, system, self._token_text)
        if text is not None:
            return self.encode(text)  # the template writes BOS itself where the model wants it
        if self.token_id("<|im_start|>") is not None:
            if system is None and _SMOLLM_SYSTEM in (self.chat_template or ""):  # SmolLM2's default system turn
                system = _SMOLLM_SYSTEM
            sys_turn = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
            text = f"{sys_turn}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
            return self.prompt(text)
        if self.token_id("<|start_header_id|>") is not None and self.token_id("<|eot_id|>") is not None:
            head = lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n"  # noqa: E731
            text = (f"{head('system')}{system}<|eot_id|>" if system else "") + f"{head('user')}{user}<|eot_id|>"
            return self.prompt(text + head("assistant"))
        return self.prompt(user)

    def _token_text(self, which: str) -> str:
        """The text of the ``"bos"`` or ``"eos"`` token ("" where the file names none)."""
        i = self.bos_token_id if which == "bos" else self.eos_token_id
        return "" if i is None else self._tk.id_to_token(int(i)) or ""

    def stop_ids(self) -> tuple[int, ...]:
        ids = {self.eos_token_id}
        for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            i = self.token_id(t)
            if i is not None:
                ids.add(i)
        return tuple(sorted(i for i in ids if i is not None))
