"""`StepSampler`: the one entry point of sampling for an engine step.

``start(logits, records)`` samples one token for each job record (logits row ``i`` is
``records[i]``'s) and returns a `SampledStep`, a future of the tokens: ``tokens()`` waits for
them (synchronous sampling is ``start(...).tokens()``). A step is sampled one of three ways:

- every record plain greedy (`JobRecord.plain_greedy`): each row's argmax;
- every record launchable (no constraint, no banned position, no extra outputs): the batched
  sampler draws on the device (`Sampler.launch_tokens`);
- otherwise on the host: each constrained record's mask (llguidance, with the GIL released),
  the tokens banned at its position, then `Sampler.sample_tokens`.

A step whose records carry drafts (``draft_ids``: a verify step of speculative decoding) is
sampled on the host, every row of every record (row ``j`` of a record sees its drafts before
``j``: its mask, its banned tokens and its RNG counter are those of that position), and each
record's run is the drafts that equal the draws plus the first draw that does not
(`engine.speculation.accept_run`): ``SampledStep.runs``.

With ``overlap``, the first two leave the tokens on the device (``SampledStep.ids``, which the
next step's forward may read before they reach the host) while they are copied to a pinned host
buffer. A row that cannot be sampled (no allowed token, or a NaN/inf row) fails its job alone
(``SampledStep.failed``). Records are sampler requests (`JobRecord` is a `SampleRequest`); the
caller advances their RNG counters when it takes the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import is_
from typing import Any

import numpy as np
import torch

from dyngen_core.engine.plan import SampledTokens
from dyngen_core.engine.record import JobRecord
from dyngen_core.engine.speculation import accept_run, accept_sampled
from dyngen_core.sampling.rng import host_uniform, perturb, row_keys, seed_key
from dyngen_core.sampling.sampler import Sampler, SampleResult, SamplingError
from dyngen_core.text.constraints import (
    ConstraintCompiler,
    ConstraintMatcher,
    mask_words,
)
from dyngen_core.text.tokenizer import Tokenizer


class SampledStep:
    """The tokens of one step's sampling rows, as a future.

    records: the sampled jobs; row ``i`` is ``records[i]``'s.
    ids: the tokens left on the device (int64 ``[rows]``; -1 for a row without a token, which a
        feed reads as token 0) when the step may overlap the next forward; None when the step
        was sampled on the host.
    extras: job id -> `SampledTokens` with the probabilities, top tokens or logits of the jobs
        that asked for them.
    failed: job id -> why its row could not be sampled (complete once `tokens` returned).
    runs: for a verify step, each record's tokens (accepted drafts and one more; empty for a
        failed record); None otherwise (one token per record).
    """

    __slots__ = ("records", "ids", "extras", "failed", "runs", "_tokens", "_host", "_ready")

    def __init__(self, records: Sequence[JobRecord], *, tokens: list[int] | None = None,
                 ids: torch.Tensor | None = None, host: torch.Tensor | None = None,
                 ready: torch.cuda.Event | None = None,
                 extras: dict[int, SampledTokens] | None = None,
                 failed: dict[int, Exception] | None = None,
                 runs: list[list[int]] | None = None) -> None:
        self.records = records
        self.runs = runs
        self.ids = ids
        self.extras = extras if extras is not None else {}
        self.failed = failed if failed is not None else {}
        self._tokens = tokens
        self._host = host
        self._ready = ready

    def tokens(self) -> list[int]:
        """Each row's token (waits for the copy from the device); -1 for a row in ``failed``."""
        if self._tokens is None:
            assert self._host is not None
            if self._ready is not None:
                self._ready.synchronize()
            tokens = self._tokens = self._host[: len(self.records)].tolist()
            if -1 in tokens:
                for row, token in enumerate(tokens):
                    if token < 0:
                        self.failed[self.records[row].job_id] = SamplingError(
                            f"job {self.records[row].job_id}: its logits row left no token to "
                            "choose (NaN or inf from the model, or token_bias removed every "
                            "token); the job fails", [row])
        return self._tokens


