"""Speculative decoding's control plane: where drafts come from without a model (n-gram
lookup), how long each job's draft is, and when drafting pays for the step it makes longer.

A verify step feeds a job its last token plus ``k`` drafts and samples all ``k + 1`` rows; the
drafts accepted (see `accept_run`) and one more token come out of one forward. Whether a draft
token pays depends on two things this module measures as the engine runs:

- the job's acceptance rate ``alpha`` (`DraftStats`): draft position ``j`` survives with about
  ``alpha ** j``;
- the step's cost by tokens fed (`StepCostModel`, a least-squares line ``seconds = fixed +
  per_token * tokens`` over the steps measured on this device): a draft token adds
  ``per_token``, and a step of ``B`` jobs makes ``B`` tokens in ``fixed + per_token * B``.

Draft position ``j`` is worth its cost when ``alpha ** j`` exceeds `StepCostModel.threshold`,
the extra cost of one draft token (plus the drafter's own cost per token) over the time the
batch takes per token it makes. Small batches of a memory-bound model draft long; large
batches, where a forward's cost grows with its tokens, draft little or nothing. A job whose
drafts keep failing stops drafting and only probes one token now and then
(`DraftStats.PROBE_INTERVAL`), and never so often that its probes cost more than
`DraftStats.PROBE_BUDGET` of its tokens' time (a probe costs the threshold, in produced tokens,
which a slow drafter or a large batch raises above 1), so a drafter that is always wrong, or too
slow to pay, costs almost nothing.

Pure Python: the generator feeds it token histories and step timings.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def accept_run(drafts: Sequence[int], drawn: Sequence[int]) -> list[int]:
    """The tokens a verify step yields: ``drawn[j]`` is the token drawn from the target's row
    ``j`` (the distribution after ``drafts[:j]``); drafts are accepted while they equal the
    draw, and the first draw that differs (or the one after the last draft) ends the run.

    Every yielded token is a draw from the target's own distribution at its position, with the
    RNG counter the job would use there without drafts, so output is the same as plain
    decoding: greedy and seeded sampled jobs alike ("draw from p; accept if equal", exact for
    deterministic drafts)."""
    if len(drawn) != len(drafts) + 1:
        raise ValueError(f"{len(drawn)} drawn tokens for {len(drafts)} drafts; a verify step "
                         "draws one token per draft plus one")
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == drawn[accepted]:
        accepted += 1
    return list(drawn[: accepted + 1])


def accept_sampled(drafts: Sequence[int], accepted: Sequence[bool],
                   replacements: Sequence[int]) -> list[int]:
    """The tokens a verify step yields for drafts sampled from a draft distribution ``q``
    (Leviathan et al. 2023; Chen et al. 2023): draft ``j`` is kept when ``accepted[j]`` (drawn
    with probability ``min(1, p(d) / q(d))``); the first rejected one is replaced by
    ``replacements[j]``, a draw from ``norm(max(0, p - q))``, and ends the run; when every
    draft is kept, ``replacements[-1]`` (a draw from the last row's ``p``) follows. The tokens
    then follow the target's distribution ``p`` exactly."""
    if len(accepted) != len(drafts) or len(replacements) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need as many accept flags and one replacement "
                         f"more; got {len(accepted)} and {len(replacements)}")
    run: list[int] = []
    for draft, keep, replacement in zip(drafts, accepted, replacements):
        if not keep:
            return [*run, replacement]
        run.append(draft)
    return [*run, replacements[-1]]


@functools.cache
def _key_masks(max_n: int, min_n: int, bits: int) -> tuple[int, ...]:
    """The key masks of the n-grams an `NgramIndex` looks up, longest first (one tuple shared
    by every job's index: at 256 jobs, an object each would be one more cache miss a job)."""
    return tuple((1 << bits * n) - 1 for n in range(max_n, min_n - 1, -1))


