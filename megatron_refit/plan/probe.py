"""The serving probe (``refit.verify_serving``): its token sequences, the tolerance, the comparison.

A refit is proven only where the engine *serves* the trainer's model: bytes equal to the export
are necessary, not sufficient (an engine's own post-load step can still change the model). So
after a version lands, each replica scores a fixed probe (a few short, seeded token sequences)
through its real serving path, and the train ranks compare its per-token log-probs with the
trainer model's own forward at that version: ``log p(token t | tokens < t)`` for every token
after the first of every sequence.

Pure (no torch): the probe is lists of ints, log-probs lists of floats.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from megatron_refit.errors import ServingMismatchError

PROBE_KEYS = ("sequences", "length", "seed", "tokens", "cover_tokens")
DEFAULT_PROBE = {"sequences": 4, "length": 16, "seed": 0}
DEFAULT_COVER_TOKENS = 1024
"""At most this many tokens are added to the probe so that every expert is routed (``cover_tokens``)."""
SWEEP_TOKENS = 65536
"""The candidates for those tokens: a seeded walk over at most this much of the vocabulary."""

TOLERANCES = {"float32": 1e-3, "bfloat16": 0.02, "float16": 0.01}
"""Default largest |Δ log-prob| per probe token, by the dtype the engine computes in, plus
:data:`RELATIVE` of the token's logit magnitude (see docs/guide-serving.md for the measured
margins these leave)."""
RELATIVE = {"float32": 1e-4, "bfloat16": 0.1, "float16": 0.02}
"""Added to a token's tolerance, times ``|its logit| + |the largest logit|``
(:attr:`Reference.scale`): both sides compute the logits to a relative precision of the dtype, so
a token whose logits are large (an improbable token of a trained, peaked model: logits of 10-20)
differs by more. Measured clean in bf16 (docs/guide-serving.md, "What passes"): |Δ| / scale up to
0.020 on a nearly flat MoE model, 0.035 on a dense model and 0.050 on a MoE model trained until
peaked: bf16's 0.1 leaves twice the largest; the absolute part covers tokens whose logits are
near 0."""
FP8_TOLERANCE = 0.02
"""Added under ``trainer_quantize_fp8`` (the trainer's reference forward computes with the
FP8-rounded weights; the engine's FP8 kernels accumulate in another order)."""
LORA_TOLERANCE = 1e-3
"""Added with LoRA adapters (the engine merges them into its weights, the trainer adds their
product to each layer's output: the same model, rounded differently)."""
BULK = 0.2
"""The probe's bulk must agree far closer than its worst token: the :data:`BULK_QUANTILE` of the
scored tokens' ``|Δ|`` as a share of each one's own tolerance (``tolerance + relative x scale``)
must stay within this. Clean bf16 noise has a tail (a MoE router's near-ties send a few tokens to
another expert on the two sides; a few improbable tokens of a peaked model), so the per-token
tolerance must be wide; a fault such as a wrong RoPE base moves most tokens instead. Measured clean
in bf16, 20 refits each (docs/guide-serving.md, "What passes"): 0.030 (MoE 64 experts top-8, nearly
flat), 0.039 (peaked), 0.090 (trained hard) and 0.101 (dense, overfitted), so 0.2 keeps twice the
largest; a wrong RoPE base gave 0.38-0.40 on the MoE model in both states (two swapped experts:
0.038 flat, 0.15 peaked, below it)."""
BULK_QUANTILE = 0.9
"""Which share of the probe's tokens :data:`BULK` bounds."""
BULK_MIN_TOKENS = 40
"""A probe of fewer scored tokens is judged per token only (its quantile would be its tail)."""


@dataclass(frozen=True)
class Reference:
    """The trainer's answer to a probe: per sequence, the log-prob of each scored token,
    ``scale``: ``|its logit| + |the largest logit|`` at its position, what its error grows with
    (None: 0), and ``routes``."""

    logprobs: list[list[float]]
    scale: list[list[float]] | None = None
    routes: list[list[tuple[tuple[int, int], ...]]] | None = None
    """Of a MoE model: per sequence, per scored token, the ``(layer, expert)`` pairs the trainer's
    router sends its position to (what the calibrated check groups tokens by); None: not known."""
    draft: list[list[float]] | None = None
    """``refit.gen_draft``: per sequence, the trainer's first MTP layer's log-prob of each token
    from the third on (``log p(token t + 2 | tokens <= t + 1)``: what the engine's draft proposes
    from); None: the draft is not checked."""
    draft_scale: list[list[float]] | None = None
    """Their logits' magnitudes (as :attr:`scale` is the model's)."""


@dataclass(frozen=True)
class Probe:
    """The token sequences every replica scores (each at least 2 tokens long)."""

    sequences: tuple[tuple[int, ...], ...]

    @property
    def num_tokens(self) -> int:
        """Scored tokens (all but the first of each sequence)."""
        return sum(len(s) - 1 for s in self.sequences)


def check_probe_spec(spec: Any) -> None:
    """``ValueError`` naming the first bad value of ``refit.serving_probe`` (a mapping: either
    ``tokens`` (a list of token-id lists), or any of ``sequences``, ``length``, ``seed``; either
    with ``cover_tokens``)."""
    if spec is None:
        return
    if not isinstance(spec, dict):
        raise ValueError(f"refit.serving_probe must be a mapping (sequences, length, seed, or tokens), got {spec!r}")
    unknown = sorted(set(spec) - set(PROBE_KEYS))
    if unknown:
        raise ValueError(f"refit.serving_probe: unknown key(s) {unknown}; expected some of {list(PROBE_KEYS)}")
    cover = spec.get("cover_tokens", DEFAULT_COVER_TOKENS)
    if not isinstance(cover, int) or isinstance(cover, bool) or not 0 <= cover <= 1 << 20:
        raise ValueError(f"refit.serving_probe.cover_tokens must be an int in 0..{1 << 20}, got {cover!r}")
    if "tokens" in spec:
        if set(spec) - {"cover_tokens"} != {"tokens"}:
            raise ValueError("refit.serving_probe: give either tokens, or sequences / length / seed, not both")
        tokens = spec["tokens"]
        if not isinstance(tokens, list) or not tokens:
            raise ValueError(f"refit.serving_probe.tokens must be a non-empty list of token-id lists, got {tokens!r}")
        for i, seq in enumerate(tokens):
            if (not isinstance(seq, list) or len(seq) < 2
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in seq)):
                raise ValueError(f"refit.serving_probe.tokens[{i}] must be a list of at least 2 non-negative token "
                                 f"ids, got {seq!r}")
        return
    for key, low, high in (("sequences", 1, 64), ("length", 2, 4096), ("seed", 0, 2**63 - 1)):
        value = spec.get(key, DEFAULT_PROBE[key])
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"refit.serving_probe.{key} must be an int in {low}..{high}, got {value!r}")


