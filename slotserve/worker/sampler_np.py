"""Token sampling for one step with numpy alone: the torch `Sampler` of `worker/sampler.py` for
a process that should not load torch (the native engine core: torch costs ~145 MB resident).

The same order of operations (per row): the grammar's token bitmask (disallowed tokens get
-inf, so everything below, logprobs included, sees only allowed tokens); raw log-softmax for
logprobs; logit_bias; min_tokens masking; repetition penalty (HF semantics, over prompt +
output), frequency and presence penalties (over output); greedy rows take the argmax here; the
others go through temperature, min-p, top-k, top-p (`filtered_logits`) and an exponential race
(argmax of probs / Exp(1) noise, which samples from probs exactly).

Noise: a seeded row draws from its own `np.random.Generator(np.random.PCG64(seed))`
(`standard_exponential`, float32), so its token does not depend on the rest of the batch; the
unseeded rows share the sampler's generator. These are not torch's generators: a seeded request
gets other tokens here than under the torch sampler, drawn from the same distribution. The race
runs over the tokens left finite only, one draw each in token order (so a filtered row draws
fewer than V): after top-p that is a few hundred of a 262k vocabulary, and 262k draws would
cost 1 ms a row, more than all the rest.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from slotserve.worker.sampling_arrays import F32, I64, SampledArrays, SamplingArrays

GREEDY_EPS = 1e-5
_NEG_INF = np.float32(-np.inf)
# Exp(1) can round to 0; a zero would turn a 0-probability token into NaN.
_NOISE_MIN = np.float32(1e-20)

# Byte value -> the additive bias of its 8 tokens (bit i of the byte: token 8k + i allowed).
BYTE_BIAS = np.array([[0.0 if (b >> i) & 1 else -np.inf for i in range(8)] for b in range(256)],
                      dtype=np.float32)


class Scratch:
    """Rows reused for every row (and, in the sampler, every step): a fresh [V] array costs its
    page faults, ~0.5 ms a megabyte, more than the arithmetic on it."""

    def __init__(self, vocab: int) -> None:
        self.values = np.empty(vocab, dtype=np.float32)
        self.spare = np.empty(vocab, dtype=np.float32)
        self.noise = np.empty(vocab, dtype=np.float32)
        self.mask = np.empty(vocab, dtype=bool)


def _exp_shifted(x: F32, out: F32) -> F32:
    """exp(x - max(x)) into `out`: the softmax's numerators, 1 at the top."""
    np.subtract(x, x.max(), out=out)
    np.exp(out, out=out)
    return out


def apply_grammar_bitmask(logits: F32, rows: I64 | None,
                          bitmask: npt.NDArray[np.int32]) -> None:
    """Disallowed tokens of the given rows (None: rows 0..M-1) get -inf, in place. Bitmask rows
    are packed [M, ceil(V'/32)] int32 (bit i of word w: token 32w + i allowed); a byte lookup
    turns each into its additive row (ten times cheaper than unpacking bits to a bool mask)."""
    vocab = logits.shape[1]
    # Little-endian words, so that byte k of a row holds tokens 8k..8k+7 on any machine.
    packed = np.ascontiguousarray(bitmask, dtype="<i4")
    if packed.shape[1] * 32 < vocab:
        raise ValueError(f"grammar bitmask covers {packed.shape[1] * 32} < {vocab} tokens")
    bias = np.empty((packed.shape[1] * 4, 8), dtype=np.float32)
    targets: Iterable[int] = range(packed.shape[0]) if rows is None else rows.tolist()
    # Row by row: one [V] bias buffer instead of an [M, V] one; a row listed twice adds twice,
    # as torch's index_add_ does.
    for j, row in enumerate(targets):
        np.take(BYTE_BIAS, packed[j].view(np.uint8), axis=0, out=bias)
        logits[row] += bias.reshape(-1)[:vocab]