class NgramIndex:
    """Prompt-lookup drafts for one job: the continuation of the most recent earlier occurrence
    of the job's last ``n`` tokens, longest ``n`` first (``max_n`` down to ``min_n``).

    The index is built incrementally from the job's history (prompt and accepted tokens,
    `sync`), so proposing costs a few dictionary lookups per job and step whatever the
    context length. A continuation that runs into the end of the history goes on with its
    own proposed tokens (a repeating pattern keeps repeating).

    One dictionary maps every indexed n-gram to the position after its latest occurrence. An
    n-gram's key is an int packing its tokens, ``TOKEN_BITS`` bits each (token + 1, so that a
    shorter n-gram never has a longer one's key), the newest token lowest: the key of the
    ``max_n``-gram ending at a position holds every shorter suffix's key in its low bits, and
    one shift per token rolls it on. Token ids must lie in ``[0, 2 ** TOKEN_BITS - 1)``.

    base: an index of the first tokens of this job's history (`sync`ed with exactly them, and
        never again), shared with other jobs whose histories begin with the same tokens (a
        document many questions are asked about): this index then holds only the n-grams
        ending after them and looks up the base's after its own (whose occurrences are later),
        so its proposals are those of an index of the whole history. A rewind into the base's
        tokens drops the base and indexes the whole history afresh.
    """

    TAIL = 4
    TOKEN_BITS = 21
    # Token ids must lie below this: a key field holds token + 1, in TOKEN_BITS bits.
    TOKEN_LIMIT = (1 << TOKEN_BITS) - 1

    __slots__ = ("max_n", "min_n", "_masks", "_next", "_indexed", "_key", "_tail", "_base")
    max_n: int
    min_n: int

    def __init__(self, max_n: int = 4, min_n: int = 1, base: NgramIndex | None = None) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n; got min_n={min_n}, "
                             f"max_n={max_n}")
        if base is not None and (base.max_n, base.min_n) != (max_n, min_n):
            raise ValueError(f"a base index must look up the same n-gram sizes: its "
                             f"({base.max_n}, {base.min_n}) against ({max_n}, {min_n})")
        self.max_n, self.min_n = max_n, min_n
        self._masks = _key_masks(max_n, min_n, self.TOKEN_BITS)
        self._next: dict[int, int] = {}
        self._base: dict[int, int] | None = None
        self._indexed = 0
        self._key = 0  # the key of the max_n-gram ending at ``_indexed`` (not in the table)
        self._tail: Sequence[int] = []  # the last tokens indexed, to notice a rewind
        if base is not None:
            self._base = base._next
            self._indexed, self._key, self._tail = base._indexed, base._key, base._tail

    @property
    def indexed(self) -> int:
        """How many leading tokens of the history are indexed."""
        return self._indexed

    def sync(self, history: Sequence[int]) -> None:
        """Index the tokens appended since the last call. A history that no longer ends in
        what was indexed (a rewind, perhaps followed by new tokens) is indexed afresh."""
        done, length = self._indexed, len(history)
        if length < done or history[done - len(self._tail):done] != self._tail:
            self._next.clear()
            self._base = None
            self._indexed = done = 0
            self._key = 0
        if length == done:
            return
        table, masks, key, bits = self._next, self._masks, self._key, self.TOKEN_BITS
        full, limit = masks[0], self.TOKEN_LIMIT
        for end in range(done, length):
            # The n-grams ending just before ``end`` (all in ``key``) are followed by
            # history[end]. Near the start, a mask longer than ``end`` tokens gives the key of
            # the ``end`` tokens there, shorter than ``min_n`` for the first few: `propose`
            # never looks such a key up.
            for mask in masks:
                table[key & mask] = end
            token = history[end]
            if not 0 <= token < limit:
                self._indexed, self._key, self._tail, self._base = 0, 0, [], None
                table.clear()
                raise ValueError(f"token id {token} at position {end} is outside the n-gram "
                                 f"index's range [0, {limit})")
            key = ((key << bits) | (token + 1)) & full
        self._indexed, self._key = length, key
        self._tail = history[-self.TAIL:]

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens after ``history`` (which `sync` has indexed); empty when
        no suffix of it occurred before."""
        length = len(history)
        if k <= 0 or length < self.min_n:
            return []
        key = self._key if length == self._indexed else self._key_of(history)
        get = self._next.get
        base = self._base
        for mask in self._masks:
            # A mask longer than the history keeps the whole history's key: the same lookup
            # as the history's own length.
            start = get(key & mask)
            if start is None and base is not None:
                start = base.get(key & mask)
            if start is not None:
                if start + k <= length:
                    return list(history[start:start + k])
                # The continuation reaches the end: it repeats with period length - start.
                period = list(history[start:])
                return (period * (k // len(period) + 1))[:k]
        return []

    def _key_of(self, history: Sequence[int]) -> int:
        """The key of the last ``max_n`` tokens of ``history`` (fewer when it is shorter)."""
        key, bits = 0, self.TOKEN_BITS
        for token in history[-self.max_n:]:
            key = (key << bits) | (token + 1)
        return key


def propose_all(indexes: Mapping[int, NgramIndex], requests: Sequence[Sequence[Any]],
                draft_type: type[tuple[Any, ...]]) -> list[Any]:
    """Drafts for a step: for each request (a tuple whose items 0, 1 and 3 are the job id, its
    history and the draft length), the job's index in ``indexes`` synced with the history and
    its proposal as ``draft_type((tokens, None))``; None for a request whose job has no index
    yet. The compiled module (`engine.ngram_native`) has the same function over its indexes,
    without a Python call per job."""
    out: list[Any] = []
    for request in requests:
        index = indexes.get(request[0])
        if index is None:
            out.append(None)
            continue
        history = request[1]
        index.sync(history)
        out.append(tuple.__new__(draft_type, (index.propose(history, request[3]), None)))
    return out


@dataclass(slots=True)
class DraftStats:
    """One job's acceptance, decayed so that it follows the text (code, prose, a quote).

    Each verify step counts the drafts tried and accepted: positions up to the first rejection
    are trials, the rejected one included. ``alpha`` is the decayed acceptance rate; it starts
    from ``PRIOR_TRIALS`` trials at ``prior``, which decay like the rest.

    An offer the drafter had no draft for (an n-gram lookup that found nothing) is a miss
    (`miss`): after `MAX_MISSES` in a row the job's drafts do not pay, as when they fail, until
    a probe finds one. Without this a job whose text never repeats would ask every step at no
    verify cost, but the engine gives up overlapping a step while any job may draft.
    """

    prior: float = 0.6
    accepted: float = -1.0
    trials: float = -1.0
    last_offer: int = 0
    total_accepted: int = 0
    total_rejected: int = 0
    probe_interval: int = 16
    probing: bool = False  # the last offer was a probe
    misses: int = 0  # offers in a row the drafter had no draft for
    alpha: float = field(default=0.0, init=False)  # accepted / trials, kept up to date

    DECAY = 0.8
    PRIOR_TRIALS = 2.0
    # A job whose drafts do not pay tries a one-token draft once ``probe_interval`` steps have
    # passed since its last draft (at the next multiple of `PROBE_INTERVAL`, `next_probe`):
    # `PROBE_INTERVAL` at first and after a probe that was accepted, twice the last interval
    # (up to `MAX_PROBE_INTERVAL`) after one that was not; and at least as many steps as keep
    # the probe's expected cost within `PROBE_BUDGET` of the tokens made meanwhile (up to
    # `MAX_PROBE_WAIT`, so that a cost measured once too high is measured again).
    PROBE_INTERVAL = 16
    MAX_PROBE_INTERVAL = 256
    PROBE_BUDGET = 0.01
    MAX_PROBE_WAIT = 1024
    MAX_MISSES = 8

    def __post_init__(self) -> None:
        if self.trials < 0:
            self.accepted, self.trials = self.prior * self.PRIOR_TRIALS, self.PRIOR_TRIALS
        self.alpha = self.accepted / self.trials if self.trials > 0 else 0.0

    def next_probe(self, threshold: float) -> int:
        """The engine step at which a job whose drafts do not pay probes next, a probe costing
        ``threshold`` produced tokens (the step's `StepCostModel.threshold`, or more where
        probes were measured to cost more): the first multiple of `PROBE_INTERVAL` at least
        ``probe_interval`` steps after its last offer, and at least the steps over which the
        probe's expected net cost (``threshold - alpha``: its cost less the token it makes
        when accepted) is `PROBE_BUDGET` of the tokens made. Probes of all jobs fall on the
        same steps: the step before a probe gives up overlap (the probe needs its tokens on
        the host), so that is at most one step in `PROBE_INTERVAL` whatever the batch, not one
        for every job's own schedule."""
        cost = math.ceil((threshold - self.alpha) / self.PROBE_BUDGET)
        wait = max(self.probe_interval, min(cost, self.MAX_PROBE_WAIT))
        due = self.last_offer + wait
        return -(-due // self.PROBE_INTERVAL) * self.PROBE_INTERVAL

    def record(self, proposed: int, accepted: int) -> None:
        """Count one verify step that offered ``proposed`` drafts and accepted ``accepted``."""
        self.accepted = self.accepted * self.DECAY + accepted
        self.trials = trials = self.trials * self.DECAY + accepted + (accepted < proposed)
        self.alpha = self.accepted / trials if trials > 0 else 0.0
        self.total_accepted += accepted
        self.total_rejected += proposed - accepted
        self.misses = 0
        if self.probing:
            self._probed(bool(accepted))

    def miss(self) -> None:
        """Count an offer the drafter had no draft for (a probe that finds none failed)."""
        self.misses += 1
        if self.probing:
            self._probed(False)

    def _probed(self, accepted: bool) -> None:
        self.probing = False
        self.probe_interval = (self.PROBE_INTERVAL if accepted
                               else min(2 * self.probe_interval, self.MAX_PROBE_INTERVAL))

    def pays(self, threshold: float) -> bool:
        """Whether a first draft position pays against ``threshold`` (and the drafter has not
        missed `MAX_MISSES` offers in a row)."""
        return self.alpha > threshold and self.misses < self.MAX_MISSES

    def length(self, max_tokens: int, threshold: float, step: int,
               probe_cost: float | None = None) -> int:
        """How many drafts to offer at engine step ``step``: positions ``j`` while
        ``alpha ** j > threshold``, at most ``max_tokens``; when none would pay (or after
        `MAX_MISSES` misses in a row), one probe token once its probe is due (`next_probe` of
        ``probe_cost``, what a probe costs in produced tokens; None: ``threshold``; so none
        when neither `pays` nor `probe_due`)."""
        alpha, k, survive = self.alpha, 0, 1.0
        paying = max_tokens if self.misses < self.MAX_MISSES else 0
        while k < paying:
            survive *= alpha
            if survive <= threshold:
                break
            k += 1
        self.probing = k == 0 and max_tokens > 0 and self.probe_due(
            step, threshold if probe_cost is None else probe_cost)
        if self.probing:
            k = 1
        if k:
            self.last_offer = step
        return k

    def probe_due(self, step: int, threshold: float) -> bool:
        """Whether a job whose drafts do not pay (against ``threshold``) may probe at engine
        step ``step``."""
        return step >= self.next_probe(threshold)


@dataclass
class StepCostModel:
    """The step's cost by tokens fed, fitted on the steps this engine ran: ``seconds = fixed +
    per_token * tokens`` (decayed least squares, so it follows the device's state).

    prior_ratio: ``fixed / per_token`` assumed until steps of different sizes were measured
        (a memory-bound forward: one token costs a small part of a step).
    """

    # The least a draft position must survive to be offered, whatever the fit says: an
    # offered draft also gives up overlapping the next step with this one (the verify step's
    # tokens must reach the host), a cost these steps' times do not show, and at batch 1 a
    # forward's extra tokens cost next to nothing (a fit there may even say they are free).
    MIN_SURVIVAL = 0.1

    prior_ratio: float = 64.0
    decay: float = 0.98
    _n: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0
    _sizes: set[int] = field(default_factory=set)

    def record(self, tokens: int, seconds: float) -> None:
        """Add one measured step of ``tokens`` fed tokens."""
        if tokens <= 0 or not seconds > 0:
            return
        d = self.decay
        self._n = self._n * d + 1
        self._sx = self._sx * d + tokens
        self._sy = self._sy * d + seconds
        self._sxx = self._sxx * d + tokens * tokens
        self._sxy = self._sxy * d + tokens * seconds
        if len(self._sizes) < 2:
            self._sizes.add(tokens)

    def predict(self, tokens: int) -> float | None:
        """The seconds of a step of ``tokens`` fed tokens, or None until steps of two sizes
        were measured."""
        fit = self._fit()
        return None if fit is None else max(0.0, fit[0] + fit[1] * tokens)

    def _fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) of the least-squares line, or None."""
        if len(self._sizes) < 2 or self._n < 4:
            return None
        var = self._sxx - self._sx * self._sx / self._n
        if var <= 1e-12:
            return None
        slope = (self._sxy - self._sx * self._sy / self._n) / var
        return (self._sy - slope * self._sx) / self._n, slope

    def ratio(self) -> float:
        """``fixed / per_token``: how many tokens a step's fixed cost is worth."""
        fit = self._fit()
        if fit is None:
            return self.prior_ratio
        intercept, slope = fit
        if slope <= 0:
            return 1e6  # more tokens cost nothing measurable: drafting is free
        return max(0.0, intercept / slope)

    def threshold(self, batch: int, drafter_ratio: float = 0.0) -> float:
        """The survival probability a draft token must beat in a step of ``batch`` jobs: its
        cost (one more token of the forward, plus ``drafter_ratio`` steps of the drafter per
        draft position, shared by the batch) over what the batch pays per token it makes.
        Above 1 no draft pays (a drafter too slow, or a batch whose forward costs by its
        tokens); its size is then still what a one-token probe costs, in produced tokens.
        Never below `MIN_SURVIVAL`."""
        per_token_of_batch = (self.ratio() + batch) / batch  # a step's cost per job, in tokens
        cost = (1.0 + drafter_ratio * per_token_of_batch) / per_token_of_batch
        return max(self.MIN_SURVIVAL, cost)


__all__ = ["DraftStats", "NgramIndex", "StepCostModel", "accept_run", "accept_sampled",
           "propose_all"]