def make_probe(spec: dict | None, vocab_size: int) -> Probe:
    """The probe of ``refit.serving_probe`` for a model of ``vocab_size`` tokens: the given
    ``tokens``, or ``sequences`` sequences of ``length`` token ids drawn uniformly with ``seed``
    (the same on every rank and every run)."""
    check_probe_spec(spec)
    spec = {k: v for k, v in (spec or {}).items() if k != "cover_tokens"}
    if "tokens" in spec:
        bad = [t for seq in spec["tokens"] for t in seq if t >= vocab_size]
        if bad:
            raise ValueError(f"refit.serving_probe.tokens holds token id {bad[0]}, outside the model's vocabulary "
                             f"of {vocab_size}")
        return Probe(tuple(tuple(seq) for seq in spec["tokens"]))
    spec = {**DEFAULT_PROBE, **spec}
    rng = random.Random(spec["seed"])
    return Probe(tuple(tuple(rng.randrange(vocab_size) for _ in range(spec["length"]))
                       for _ in range(spec["sequences"])))


def by_length(sequences) -> list[list[int]]:
    """The indices of ``sequences``, grouped by their length (first seen first): what one forward
    can score as a batch, without padding."""
    groups: dict[int, list[int]] = {}
    for i, sequence in enumerate(sequences):
        groups.setdefault(len(sequence), []).append(i)
    return list(groups.values())


def sweep(vocab_size: int, length: int, seed: int, limit: int = SWEEP_TOKENS):
    """Candidate sequences for expert coverage: a seeded permutation of the vocabulary (at most
    ``limit`` tokens of it) cut into sequences of ``length`` tokens, so each token id shows up once
    (the last sequence filled from the permutation's start)."""
    order = list(range(vocab_size))
    random.Random(seed).shuffle(order)
    order = order[:limit]
    for start in range(0, len(order), length):
        seq = order[start:start + length]
        yield tuple(seq + order[:length - len(seq)])