def log_softmax(logits: F32, scratch: F32 | None = None) -> F32:
    """Row-wise log-softmax as torch computes it: (x - max) - log(sum(exp(x - max))). The exp
    goes through one scratch row: a second [N, V] array would cost its page faults (~9 ms at
    [32, 262144]) on top of the one returned."""
    out: F32 = logits - logits.max(axis=1, keepdims=True)
    if scratch is None:
        scratch = np.empty(out.shape[1], dtype=np.float32)
    for row in out:
        row -= np.log(np.exp(row, out=scratch).sum())
    return out


def top_logprobs(logprobs: F32, k: int) -> tuple[I64, F32]:
    """The k largest entries of each row in descending order, ties to the lower token id (a NaN
    ranks highest, as in torch.topk). A partition of the whole row costs 1.5 ms at 262k, so
    each row first keeps the entries at or above the k-th largest of its 64-way maxima (k
    distinct entries reach that value, so the top k are among them): a few dozen."""
    num_rows, vocab = logprobs.shape
    k = min(k, vocab)
    blocks = vocab // 64
    floor = np.full(num_rows, -np.inf, dtype=np.float32)
    if blocks >= k:
        maxima = logprobs[:, :blocks * 64].reshape(num_rows, 64, blocks).max(axis=1)
        floor = np.partition(maxima, blocks - k, axis=1)[:, blocks - k]
    ids = np.empty((num_rows, k), dtype=np.int64)
    for row, x in enumerate(logprobs):
        cand = np.flatnonzero(~(x < floor[row]))  # NaNs too
        key = x[cand]
        key[np.isnan(key)] = np.inf
        kth = np.partition(key, key.size - k)[key.size - k]
        # All above the k-th value, then the lowest ids among those equal to it.
        above = np.flatnonzero(key > kth)
        pick = np.concatenate([above, np.flatnonzero(key == kth)[:k - above.size]])
        ids[row] = cand[pick[np.lexsort((pick, -key[pick]))]]
    return ids, np.take_along_axis(logprobs, ids, axis=1)


def apply_repetition_penalty(logits: F32, ids: I64, penalty: F32) -> None:
    """HF semantics, in place: a seen token's logit is divided by p when positive, multiplied
    when not. `ids` [N, L] is padded with the vocabulary size."""
    rows, cols = np.nonzero(ids < logits.shape[1])
    tokens = ids[rows, cols]
    # Gathered before the write, so a token seen twice is penalised once.
    values = logits[rows, tokens]
    p = penalty.astype(np.float32, copy=False)[rows]
    logits[rows, tokens] = np.where(values > 0, values / p, values * p)


def apply_frequency_presence(logits: F32, ids: I64, frequency: F32, presence: F32) -> None:
    """In place: logit - frequency * count - presence * (count > 0), over the output ids (padded
    with the vocabulary size); only the seen tokens are touched, the rest would subtract 0."""
    vocab = logits.shape[1]
    rows, cols = np.nonzero(ids < vocab)
    keys, counts = np.unique(rows * vocab + ids[rows, cols], return_counts=True)
    rows, tokens = np.divmod(keys, vocab)
    # Evaluated in float32 and in torch's order, so the results are the same bits.
    logits[rows, tokens] = ((logits[rows, tokens]
                             - frequency.astype(np.float32, copy=False)[rows]
                             * counts.astype(np.float32))
                            - presence.astype(np.float32, copy=False)[rows])


