"""`ResultEmitter`: a step's results. It streams each sampled job's tokens through the job's
text pipeline (a verify step's run token by token), turns what comes out into "started",
"prefill" and "streaming" results, ends jobs (a stop, a fault, a cancel: their pages freed at
once) and keeps their final results until the generator hands them out. A fault of one job's
text pipeline ends that job alone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from dyngen_core.engine.plan import SampledTokens, StepPlan
from dyngen_core.engine.record import JobRecord
from dyngen_core.engine.results import EosReason, Result, streaming_result
from dyngen_core.engine.scheduler import Scheduler
from dyngen_core.runtime.speculator import Speculator
from dyngen_core.sampling.step import SampledStep
from dyngen_core.text.stream import StreamUpdate


class ResultEmitter:
    """Results for the generator's jobs.

    records: the generator's running jobs by id (the emitter removes the ones it ends).
    scheduler: the generator's scheduler (a rewind takes tokens back there; an ended job's
        pages are freed there).
    speculator: the generator's speculator, or None (a verify step's runs settle there).
    page_size: the cache's page size (final results count cached pages).
    """

    def __init__(self, records: dict[int, JobRecord], scheduler: Scheduler,
                 speculator: Speculator | None, page_size: int) -> None:
        self._records = records
        self._scheduler = scheduler
        self._speculator = speculator
        self._page_size = page_size
        self.finished: list[Result] = []  # final results not yet handed out

    def emit_step(self, plan: StepPlan, sampled: SampledStep, tokens: list[int],
                  out: list[Result]) -> None:
        """Append every job's results of this step to ``out``."""
        records, extras, now = self._records, sampled.extras, time.perf_counter()
        runs = sampled.runs
        if runs is None and len(tokens) == len(plan.slices):  # every slice sampled: no prefill
            self._emit_rows(sampled.records, tokens, extras, out, now)
            return
        if runs is not None:  # a verify step: each sampled job's run, then the prefills
            for verified, run in zip(sampled.records, runs, strict=True):
                self._emit_run(verified, run, extras, out, now)
        next_token = iter(tokens).__next__
        for s in plan.slices:
            record = records.get(s.job_id)
            if not s.sample:
                if record is not None:
                    self._emit_start(record, out, now, prefill=True)
            elif runs is None:
                self._emit_rows([record], [next_token()], extras, out, now)

    def _emit_rows(self, rows: Sequence[JobRecord | None], tokens: Sequence[int],
                   extras: dict[int, SampledTokens], out: list[Result], now: float) -> None:
        """Append the results of one sampled token per job (``tokens[i]`` is ``rows[i]``'s; a
        None row, or a job that ended since, is skipped) to ``out``; a job's first token comes
        after its "started" result. Each job's draw is counted here: the one place its RNG
        counter advances. A fault of one job's text pipeline ends that job alone."""
        append, new_result = out.append, streaming_result
        for record, token in zip(rows, tokens, strict=True):
            if record is None or record.ended:
                continue  # ended (failed sampling, cancelled)
            record.counter += 1
            try:
                if record.time_first_token is None:
                    self._emit_start(record, out, now, prefill=False)
                    record.time_first_token = now
                update = record.stream.advance(token)
                if update.__class__ is not str or not record.plain_stream:
                    self._stream_update(record, token, extras.get(record.job_id), update, out)
                    continue
                # The common case, no end, rewind, constraint or extras: `_stream_update`
                # inlined.
                if record.needs_history:
                    record.history.append(token)
                append(new_result(record.job, update, token))
            except Exception as exc:  # noqa: BLE001 - one job's fault ends that job alone
                if not record.ended:
                    self.end_job(record.job_id, EosReason.ERROR, error=exc)

    def _emit_run(self, record: JobRecord, run: Sequence[int],
                  extras: dict[int, SampledTokens], out: list[Result], now: float) -> None:
        """Append the results of a verify step's run of tokens for one job, token by token
        (each advances its RNG counter, as a plain step's would): a stop ends the run there,
        and a banned-string rewind takes back the rest of the run with what it rewinds. Then
        the drafter learns what was accepted."""
        if record.ended or not run:
            return
        try:
            if record.time_first_token is None:
                self._emit_start(record, out, now, prefill=False)
                record.time_first_token = now
            plain = record.plain_stream
            for i, token in enumerate(run):
                record.counter += 1
                update = record.stream.advance(token)
                if plain and update.__class__ is str:  # `_stream_update`'s common case inlined
                    if record.needs_history:
                        record.history.append(token)
                    out.append(streaming_result(record.job, update, token))
                    continue
                self._stream_update(record, token, extras.get(record.job_id), update, out,
                                    unread=len(run) - 1 - i)
                if record.ended or (not isinstance(update, str) and update.rewind):
                    break
        except Exception as exc:  # noqa: BLE001 - one job's fault ends that job alone
            if not record.ended:
                self.end_job(record.job_id, EosReason.ERROR, error=exc)
        if not record.ended and self._speculator is not None:
            self._speculator.settle(record, len(run))

    def _emit_start(self, record: JobRecord, out: list[Result], now: float, *,
                    prefill: bool) -> None:
        """A job's "started" result the first time it is seen, then with ``prefill`` its
        "prefill" progress (a step that computed part of its prompt and sampled nothing)."""
        if record.time_started is None:
            record.time_started = now
            out.append(record.result("started"))
        if prefill:
            seq = self._scheduler.sequence(record.job_id)
            assert seq is not None
            out.append(record.result("prefill", prefill_progress=seq.num_computed,
                                     prefill_total=seq.num_tokens))

    def _stream_update(self, record: JobRecord, token_id: int, tokens: SampledTokens | None,
                       update: str | StreamUpdate, out: list[Result], unread: int = 0) -> None:
        """Apply one token's stream update and append its result, if any, to ``out``;
        ``unread``: tokens of the same run after this one (in the scheduler already, not yet in
        the stream), taken back with a rewind. A job that holds its tokens (banned strings)
        streams those the stream settled, each with its extra outputs."""
        if isinstance(update, str):
            update = StreamUpdate(update, token_ids=[token_id])
        if update.rewind:
            self._scheduler.rewind(record.job_id, update.rewind + unread)
            record.on_rewind(update.rewind, update.banned_token_id)
            if record.holds_tokens:  # the taken-back tokens were never streamed
                del record.held_tokens[len(record.job.new_token_ids) - record.tokens_out:]
            return
        error = record.on_token(token_id)
        eos = EosReason.ERROR if error else record.end_reason(update.eos_reason)
        if eos is None:
            if record.holds_tokens:
                record.held_tokens.append((token_id, tokens))
                self._stream_settled(record, update.text, out)
            else:
                out.append(record.streaming_result(update.text, token_id, tokens))
            return
        chunk = dict(text=update.text, token_ids=update.token_ids)
        if record.wants_extras:
            assert tokens is not None
            chunk.update(record.extras(tokens))
        # The final result carries this token; any held before it are streamed first.
        self.end_job(record.job_id, eos, chunk=chunk, error=error)

    def _stream_settled(self, record: JobRecord, text: str, out: list[Result]) -> None:
        """Stream the held tokens the job's stream has settled since the last call, one result
        each, ``text`` (what the stream released now) with the last of them; text released
        with no token settled goes alone."""
        settled = record.stream.released_tokens - record.tokens_out
        if settled <= 0:
            if text:
                out.append(record.result("streaming", text=text, token_ids=[]))
            return
        self._stream_held(record, settled, text, out)

    @staticmethod
    def _stream_held(record: JobRecord, count: int, text: str, out: list[Result]) -> None:
        """Append a result for each of the first ``count`` held tokens of ``record`` (``text``
        with the last) to ``out``; they are streamed from then on."""
        held = record.held_tokens
        for i in range(count):
            token_id, tokens = held[i]
            out.append(record.streaming_result(text if i == count - 1 else "", token_id, tokens))
        del held[:count]
        record.tokens_out += count

    def end_job(self, job_id: int, reason: EosReason, *, chunk: dict[str, Any] | None = None,
                 error: BaseException | None = None) -> None:
        """Free the job's pages now and queue its final result (carrying the last chunk),
        after a result for each token the job still held (the job's end settles them)."""
        record = self._records.pop(job_id)
        record.ended = True
        self._stream_held(record, len(record.held_tokens), "", self.finished)
        seq = self._scheduler.sequence(job_id)
        cached_tokens = seq.num_cached_tokens if seq is not None else 0
        self._scheduler.finish(job_id)
        record.job.finished = True
        accepted = rejected = 0
        if self._speculator is not None:
            accepted, rejected = self._speculator.job_totals(job_id)
            self._speculator.forget(job_id)
        self.finished.append(
            record.final_result(reason, chunk=chunk or {"text": ""}, error=error,
                                cached_tokens=cached_tokens, page_size=self._page_size,
                                accepted=accepted, rejected=rejected))

    def take_finished(self) -> list[Result]:
        """The final results queued since the last call (and none after it)."""
        finished, self.finished = self.finished, []
        return finished


__all__ = ["ResultEmitter"]