def greedy_cover(missing: set, candidates: list[set], costs: list[int], budget: int) -> list[int]:
    """The candidates (indices) that cover most of ``missing`` within ``budget``: each round takes
    the candidate that adds the most still-missing items (the first of equals), while it fits the
    budget left, until nothing is missing or nothing more fits or helps. The classic greedy set
    cover: within a factor ``ln n`` of the fewest candidates that cover everything."""
    missing, chosen, left = set(missing), [], budget
    while missing:
        best, gain = None, 0
        for i, items in enumerate(candidates):
            if i in chosen or costs[i] > left:
                continue
            g = len(items & missing)
            if g > gain:
                best, gain = i, g
        if best is None:
            break
        chosen.append(best)
        missing -= candidates[best]
        left -= costs[best]
    return chosen


def relative_tolerance(dtype: str) -> float:
    """The default relative part of the tolerance for an engine computing in ``dtype``
    (:data:`RELATIVE`; 0 for a dtype without one: its absolute tolerance is set by hand)."""
    return RELATIVE.get(dtype, 0.0)


def default_tolerance(dtype: str, *, fp8: bool = False, lora: bool = False) -> float:
    """The default tolerance for an engine computing in ``dtype`` (``TOLERANCES``), plus
    ``FP8_TOLERANCE`` under trainer-side FP8 and ``LORA_TOLERANCE`` with LoRA adapters."""
    if dtype not in TOLERANCES:
        raise ValueError(f"no default serving tolerance for dtype {dtype!r} (known: {sorted(TOLERANCES)}); "
                         "set refit.serving_tolerance")
    return TOLERANCES[dtype] + (FP8_TOLERANCE if fp8 else 0.0) + (LORA_TOLERANCE if lora else 0.0)


def compare(served: Any, reference: Reference | list[list[float]], probe: Probe, *, tolerance: float,
            floor: float, replica: int, version: int, relative: float = 0.0) -> float:
    """The largest |Δ log-prob| between what replica ``replica`` served for ``probe`` and the
    trainer's ``reference`` (one list per sequence, one value per scored token).

    Each token passes within ``tolerance`` plus ``relative`` times its :attr:`Reference.scale`, and
    the probe's bulk within :data:`BULK` of that (:func:`bulk`; a probe of at least
    :data:`BULK_MIN_TOKENS` tokens). Raises
    :class:`~megatron_refit.errors.ServingMismatchError` naming the replica, the version, the
    largest difference, how many tokens exceed and the first of them (a NaN or inf on either
    side, or a reply of another shape, always fails). ``floor``: this dtype's default tolerance;
    a mismatch that stays under it says the configured tolerance is tighter than the measured
    numerical noise."""
    if not isinstance(reference, Reference):
        reference = Reference(reference)
    where = f"refit {version}: engine replica {replica}"
    shape = [len(s) - 1 for s in probe.sequences]
    if not isinstance(served, list) or [len(s) if isinstance(s, list) else None for s in served] != shape:
        got = [len(s) if isinstance(s, list) else type(s).__name__ for s in served] if isinstance(served, list) \
            else type(served).__name__
        raise ServingMismatchError(f"{where} answered the serving probe with {got} log-probs per sequence, expected "
                                   f"{shape}: it does not serve the probe as the trainer scores it",
                                   replica=replica, version=version, max_dlogprob=math.inf, first=None)
    scale = reference.scale or [[0.0] * len(s) for s in reference.logprobs]
    worst, beyond, first, pair, within_floor = 0.0, 0, None, None, True
    for i, (got, want, sizes) in enumerate(zip(served, reference.logprobs, scale, strict=True)):
        for t, (g, w, size) in enumerate(zip(got, want, sizes, strict=True)):
            extra = relative * float(size)
            # anything non-finite on either side (a NaN reference too: max() would keep 0.0 past it, and a
            # NaN limit compares False) fails
            finite = (g is not None and w is not None and math.isfinite(float(g)) and math.isfinite(float(w))
                      and math.isfinite(extra))
            d = abs(float(g) - float(w)) if finite else math.inf
            worst = max(worst, d)
            if not finite or d > tolerance + extra:
                beyond += 1
                within_floor = within_floor and d <= floor + extra
                if first is None:
                    first, pair = (i, t + 1), (g, w)
    if not beyond:
        _judge_bulk(served, reference, tolerance=tolerance, floor=floor, relative=relative, worst=worst,
                    where=where, replica=replica, version=version)
        return worst
    tight = ""
    if within_floor:
        tight = (f"; every difference is within this dtype's measured numerical noise (default tolerance "
                 f"{floor:g}): refit.serving_tolerance={tolerance:g} is too tight for it, raise it (or set null)")
    raise ServingMismatchError(
        f"{where} does not serve the trainer's model: its log-probs differ from the trainer's by up to "
        f"{worst:.4g}, {beyond} of the probe's {probe.num_tokens} tokens beyond the tolerance "
        f"{tolerance:g} + {relative:g} x their logits' magnitude; first beyond it at sequence {first[0]}, token "
        f"{first[1]} (served {pair[0]}, trainer {_value(pair[1])}). Its bytes landed; the engine computes with "
        f"something else (e.g. its post-load step). It has not landed version {version}; its next refit is a "
        f"full one{tight}",
        replica=replica, version=version, max_dlogprob=worst, first=first)