def _apply_top_p(x: F32, e: F32, top_p: np.float32, scratch: Scratch) -> None:
    """`apply_top_k_top_p`'s top-p on one row, in place: sorted ascending, the low tail whose
    cumulative probability is <= 1 - p is dropped, the top token always survives. `e` is
    exp(x - max(x)), 0 where x is already -inf.

    Only the candidates are sorted (all 262k cost 8 ms): any tokens below a floor that together
    weigh at most slack = (1 - p) / 2 lie in the dropped tail. Every 64th token estimates where
    the mass below reaches slack / 2; one exact sum checks it, and if it fails, slack / V is a
    floor for sure. Torch's unstable sort orders tied logits arbitrarily; at a tie on the cut
    the same number survive, here the higher ids (as under a stable sort)."""
    total = float(e.sum(dtype=np.float64))
    slack = (1.0 - float(top_p)) / 2 * total
    sample = np.sort(e[::64])
    below = np.cumsum(sample, dtype=np.float64) * 64
    floor = sample[min(int(np.searchsorted(below, slack / 2, side="right")), sample.size - 1)]
    # Not under the sure floor: a grammar's zeros could otherwise let every token through.
    floor = max(float(floor), slack / x.size)
    above = np.greater_equal(e, floor, out=scratch.mask)
    if total - float(np.multiply(e, above, out=scratch.spare).sum(dtype=np.float64)) > slack:
        above = np.greater_equal(e, slack / x.size, out=scratch.mask)
    values = np.sort(x[above])
    probs = np.exp(values - values[-1]).astype(np.float64) / total
    # Torch's cumsum accumulates float32 probabilities in double and rounds to float32.
    cum = ((1.0 - probs.sum()) + np.cumsum(probs)).astype(np.float32)
    limit = np.float32(1.0) - top_p
    drop = min(int(np.searchsorted(cum, limit, side="right")), values.size - 1)
    cut = values[drop]
    np.putmask(x, np.less(x, cut, out=scratch.mask), _NEG_INF)
    ties = drop - int(np.searchsorted(values, cut, side="left"))
    if ties:
        x[np.flatnonzero(x == cut)[:ties]] = _NEG_INF


def filtered_logits(logits: F32, arrays: SamplingArrays, rows: I64 | None = None,
                    scratch: Scratch | None = None) -> F32:
    """Temperature (greedy rows: 1), min-p, top-k and top-p, in place on the given rows (None:
    every row), as the torch sampler applies them: what is left finite is what can be drawn."""
    vocab = logits.shape[1]
    buf = Scratch(vocab) if scratch is None else scratch
    temperature = arrays.temperature.astype(np.float32, copy=False)
    min_p = None if arrays.min_p is None else arrays.min_p.astype(np.float32, copy=False)
    top_p = None if arrays.top_p is None else arrays.top_p.astype(np.float32, copy=False)
    with np.errstate(invalid="ignore", over="ignore"):
        for row in range(logits.shape[0]) if rows is None else rows.tolist():
            x = logits[row]
            if temperature[row] >= GREEDY_EPS and temperature[row] != 1:
                x /= temperature[row]
            e = None  # exp(x - max), computed once for min-p and top-p
            if min_p is not None and min_p[row] > 0:
                e = _exp_shifted(x, buf.values)
                # probs < min_p * max(probs), with the softmax's common 1/sum cancelled.
                low = np.less(e, min_p[row], out=buf.mask)
                np.putmask(x, low, _NEG_INF)
                np.putmask(e, low, 0)
            if arrays.top_k is not None and 0 < arrays.top_k[row] < vocab:
                # The k-th largest value; ties with it survive, as in apply_top_k_top_p.
                k = int(arrays.top_k[row])
                np.copyto(buf.spare, x)
                buf.spare.partition(vocab - k)
                low = np.less(x, buf.spare[vocab - k], out=buf.mask)
                np.putmask(x, low, _NEG_INF)
                if e is not None:
                    np.putmask(e, low, 0)
            if top_p is not None and top_p[row] < 1:
                e = _exp_shifted(x, buf.values) if e is None else e
                _apply_top_p(x, e, top_p[row], buf)
    return logits