class StepSampler:
    """Samples the jobs of engine steps (see the module docstring).

    vocab_size: real tokens; logits columns past it are never sampled.
    device: where the logits live.
    tokenizer: the model's tokenizer (token texts for DRY and XTC; constraints compile
        against its vocabulary).
    eos_token_ids: the ids that end generation (XTC keeps them). Constraints allow the
        tokenizer's own end-of-sequence ids at the end.
    """

    def __init__(self, vocab_size: int, device: torch.device, tokenizer: Tokenizer,
                 eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.sampler = Sampler(vocab_size, device, token_pieces=_token_pieces(tokenizer,
                                                                               vocab_size),
                               eos_token_ids=sorted(set(eos_token_ids)))
        self._compiler: ConstraintCompiler | None = None
        self._copies = _HostCopies(device)
        # The last record lists found all plain greedy, without a constraint, and launched:
        # steady decoding passes the same list again, which is then known at once (a list
        # passed here must not be changed afterwards).
        self._plain_list: Sequence[JobRecord] | None = None
        self._unconstrained_list: Sequence[JobRecord] | None = None
        self._launched: Sequence[JobRecord] | None = None

    def matcher(self, constraint: Any) -> ConstraintMatcher:
        """A fresh constraint matcher for one job (raises `JobError` for a bad constraint)."""
        if self._compiler is None:  # indexes the whole vocabulary once, on first use
            self._compiler = ConstraintCompiler.from_tokenizer(self.tokenizer, self.vocab_size)
        return self._compiler.matcher(constraint)

    def start(self, logits: torch.Tensor | None, records: Sequence[JobRecord], *,
              overlap: bool = False, verify: bool = False) -> SampledStep:
        """Sample one token per record (logits row ``i`` is ``records[i]``'s). ``overlap``:
        leave the tokens on the device when the step allows it (``SampledStep.ids``).
        ``verify``: some records carry drafts, with ``1 + len(draft_ids)`` rows each, in
        order; their runs come back in ``SampledStep.runs``."""
        if not records:
            return SampledStep(records, tokens=[])
        if verify:
            return self._verify(logits, records)
        if logits is None or logits.shape[0] != len(records):
            rows = None if logits is None else logits.shape[0]
            raise RuntimeError(f"{rows} logits rows for {len(records)} sampling jobs")
        if self._all_plain(records):
            if overlap:
                fed, ids = self.sampler.greedy_on_device(logits)
                return self._copies.launch(records, ids, fed)
            try:
                return SampledStep(records, tokens=self.sampler.greedy_ids(logits))
            except SamplingError:
                return self._sample(logits, records)  # names the failed rows
        if overlap:
            try:
                drawn = self._launch(logits, records)
            except SamplingError:
                drawn = None  # `_sample` reports the jobs it cannot sample
            if drawn is not None:
                return self._copies.launch(records, drawn)
        return self._sample(logits, records)

    def _all_plain(self, records: Sequence[JobRecord]) -> bool:
        if records is self._plain_list:
            return True
        for r in records:
            if not r.plain_greedy:
                return False
        self._plain_list = records
        return True

    def _launch(self, logits: torch.Tensor, records: Sequence[JobRecord]) -> torch.Tensor | None:
        """The records' tokens drawn on the device and not waited for, or None with nothing
        drawn when a record cannot take part (see `Sampler.launch_tokens`)."""
        launched = self._launched
        if launched is not records and (launched is None or len(launched) != len(records)
                                        or not all(map(is_, records, launched))):
            for r in records:
                if not r.launchable:
                    self._launched = None
                    return None
                r.allowed_tokens = None  # a host step with masks may have set one
            self._launched = records
        # Else the same records as the last launch and no host step since: their requests are
        # as that launch left them. Records keep their settings, seed and outputs: rows are
        # reused (``kept``).
        return self.sampler.launch_tokens(logits, records, kept=True)

    def _sample(self, logits: torch.Tensor, records: Sequence[JobRecord]) -> SampledStep:
        """Sample on the host: masks first. A row that cannot be sampled, or whose mask or draw
        raises, fails its job alone."""
        self._launched = None  # allowed tokens change here
        failed: dict[int, Exception] = {}
        extras: dict[int, SampledTokens] = {}
        rows = self._set_allowed(records, failed)
        tokens = self._sample_rows(logits, records, rows, extras, failed)
        return SampledStep(records, tokens=tokens, extras=extras, failed=failed)

    def _verify(self, logits: torch.Tensor | None, records: Sequence[JobRecord]) -> SampledStep:
        """Sample every row of a verify step on the host and cut each record's run. A record
        whose mask or draw fails, fails alone."""
        counts = [r.num_rows for r in records]
        if logits is None or logits.shape[0] != sum(counts):
            rows = None if logits is None else logits.shape[0]
            raise RuntimeError(f"{rows} logits rows for a verify step of {sum(counts)} rows")
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        if self._all_plain(records):  # every row's token is its argmax: no row list, no stage
            try:
                chosen = self.sampler.greedy_ids(logits)
            except SamplingError:
                pass  # the general path names the records that cannot be sampled
            else:
                cut = [accept_run(r.draft_ids, chosen[starts[i]:starts[i + 1]]) if r.draft_ids
                       else chosen[starts[i]:starts[i] + 1] for i, r in enumerate(records)]
                return SampledStep(records, tokens=[run[0] for run in cut], runs=cut)
        self._launched = None  # allowed tokens change here
        failed: dict[int, Exception] = {}
        live = []
        for i, r in enumerate(records):
            try:
                r.allowed_tokens = self._row_masks(r)
            except Exception as exc:  # noqa: BLE001 - one job's fault fails that job alone
                failed[r.job_id] = exc
                continue
            live.append(i)
        runs: list[list[int]] = [[] for _ in records]
        sampled_drafts = [i for i in live if records[i].draft_probs is not None]
        if sampled_drafts:
            live = [i for i in live if records[i].draft_probs is None]
            for i, run in self._verify_sampled(logits, records, sampled_drafts, starts,
                                               failed).items():
                runs[i] = run
        results = self._sample_blocks(logits, records, live, starts, failed)
        for i, result in results.items():
            r = records[i]
            runs[i] = accept_run(r.draft_ids, result.token_ids) if r.draft_ids \
                else result.token_ids[:1]
        extras = self._extras(records, list(range(len(records))),
                              {i: res for i, res in results.items() if records[i].wants_extras})
        return SampledStep(records, tokens=[run[0] if run else -1 for run in runs],
                           extras=extras, failed=failed, runs=runs)

    def _verify_sampled(self, logits: torch.Tensor, records: Sequence[JobRecord],
                        picked: list[int], starts: list[int], failed: dict[int, Exception]
                        ) -> dict[int, list[int]]:
        """Runs of the records whose drafts were sampled from ``draft_probs`` (``q``): the
        target's distributions ``p`` of their rows, then per draft row a uniform against
        ``p(d) / q(d)`` and a replacement drawn from ``max(0, p - q)`` (from ``p`` on each
        record's last row), all keyed by the job's seed and the row's counter as plain draws
        are (`engine.speculation.accept_sampled`). A record whose rows fail, fails alone."""
        try:
            index = torch.tensor([row for i in picked for row in range(starts[i], starts[i + 1])],
                                 dtype=torch.int64, device=logits.device)
            p = self.sampler.distributions(logits.index_select(0, index),
                                           [records[i] for i in picked])
        except Exception as exc:  # noqa: BLE001 - narrowed down to the failing records
            if len(picked) == 1:
                failed[records[picked[0]].job_id] = exc
                return {}
            out: dict[int, list[int]] = {}
            for i in picked:
                out.update(self._verify_sampled(logits, records, [i], starts, failed))
            return out
        q = torch.cat([torch.cat([records[i].draft_probs.to(p.device, torch.float32),
                                  p.new_zeros(1, p.shape[1])]) for i in picked])
        drafts = [d for i in picked for d in (*records[i].draft_ids, 0)]
        seeds = [records[i].seed or 0 for i in picked for _ in range(records[i].num_rows)]
        counters = [records[i].counter + j for i in picked for j in range(records[i].num_rows)]
        tokens = torch.tensor(drafts, dtype=torch.int64, device=p.device).unsqueeze(1)
        chances = torch.stack([p.gather(1, tokens).squeeze(1), q.gather(1, tokens).squeeze(1)])
        residual = (p - q).clamp_(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
        keys = torch.from_numpy(row_keys([seed_key(s) for s in seeds], counters)).to(p.device)
        columns = torch.arange(p.shape[1], device=p.device)
        replacements = perturb(residual.log(), keys, columns).argmax(-1).tolist()
        p_draft, q_draft = chances.tolist()
        out, row = {}, 0
        for i in picked:
            r, k = records[i], len(records[i].draft_ids)
            accepted = [host_uniform(seeds[row + j], counters[row + j], _ACCEPT_STREAM)
                        * q_draft[row + j] <= p_draft[row + j] for j in range(k)]
            out[i] = accept_sampled(r.draft_ids, accepted, replacements[row:row + k + 1])
            row += k + 1
        return out

    def _sample_blocks(self, logits: torch.Tensor, records: Sequence[JobRecord],
                       live: list[int], starts: list[int], failed: dict[int, Exception]
                       ) -> dict[int, SampleResult]:
        """`Sampler.sample` over the row blocks of the ``live`` records (record ``i`` owns
        rows ``starts[i] ... starts[i + 1] - 1``); failures narrowed down as `_sample_rows`
        does. Returns each sampled record's result by record index."""
        while live:
            whole = len(live) == len(records)
            index = None if whole else torch.tensor(
                [row for i in live for row in range(starts[i], starts[i + 1])],
                dtype=torch.int64, device=logits.device)
            try:
                results = self.sampler.sample(
                    logits if index is None else logits.index_select(0, index),
                    [records[i] for i in live])
            except SamplingError as exc:
                bad = {live[j] for j in exc.request_indices}
                failed.update({records[i].job_id: exc for i in bad})
                live = [i for i in live if i not in bad]
                continue
            except Exception as exc:  # noqa: BLE001 - one job's fault fails that job alone
                if len(live) == 1:
                    failed[records[live[0]].job_id] = exc
                    return {}
                out: dict[int, SampleResult] = {}
                for i in live:
                    out.update(self._sample_blocks(logits, records, [i], starts, failed))
                return out
            return dict(zip(live, results, strict=True))
        return {}

    def _row_masks(self, r: JobRecord) -> np.ndarray | None:
        """A record's allowed tokens for each of its rows: row ``j`` with the constraint
        advanced by the drafts before it and the bans of its position; None when nothing is
        masked. A draft the constraint forbids cannot be accepted, and a draft that completes
        it ends the job, so the rows after either keep the last mask
        (`ConstraintMatcher.masks_along`)."""
        if r.matcher is None and not r.may_ban:
            return None
        drafts, matcher = r.draft_ids, r.matcher
        if not drafts:
            return self._allowed(r, None if matcher is None else matcher.bitmask())
        constraint = [None] * (len(drafts) + 1) if matcher is None \
            else matcher.masks_along(drafts)
        masks = []
        for j, mask in enumerate(constraint):
            allowed = self._allowed(r, mask, ahead=j)
            masks.append(allowed if allowed is not None else self._full_mask())
        while len(masks) < len(drafts) + 1:
            masks.append(masks[-1])
        return np.stack(masks)

    def _full_mask(self) -> np.ndarray:
        return np.full(mask_words(self.vocab_size), -1, dtype=np.int32)

    def _sample_rows(self, logits: torch.Tensor, records: Sequence[JobRecord], rows: list[int],
                     extras: dict[int, SampledTokens], failed: dict[int, Exception]
                     ) -> list[int]:
        """Each record's token, sampling ``rows`` (-1 for the other rows and failed ones):
        rows without an allowed token fail alone (`SamplingError` names them); any other error
        is narrowed down by sampling each row alone, so only the rows that raise fail."""
        while rows:
            whole = len(rows) == len(records)
            try:
                ids, full = self.sampler.sample_tokens(
                    logits if whole else logits[rows],
                    records if whole else [records[i] for i in rows], kept=True)
            except SamplingError as exc:
                bad = {rows[i] for i in exc.request_indices}
                failed.update({records[i].job_id: exc for i in bad})
                rows = [i for i in rows if i not in bad]
                continue
            except Exception as exc:  # noqa: BLE001 - one job's fault fails that job alone
                if len(rows) == 1:
                    failed[records[rows[0]].job_id] = exc
                    break
                tokens = [-1] * len(records)
                for i in rows:
                    tokens[i] = self._sample_rows(logits, records, [i], extras, failed)[i]
                return tokens
            extras.update(self._extras(records, rows, full))
            if whole:
                return ids
            tokens = [-1] * len(records)
            for i, token in zip(rows, ids):
                tokens[i] = token
            return tokens
        return [-1] * len(records)

    @staticmethod
    def _extras(records: Sequence[JobRecord], rows: list[int],
                full: dict[int, Any]) -> dict[int, SampledTokens]:
        """The extra outputs of the sampled rows (``full``: by index into ``rows``)."""
        extras = {}
        for k, r in full.items():
            job_id = records[rows[k]].job_id
            extras[job_id] = SampledTokens(
                job_id=job_id, token_ids=r.token_ids, probs=r.token_probs,
                top_k_tokens=r.top_k_tokens, top_k_probs=r.top_k_probs, logits=r.logits)
        return extras

    def _set_allowed(self, records: Sequence[JobRecord],
                     failed: dict[int, Exception]) -> list[int]:
        """Set each record's allowed tokens for this step: its constraint's mask, minus the
        tokens banned at its position (banned-string rewinds, stop tokens before
        min_new_tokens). Returns the rows whose mask could be built; the others fail."""
        bitmask = self._masks(records)
        rows = []
        for i, r in enumerate(records):
            if r.matcher is None and not r.may_ban:
                r.allowed_tokens = None
                rows.append(i)
                continue
            try:
                mask = None if r.matcher is None else (
                    bitmask[i] if bitmask is not None else r.matcher.bitmask())
                r.allowed_tokens = self._allowed(r, mask)
            except Exception as exc:  # noqa: BLE001 - one job's fault fails that job alone
                failed[r.job_id] = exc
                continue
            rows.append(i)
        return rows

    def _masks(self, records: Sequence[JobRecord]) -> np.ndarray | None:
        """The constrained records' packed masks (row ``i`` is record ``i``'s; rows of records
        without a constraint are left zero and never read); None when the batch fill failed
        (each record's mask is then built alone)."""
        if records is self._unconstrained_list:
            return _NO_MASKS
        matchers = [r.matcher for r in records]
        if matchers.count(None) == len(matchers):
            self._unconstrained_list = records
            return _NO_MASKS
        assert self._compiler is not None  # a record has a matcher: it was compiled here
        bitmask = self._compiler.new_bitmask(len(records))
        try:
            self._compiler.fill_bitmasks(matchers, bitmask)
        except Exception:  # noqa: BLE001 - `_set_allowed` narrows it down to the jobs
            return None
        return bitmask

    def _allowed(self, r: JobRecord, constraint_mask: np.ndarray | None, ahead: int = 0
                 ) -> np.ndarray | None:
        """The constraint's mask minus the tokens banned ``ahead`` positions after the job's
        next one; None when nothing is masked."""
        banned = r.banned_now(ahead)
        if constraint_mask is None and not banned:
            return None
        if constraint_mask is None:
            # Bits past vocab_size may stay set: the sampler never samples those columns.
            mask = self._full_mask()
        else:
            mask = constraint_mask.copy()
        words = mask.view(np.uint32)
        for t in banned:
            words[t >> 5] &= ~np.uint32(1 << (t & 31))
        return mask


_NO_MASKS = np.zeros((0, 0), dtype=np.int32)
# `rng.host_uniform`'s stream of the accept decisions of sampled drafts: never a token id (a
# token's Gumbel noise hashes the same way) and not XTC's.
_ACCEPT_STREAM = 0xFFFFFFFE


class _HostCopies:
    """Starts the copy of a step's device tokens to the host without waiting. On CUDA the copy
    goes to one of two pinned buffers in turn (the previous step's may still be read), grown as
    needed; elsewhere the device tensor is the host tensor."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] = []
        self._turn = 0

    def launch(self, records: Sequence[JobRecord], ids: torch.Tensor,
               fed: torch.Tensor | None = None) -> SampledStep:
        """A `SampledStep` of ``ids`` (-1 for a row without a token); ``fed``: what the next
        step reads instead, default ``ids``."""
        if fed is None:
            fed = ids
        if self.device.type != "cuda":
            return SampledStep(records, ids=fed, host=ids)
        if len(self._buffers) < 2 or self._buffers[0].shape[0] < ids.shape[0]:
            size = max(ids.shape[0], 256)
            self._buffers = [torch.empty(size, dtype=torch.int64).pin_memory() for _ in range(2)]
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn ^= 1
        host, ready = self._buffers[self._turn], self._events[self._turn]
        host[: ids.shape[0]].copy_(ids, non_blocking=True)
        ready.record()
        return SampledStep(records, ids=fed, host=host, ready=ready)


def _token_pieces(tokenizer: Tokenizer, vocab_size: int) -> list[str]:
    """Each token's text, for DRY's string sequence breakers and XTC's protected tokens."""
    return [tokenizer.decode([i], decode_special_tokens=True) for i in range(vocab_size)]