def bulk(served: list[list[float]], reference: Reference | list[list[float]], *, tolerance: float,
         relative: float = 0.0) -> float | None:
    """The :data:`BULK_QUANTILE` (nearest rank) of every scored token's ``|Δ log-prob|`` as a share
    of its tolerance ``tolerance + relative x`` its :attr:`Reference.scale` (after :func:`compare`'s
    per-token pass: both finite and of the probe's shape); None for a probe of fewer than
    :data:`BULK_MIN_TOKENS` tokens."""
    if not isinstance(reference, Reference):
        reference = Reference(reference)
    scale = reference.scale or [[0.0] * len(s) for s in reference.logprobs]
    shares = sorted(abs(float(g) - float(w)) / (tolerance + relative * float(size))
                    for got, want, sizes in zip(served, reference.logprobs, scale, strict=True)
                    for g, w, size in zip(got, want, sizes, strict=True))
    if len(shares) < BULK_MIN_TOKENS:
        return None
    return shares[math.ceil(BULK_QUANTILE * len(shares)) - 1]


def _judge_bulk(served, reference: Reference, *, tolerance: float, floor: float, relative: float, worst: float,
                where: str, replica: int, version: int) -> None:
    """:class:`~megatron_refit.errors.ServingMismatchError` where the probe's :func:`bulk` exceeds
    :data:`BULK` (every token within its own tolerance, but most of them far off the clean noise)."""
    share = bulk(served, reference, tolerance=tolerance, relative=relative)
    if share is None or share <= BULK:
        return
    tight = ""
    if tolerance < floor and bulk(served, reference, tolerance=floor, relative=relative) <= BULK:
        tight = (f"; within this dtype's measured numerical noise (default tolerance {floor:g}): "
                 f"refit.serving_tolerance={tolerance:g} is too tight for it, raise it (or set null)")
    n = sum(len(s) for s in served)
    raise ServingMismatchError(
        f"{where} does not serve the trainer's model: the bulk of its log-probs is off, {BULK_QUANTILE:.0%} of the "
        f"probe's {n} tokens should differ from the trainer's by at most {BULK:g} of their tolerance "
        f"({tolerance:g} + {relative:g} x their logits' magnitude) and the {BULK_QUANTILE:.0%} quantile is "
        f"{share:.3g} of it (the largest difference {worst:.4g}). Clean noise moves a few tokens; this moves most "
        f"of them (a wrong RoPE base, a scale left off or applied twice). It has not landed version {version}; its "
        f"next refit is a full one{tight}",
        replica=replica, version=version, max_dlogprob=worst, first=None)


def mean_difference(served: list[list[float]], reference: Reference | list[list[float]]) -> float:
    """The mean |Δ log-prob| over every scored token (after :func:`compare` passed: both finite
    and of the probe's shape): reported beside the largest, not judged."""
    if isinstance(reference, Reference):
        reference = reference.logprobs
    diffs = [abs(float(g) - float(w)) for got, want in zip(served, reference, strict=True)
             for g, w in zip(got, want, strict=True)]
    return sum(diffs) / len(diffs) if diffs else 0.0


def _value(x: Any) -> str:
    return f"{float(x):.6g}" if isinstance(x, (int, float)) else repr(x)