class NumpySampler:
    """The torch `Sampler`'s step on numpy arrays (see the module docstring)."""

    def __init__(self, seed: int | None = None) -> None:
        # One generator for every unseeded row (OS entropy when seed is None).
        self.generator = np.random.Generator(np.random.PCG64(seed))
        self.scratch = Scratch(0)

    def __call__(self, logits: npt.NDArray[np.floating], arrays: SamplingArrays) -> SampledArrays:
        """`logits` [N, V] float32 is the sampler's own: it is modified in place (a copy of a
        [32, 262144] matrix costs milliseconds)."""
        logits = np.asarray(logits, dtype=np.float32)
        num_rows, vocab = logits.shape
        if self.scratch.mask.size != vocab:
            self.scratch = Scratch(vocab)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            if arrays.grammar_bitmask is not None:
                apply_grammar_bitmask(logits, arrays.grammar_rows, arrays.grammar_bitmask)
            raw_logprobs = None
            if arrays.max_num_logprobs is not None:
                raw_logprobs = log_softmax(logits, self.scratch.values)

            if (arrays.bias_rows is not None and arrays.bias_tokens is not None
                    and arrays.bias_values is not None):
                # Unbuffered, so a (row, token) pair given twice adds both values.
                np.add.at(logits, (arrays.bias_rows, arrays.bias_tokens),
                          arrays.bias_values.astype(np.float32, copy=False))
            if arrays.masked_rows is not None and arrays.masked_tokens is not None:
                logits[arrays.masked_rows, arrays.masked_tokens] = _NEG_INF
            if arrays.repetition_penalty is not None and arrays.prompt_output_ids is not None:
                apply_repetition_penalty(logits, arrays.prompt_output_ids,
                                         arrays.repetition_penalty)
            if (arrays.frequency_penalty is not None and arrays.presence_penalty is not None
                    and arrays.output_ids is not None):
                apply_frequency_presence(logits, arrays.output_ids, arrays.frequency_penalty,
                                         arrays.presence_penalty)

            if arrays.all_greedy:
                # numpy's argmax is torch.argmax's: the first maximum, a NaN counting as one.
                sampled = logits.argmax(axis=1).astype(np.int64, copy=False)
            else:
                sampled = np.empty(num_rows, dtype=np.int64)
                greedy = arrays.temperature < GREEDY_EPS
                for row in np.flatnonzero(greedy).tolist():
                    sampled[row] = logits[row].argmax()
                # Only the random rows are filtered and drawn: a greedy row's draw is discarded.
                random_rows = np.flatnonzero(~greedy)
                filtered_logits(logits, arrays, random_rows, self.scratch)
                seeds = arrays.row_seeds or {}
                for row in random_rows.tolist():
                    seed = seeds.get(row)
                    generator = (self.generator if seed is None
                                 else np.random.Generator(np.random.PCG64(seed)))
                    sampled[row] = _race(logits[row], generator, self.scratch)

            out = SampledArrays(sampled=sampled)
            if raw_logprobs is not None:
                out.sampled_logprobs = raw_logprobs[np.arange(num_rows), sampled]
                if arrays.max_num_logprobs:
                    out.topk_ids, out.topk_logprobs = top_logprobs(raw_logprobs,
                                                                   arrays.max_num_logprobs)
        return out


def _race(x: F32, generator: np.random.Generator, scratch: Scratch) -> int:
    """One draw from softmax(x) by the exponential race: argmax(probs / Exp(1) noise), over the
    tokens of non-zero probability only. The softmax's 1/sum is left out: a common factor does
    not move the argmax."""
    finite = np.greater(x, _NEG_INF, out=scratch.mask)
    support = None
    if not finite.all():
        support = np.flatnonzero(finite)
        if support.size == 0:  # nothing allowed: torch's probs are all NaN, its argmax 0
            return 0
        x = x[support]
    probs = _exp_shifted(x, scratch.values[:x.size])
    noise = generator.standard_exponential(dtype=np.float32, out=scratch.noise[:x.size])
    np.maximum(noise, _NOISE_MIN, out=noise)
    pick = int(np.divide(probs, noise, out=probs).argmax())
    return pick if support is None else int(support[pick])
