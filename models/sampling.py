"""How the engine's requests sample: :class:`SamplingParams` (validated per request) and
:func:`sample_tokens`, the jitted sampler (greedy, or temperature with top-k, top-p and
min-p, with a key per request and token, so a request's tokens do not depend on the rest
of the batch)."""

from __future__ import annotations

import dataclasses
import math
import secrets

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MAX_SAMPLES", "SamplingParams", "sample_tokens", "wrap_seed"]

_INT32 = 2**31
_F32_MAX = float(np.finfo(np.float32).max)
MAX_SAMPLES = 1024  # the largest SamplingParams.n: each sample is a request of its own


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _is_finite(x) -> bool:
    """``math.isfinite`` that says False for an int past the float range (where it raises)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and stops.

    ``temperature`` 0 is greedy; otherwise the logits are divided by the temperature and
    filtered, in Hugging Face ``generate``'s order: ``top_k`` (the k most likely tokens; 0
    keeps all), ``top_p`` (``0 < top_p <= 1``: the smallest set whose probability, among
    the tokens top-k kept, reaches it) and ``min_p`` (``0 <= min_p <= 1``: tokens at least
    ``min_p`` times as likely as the most likely one); the n-th token is drawn with the key
    ``fold_in(key(seed), n)``. ``seed`` is any integer, taken modulo 2**32,
    for output that repeats run to run; None (the default) draws a fresh random seed for
    each request when it is validated (as vLLM and SGLang do), so the same prompt sampled
    twice gives two samples. ``stop_token_ids``: token ids that end the request (the stop
    token is kept in the output); a single int is one stop token, None none. ``n``:
    parallel samples of the prompt, at most :data:`MAX_SAMPLES` (sample ``i`` is seeded
    ``seed + i``); the engine prefills the prompt once and the samples share its pages.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed per request
    stop_token_ids: tuple = ()
    n: int = 1
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0  # 0: no limit

    def validated(self) -> "SamplingParams":
        """A normalised copy (``stop_token_ids`` a tuple of ints, ``seed`` a signed
        32-bit int with the same low 32 bits, drawn at random where it is None);
        ``ValueError`` / ``TypeError`` naming the field and the rule it breaks."""
        n = self.max_new_tokens
        if not _is_int(n) or n < 1:
            raise ValueError(f"max_new_tokens={n!r} must be an integer >= 1")
        t = self.temperature
        if not _is_real(t) or not _is_finite(t) or not 0 <= t <= _F32_MAX:
            raise ValueError(f"temperature={t!r} must be a finite number >= 0 (0 is greedy) that f32 holds")
        p = self.top_p
        if not _is_real(p) or not _is_finite(p) or not 0 < p <= 1:
            raise ValueError(f"top_p={p!r} must be a number in (0, 1]")
        s = secrets.randbits(32) if self.seed is None else self.seed
        if not _is_int(s):
            raise TypeError(f"seed={s!r} must be an integer or None (a random seed)")
        stop = self.stop_token_ids
        if stop is None:
            stop = ()
        elif _is_int(stop):
            stop = (stop,)
        try:
            stop = tuple(stop)
        except TypeError:
            raise TypeError(f"stop_token_ids={stop!r} must be None, an int or a sequence of ints") from None
        bad = [x for x in stop if not _is_int(x)]
        if bad:
            raise TypeError(f"stop_token_ids must hold integers, got {bad[0]!r}")
        k = self.n
        if not _is_int(k) or not 1 <= k <= MAX_SAMPLES:
            raise ValueError(f"n={k!r} must be an integer in [1, {MAX_SAMPLES}] (parallel samples)")
        top_k = self.top_k
        if not _is_int(top_k) or not 0 <= top_k < _INT32:
            raise ValueError(f"top_k={top_k!r} must be an integer >= 0 (0: no limit) that int32 holds")
        min_p = self.min_p
        if not _is_real(min_p) or not _is_finite(min_p) or not 0 <= min_p <= 1:
            raise ValueError(f"min_p={min_p!r} must be a number in [0, 1] (0: no limit)")
        stop = tuple(int(x) for x in stop)
        return SamplingParams(int(n), float(t), float(p), wrap_seed(s), stop, int(k), int(top_k), float(min_p))


def wrap_seed(seed: int) -> int:
    """``seed`` as the signed 32-bit int with the same low 32 bits."""
    return (int(seed) + _INT32) % (2 * _INT32) - _INT32


def top_p_keep(sorted_logits, top_p):
    """bool[B, V]: the tokens (logits f32[B, V] sorted in descending order) inside each
    row's nucleus ``top_p`` f32[B]: those whose preceding probability mass is below it.
    The top token is always kept, and ``top_p = 1`` keeps every token (the f32 mass before
    a tail token can round to 1)."""
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    top = jnp.arange(sorted_logits.shape[-1]) == 0  # kept even where top_p rounds to 0 in f32
    return (before < top_p[:, None]) | (top_p[:, None] >= 1.0) | top[None, :]


def sample_tokens(logits, temperature, top_p, seeds, counters, *, greedy_only: bool, top_k=None, min_p=None):
    """Next tokens i32[B] from logits f32[B, V]; per-row temperature f32[B] (0 = greedy),
    top_p f32[B], seeds / counters i32[B] (key = fold_in(key(seed), counter)), top_k
    i32[B] (0: no limit) and min_p f32[B] (0: no limit), None for no limit in any row."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy_only:
        return greedy
    t = jnp.maximum(temperature, 1e-6)[:, None]
    scaled = logits / t
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(sorted_logits.shape[-1])[None, :]
    if top_k is not None:  # before top-p: the nucleus is taken among the k kept
        k = top_k[:, None]
        sorted_logits = jnp.where((k <= 0) | (rank < k), sorted_logits, -jnp.inf)
    keep = top_p_keep(sorted_logits, top_p)
    if min_p is not None:  # p >= min_p * p_max, as logits: l >= l_max + log(min_p)
        keep &= sorted_logits >= sorted_logits[:, :1] + jnp.log(min_p)[:, None]
    sorted_logits = jnp.where(keep | (rank == 0), sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
    pick = jax.vmap(jax.random.categorical)(keys, sorted_logits)
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def sampling_arrays(groups, bs_pad: int, pending=()):
    """``(temperature, top_p, seeds, counters, top_k, min_p, greedy_only)`` per row for the requests of
    ``groups`` (one list per device; each padded to ``bs_pad`` rows, device ``d``'s row
    ``i`` at ``d * bs_pad + i``); a request's counter is its generated-token count, plus
    one for a request in ``pending`` (rids whose last token is sampled, not yet seen)."""
    n = len(groups) * bs_pad
    temp, top_p = np.zeros(n, np.float32), np.ones(n, np.float32)
    seeds, counters = np.zeros(n, np.int32), np.zeros(n, np.int32)
    top_k, min_p = np.zeros(n, np.int32), np.zeros(n, np.float32)
    for d, reqs in enumerate(groups):
        for i, r in enumerate(reqs, start=d * bs_pad):
            temp[i], top_p[i] = r.params.temperature, r.params.top_p
            top_k[i], min_p[i] = r.params.top_k, r.params.min_p
            seeds[i], counters[i] = r.params.seed, len(r.output_tokens) + (r.rid in pending)
    return temp, top_p, seeds, counters, top_k, min_p, bool((temp <= 0).all())
