"""The batched sampler: logits rows in, one token per row out, all on the logits' device; what
it gives back per request (`SampleResult`), `SamplingError`, and the token tables it keeps for
its stages (`VocabTables`: DRY's sequence breakers, the tokens XTC never removes).

Stage order (fixed; a stage runs only on the rows whose settings use it, and is skipped
entirely when no row does; see `SamplerSettings.active_stages`):

 1. bias: token_bias added; banned_tokens and tokens the constraint mask (``allowed_tokens``)
    forbids set to ``-inf``; logit columns past ``vocab_size`` removed.
 2. penalties: repetition / frequency / presence, with range and decay (`edits`; only
    the history windows are copied from the host).
 3. dry: DRY (match search batched over rows on the device, one scatter).
    Greedy rows (temperature 0 or top_k 1) stop here and take the argmax.
 4. temperature (unless temperature_last), or dynamic temperature.
 5. top_k  6. top_p  7. min_p  8. typical  9. tfs  10. top_a
11. xtc (its per-row coin flip is drawn on the host from the row's seed and counter)
12. temperature_last
13. mirostat v2 (the job's ``mu`` comes from its `SamplerState`, updated after the draw)
14. draw: Gumbel-max with counter-based noise (`rng`): a job's tokens depend only on its seed
    and counter, never on its neighbours in the batch.

Only the sampled ids (and the chosen tokens' probabilities when a row needs them) cross to the
host, in one transfer; top-k lists and raw logits cost one more transfer each, only when asked.

On CUDA with triton, when every row has a top_k and only temperature, top_k and top_p shape
its distribution, stages 4-14 after the top-k run as one fused kernel (`fused`). The rows of a
call, and the per-row columns derived from them, are kept for the next call while the requests
keep their settings (`rows.RowCache`): only the RNG keys are computed and sent each step.

`Sampler.greedy_ids` is the fast path for a batch of plain greedy requests (no stage, mask,
draft or extra output): one max over the logits, a validity check and one small copy, with no
per-row Python.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from dyngen_core.engine.record import SampleRequest
from dyngen_core.errors import DynGenError
from dyngen_core.sampling.draw import (
    DrawGraphs,
    carry_memo,
    choose,
    compact_bound,
    draw_compact,
    fetch_choices,
    fetch_compact,
    fetch_top_k,
    full_rows,
    graphable,
)
from dyngen_core.sampling.edits import apply_edits
from dyngen_core.sampling.fused import (
    DEFAULT_TOPK,
    check_fused_device,
    check_topk_choice,
    draw_fused,
    fusable,
    fused_draw_default,
)
from dyngen_core.sampling.rows import Row, RowCache, RowList
from dyngen_core.sampling.shaping import shape_distribution
from dyngen_core.sampling.upload import Staging

# Stages 1-3: they edit whole logits rows, so x must be a float32 copy.
_EDITS = frozenset({"bias", "penalties", "dry"})


class Sampler:
    """Samples one token per logits row on the logits' device.

    vocab_size: number of real tokens; logits columns past it are never sampled.
    device: where the logits live (the small tensors the sampler builds go there).
    token_pieces: the text of every token id, used for DRY's string sequence breakers and to
        find newline tokens (which XTC never removes). Needed only when a job uses DRY with
        string breakers (the default breakers are strings).
    eos_token_ids: tokens XTC never removes.
    fused_draw: whether the compact draw runs as one Triton kernel where it can (see
        `dyngen_core.sampling.fused`); None (default): on CUDA when triton is installed. True
        needs triton and CUDA (or ``TRITON_INTERPRET=1``, for tests); False keeps the torch
        draw everywhere.
    draw_graphs: replay the fused draw from CUDA graphs (`draw.DrawGraphs`: one launch instead of
        the top-k's, the output's and the kernel's) where the logits are drawn from in place
        (no logit edits). None (default): on CUDA whenever the fused draw runs; True needs
        CUDA and the fused draw; False launches it eagerly. The tokens a graph returns are a
        view of its output: valid until this sampler's next draw.
    fused_topk: the top-k that finds the fused draw's candidates: "torch" (``torch.topk``),
        "triton" (`fused.topk_rows`: a two-stage Triton top-k that reads each row once; the
        same candidates, ties to the lower column; torch.topk past 1024 candidates) or
        "auto" (Triton up to `fused.AUTO_TRITON_MAX_BOUND` candidates, where it measured
        faster, else torch); None (default): `fused.DEFAULT_TOPK` ("auto"). "triton" needs
        the fused draw.
    """

    def __init__(
        self,
        vocab_size: int,
        device: str | torch.device = "cpu",
        *,
        token_pieces: Sequence[str] | None = None,
        eos_token_ids: Sequence[int] = (),
        fused_draw: bool | None = None,
        draw_graphs: bool | None = None,
        fused_topk: str | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        if fused_draw:
            check_fused_device(self.device)
        self.fused_draw = fused_draw_default(self.device) if fused_draw is None else fused_draw
        if draw_graphs and (self.device.type != "cuda" or not self.fused_draw):
            raise ValueError("draw_graphs=True needs a CUDA device and the fused draw "
                             f"(device {self.device}, fused_draw={self.fused_draw})")
        use_graphs = self.fused_draw and self.device.type == "cuda" and draw_graphs is not False
        self.draw_graphs = DrawGraphs(self.device) if use_graphs else None
        self.fused_topk = DEFAULT_TOPK if fused_topk is None else check_topk_choice(fused_topk)
        if fused_topk == "triton" and not self.fused_draw:
            raise ValueError(f"fused_topk={fused_topk!r} needs the fused draw (fused_draw "
                             f"is {self.fused_draw} on {self.device})")
        self._rows = RowCache(carry_memo)
        self._vocab = VocabTables(vocab_size, token_pieces, eos_token_ids)
        self._seeds = random.Random()
        self._staging = Staging(self.device)

    def sample(
        self, logits: torch.Tensor, requests: Sequence[SampleRequest], *, kept: bool = False
    ) -> list[SampleResult]:
        """Sample every request's rows and update mirostat states.

        logits: ``[rows, width]`` with ``width >= vocab_size``, ``requests[i].num_rows`` rows per
            request in request order, on ``device``; any float dtype; not modified.
        kept: the caller never changes a request's settings, seed, draft ids or output
            options once it was passed (it builds a new request instead): the rows of the same
            request objects as in the last call are then reused after an identity check
            (`RowCache.rows`). Counters and ``allowed_tokens`` may change freely either way.
        Raises `SamplingError` (naming the requests) when a row has no allowed token left.
        """
        rows = self._rows.rows(requests, self._seeds, kept=kept)
        return self._report(self._draw(logits, rows, requests), logits, rows, requests)

    def sample_tokens(
        self, logits: torch.Tensor, requests: Sequence[SampleRequest], *, kept: bool = False
    ) -> tuple[list[int], dict[int, SampleResult]]:
        """`sample` for requests of one row each (no drafts), without a result per request:
        every request's token, and the full `SampleResult` of the requests that ask for
        probabilities, top tokens or logits (by request index). Mirostat states are updated
        and errors raised as by `sample`; ``kept`` as there."""
        rows = self._rows.rows(requests, self._seeds, kept=kept)
        if not rows.single:
            raise ValueError("sample_tokens takes one row per request; use sample for drafts")
        drawn = self._draw(logits, rows, requests)
        ids, probs = _fetch(drawn, rows)
        wanted: dict[int, SampleResult] = {}
        full: list[SampleResult | None] = []
        if rows.extra_requests:
            full = [None] * len(requests)
            for i in rows.extra_requests:
                wanted[i] = full[i] = SampleResult([ids[i]])
        for i in rows.prob_rows:
            req = requests[i]
            if req.return_probs:
                wanted[i].token_probs = torch.tensor([probs[i]], dtype=torch.float32)
            if req.settings.mirostat:
                req.state.record_token(req.settings, probs[i])
        if rows.any_top_tokens or rows.any_logits:
            self._attach_extras(drawn.x, logits, rows, requests, range(len(requests)), full)
        return ids, wanted

    def launch_tokens(
        self, logits: torch.Tensor, requests: Sequence[SampleRequest], *, kept: bool = False
    ) -> torch.Tensor | None:
        """The tokens `sample_tokens` would return, left on the device without waiting for
        them: int64 ``[rows]``, -1 for a row with no allowed token (where `sample_tokens` raises
        `SamplingError`). For a caller that reads them later, overlapping the wait with other
        work. None, with nothing drawn, when a request needs more than its token back
        (probabilities, top tokens, logits, a mirostat update) or has drafts: call
        `sample_tokens` then. ``kept`` as for `sample`."""
        rows = self._rows.rows(requests, self._seeds, kept=kept)
        if not rows.single or rows.extra_requests or rows.prob_rows:
            return None
        drawn = self._draw(logits, rows, requests)
        if drawn.x is None and drawn.best is None:
            return drawn.choice  # the fused draw marked the rows without a token already
        if drawn.best is not None:
            chosen = drawn.best.squeeze(1)
        else:
            assert drawn.x is not None
            chosen = drawn.x.gather(1, drawn.choice.unsqueeze(1)).squeeze(1)
        # abs(v) < inf is False for NaN and +-inf, as `_fetch`'s checks are.
        return torch.where(chosen.abs() < float("inf"), drawn.choice, -1)

    def _draw(self, logits: torch.Tensor, rows: RowList,
              requests: Sequence[SampleRequest]) -> _Drawn:
        """Every stage, then the draw."""
        if logits.ndim != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits must be [{len(rows)}, >= {self.vocab_size}] (one row per request row); "
                f"got {tuple(logits.shape)}"
            )
        width, vocab_size = logits.shape[1], self.vocab_size
        wider = width > vocab_size
        edits = rows.any_mask or any(used & _EDITS for used in rows.groups)
        bound = compact_bound(rows, width, vocab_size)
        if bound and not edits:
            # Nothing to edit: the top-k reads the caller's logits (real columns) in place.
            x = logits[:, :vocab_size] if wider else logits
        else:
            # Stages edit x in place; without any, the caller's logits are read directly.
            x = logits.to(torch.float32, copy=edits or wider or any(rows.groups))
            if wider:
                x[:, vocab_size:] = float("-inf")
            apply_edits(x, rows, requests, self._vocab)
        if bound and self.fused_draw and fusable(rows, bound):
            topk = self.fused_topk
            graphed = (self.draw_graphs.draw(x, rows, self._staging, bound, topk)
                       if self.draw_graphs is not None and not edits and graphable(x) else None)
            return _Drawn(None, graphed if graphed is not None
                          else draw_fused(x, rows, self._staging, bound, topk))
        if bound:
            drawn = draw_compact(x, rows, requests, self._vocab, self._staging, bound)
            choice = drawn.token_ids.gather(1, drawn.pick).squeeze(1)
            if rows.prob_rows or rows.any_top_tokens:  # these read whole rows
                return _Drawn(full_rows(drawn.values, drawn.token_ids, width), choice)
            return _Drawn(None, choice, drawn.best)
        keys = None
        if rows.sampled:
            keys = self._staging.send_ints(rows.keys())
        shape_distribution(x, rows, requests, self._vocab)
        bound = min(rows.top_k_bound, vocab_size) if rows.top_k_bound else vocab_size
        return _Drawn(x, choose(x, rows.sampled, keys, bound))

    def distributions(self, logits: torch.Tensor,
                      requests: Sequence[SampleRequest]) -> torch.Tensor:
        """The distribution each row's token is drawn from, after every stage up to the draw:
        float32 ``[rows, vocab_size]`` on the logits' device (greedy rows: all mass on their
        argmax). What a verify step of sampled drafts compares the draft distribution with.
        Rows and errors as for `sample`; a mirostat row is refused, as its distribution moves
        with each token drawn."""
        rows = self._rows.rows(requests, self._seeds)
        if any(r.settings.mirostat for r in requests):
            raise ValueError("distributions() does not serve mirostat rows (their target moves "
                             "with every token); sample them instead")
        if logits.ndim != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits must be [{len(rows)}, >= {self.vocab_size}]; got "
                             f"{tuple(logits.shape)}")
        x = logits[:, : self.vocab_size].to(torch.float32, copy=True)
        apply_edits(x, rows, requests, self._vocab)
        shape_distribution(x, rows, requests, self._vocab)
        dead = ~torch.isfinite(x).any(-1)
        if bool(dead.any()):
            bad = sorted({rows[i].request for i in dead.nonzero().flatten().tolist()})
            raise SamplingError(f"requests {bad} have no allowed token left; fail those jobs",
                                bad)
        probs = torch.softmax(x, -1)
        sampled = set(rows.sampled)
        greedy = [i for i in range(len(rows)) if i not in sampled]
        if greedy:
            index = torch.tensor(greedy, dtype=torch.int64, device=x.device)
            peak = x.index_select(0, index).argmax(-1, keepdim=True)
            probs.index_copy_(0, index, torch.zeros_like(probs[: len(greedy)]).scatter_(
                1, peak, 1.0))
        return probs

    def greedy_ids(self, logits: torch.Tensor) -> list[int]:
        """The argmax token of every row: what `sample` returns for requests whose settings are
        greedy and switch on no stage, with no ``allowed_tokens``, drafts or extra outputs (the
        caller decides that; this method does not see the requests).

        logits: ``[rows, width]`` with ``width >= vocab_size`` (columns past it are never
            chosen), any float dtype, on ``device``; not modified or copied.
        Raises `SamplingError` naming the rows (request ``i`` is row ``i``) whose logits have no
        finite value, as `sample` does.
        """
        chosen = self.greedy_on_device(logits)[1].tolist()
        if -1 in chosen:
            dead = [i for i, token in enumerate(chosen) if token < 0]
            raise SamplingError(
                f"requests {dead} have no allowed token left (token_bias, banned_tokens and the "
                "constraint mask removed every token); fail those jobs", dead)
        return chosen

    def greedy_on_device(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`greedy_ids` left on the device: (each row's argmax, always a valid token id; the
        same with -1 for rows that have no finite value), int64 [rows], nothing waited for.
        What an overlapped step feeds to the next one and copies to the host."""
        if logits.ndim != 2 or logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits must be [rows, >= {self.vocab_size}]; got {tuple(logits.shape)}")
        # A column view, not a copy: the extra columns are simply not read. The max of the
        # logits' own dtype picks what the float32 argmax of `sample` picks (the first maximum;
        # widening is exact), so no full-width conversion is launched.
        x = logits[:, : self.vocab_size] if logits.shape[1] > self.vocab_size else logits
        values, ids = x.max(-1)
        # abs(v) < inf is False for NaN and +-inf, like `sample`'s isfinite check: two kernels
        # instead of isfinite's four.
        return ids, torch.where(values.abs() < float("inf"), ids, -1)

    def _report(
        self,
        drawn: _Drawn,
        logits: torch.Tensor,
        rows: RowList,
        requests: Sequence[SampleRequest],
    ) -> list[SampleResult]:
        ids, probs = _fetch(drawn, rows)
        if rows.single:  # row i is request i
            starts: Sequence[int] = range(len(requests))
            results = [SampleResult([token]) for token in ids]
        else:
            starts = [i for i, r in enumerate(rows) if r.offset == 0]
            results = [SampleResult(ids[start:start + req.num_rows])
                       for req, start in zip(requests, starts, strict=True)]
        if rows.prob_rows:
            for req, start, result in zip(requests, starts, results, strict=True):
                if req.return_probs:
                    result.token_probs = torch.tensor(
                        [probs[start + j] for j in range(req.num_rows)], dtype=torch.float32)
                if req.settings.mirostat:
                    req.state.record_token(req.settings, probs[start])
        if rows.any_top_tokens or rows.any_logits:
            self._attach_extras(drawn.x, logits, rows, requests, starts, results)
        return results

    def _attach_extras(
        self,
        x: torch.Tensor | None,
        logits: torch.Tensor,
        rows: list[Row],
        requests: Sequence[SampleRequest],
        starts: Sequence[int],
        results: Sequence[SampleResult | None],
    ) -> None:
        top = [i for i, r in enumerate(rows) if requests[r.request].return_top_tokens > 0]
        if top:
            assert x is not None  # whole rows are kept when top tokens are asked for
            k = max(requests[rows[i].request].return_top_tokens for i in top)
            tokens, probs = fetch_top_k(x, top, k)
            where = {row: n for n, row in enumerate(top)}
            for req, start, result in zip(requests, starts, results, strict=True):
                if req.return_top_tokens > 0:
                    assert result is not None
                    sel = [where[start + j] for j in range(req.num_rows)]
                    result.top_k_tokens = tokens[sel, : req.return_top_tokens]
                    result.top_k_probs = probs[sel, : req.return_top_tokens]
        raw = [i for i, r in enumerate(rows) if requests[r.request].return_logits]
        if raw:
            index = torch.tensor(raw, dtype=torch.int64, device=logits.device)
            host = logits.index_select(0, index).to(torch.float32).cpu()
            where = {row: n for n, row in enumerate(raw)}
            for req, start, result in zip(requests, starts, results, strict=True):
                if req.return_logits:
                    assert result is not None
                    result.logits = host[[where[start + j] for j in range(req.num_rows)]]


class _Drawn(NamedTuple):
    """What `Sampler._draw` chose: ``choice`` per row, with the final logits ``x`` when whole
    rows are needed (probabilities, top tokens), else the compact draw's ``best`` (each row's
    drawn, perturbed logit), or neither when the fused draw already marked rows without an
    allowed token with -1."""

    x: torch.Tensor | None
    choice: torch.Tensor
    best: torch.Tensor | None = None


def _fetch(drawn: _Drawn, rows: RowList) -> tuple[list[int], dict[int, float]]:
    """The chosen ids and the probabilities of ``rows.prob_rows``, in one transfer; raises
    `SamplingError` naming the requests of rows with no allowed token."""
    probs: dict[int, float] = {}
    if drawn.x is not None:
        ids, valid, probs = fetch_choices(drawn.x, drawn.choice, rows.prob_rows)
    elif drawn.best is not None:
        ids, valid = fetch_compact(drawn.best, drawn.choice)
    else:
        ids = drawn.choice.tolist()
        valid = [token >= 0 for token in ids]
    if not all(valid):
        dead = sorted({rows[i].request for i, ok in enumerate(valid) if not ok})
        raise SamplingError(
            f"requests {dead} have no allowed token left (token_bias, banned_tokens and the "
            "constraint mask removed every token); fail those jobs", dead)
    return ids, probs


class SamplingError(DynGenError, ValueError):
    """A request cannot be sampled (e.g. every token is banned or masked out).

    ``request_indices`` lists the offending requests, so the caller can fail those jobs and
    sample the others again."""

    def __init__(self, message: str, request_indices: Sequence[int]) -> None:
        super().__init__(message)
        self.request_indices = list(request_indices)


@dataclass
class SampleResult:
    """What sampling produced for one request, one entry per row (tensors on the CPU).

    token_ids: the chosen token of each row.
    token_probs: ``[rows]`` float32, each chosen token's probability in the distribution it was
        drawn from (greedy rows: the softmax of their edited logits at temperature 1), when
        ``return_probs``.
    top_k_tokens / top_k_probs: ``[rows, k]`` int64 / float32, the k most likely tokens of that
        same distribution, most likely first, when ``return_top_tokens``.
    logits: ``[rows, vocab]`` float32 raw logits, when ``return_logits``.
    """

    token_ids: list[int]
    token_probs: torch.Tensor | None = None
    top_k_tokens: torch.Tensor | None = None
    top_k_probs: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    @property
    def token_id(self) -> int:
        """The token of row 0 (the only row without drafts)."""
        return self.token_ids[0]


class VocabTables:
    """The token tables a `Sampler`'s stages need that depend on the token texts: DRY's
    sequence breakers and the tokens XTC never removes. Built lazily, once per distinct
    setting (and device), and kept by the sampler.

    vocab_size: number of real tokens.
    token_pieces: the text of every token id, or None (then only integer breakers work).
    eos_token_ids: tokens XTC never removes.
    """

    def __init__(
        self, vocab_size: int, token_pieces: Sequence[str] | None, eos_token_ids: Sequence[int]
    ) -> None:
        self.vocab_size = vocab_size
        self._pieces = list(token_pieces)[:vocab_size] if token_pieces is not None else None
        self._eos = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self._breakers: dict[tuple[str | int, ...], np.ndarray] = {}
        self._breakers_on: dict[tuple[tuple[str | int, ...], torch.device], torch.Tensor] = {}
        self._protected: dict[torch.device, torch.Tensor] = {}

    def breakers(self, breakers: tuple[str | int, ...]) -> np.ndarray:
        """Bool ``[vocab]``: True for tokens that are DRY sequence breakers. A string breaker
        matches every token whose text contains it; an int is a token id."""
        table = self._breakers.get(breakers)
        if table is None:
            table = np.zeros(self.vocab_size, dtype=bool)
            table[[b for b in breakers if isinstance(b, int) and b < self.vocab_size]] = True
            texts = [b for b in breakers if isinstance(b, str)]
            if texts:
                pieces = self._need_pieces("DRY string sequence breakers")
                table |= np.array([any(t in p for t in texts) for p in pieces] +
                                  [False] * (self.vocab_size - len(pieces)), dtype=bool)
            self._breakers[breakers] = table
        return table

    def breaker_tables(
        self, per_row: Sequence[tuple[str | int, ...]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For rows with the given breaker settings: bool ``[distinct settings, vocab]`` tables
        on ``device`` and the int64 ``[rows]`` index of each row's table."""
        distinct = list(dict.fromkeys(per_row))
        tables = []
        for breakers in distinct:
            table = self._breakers_on.get((breakers, device))
            if table is None:
                table = torch.from_numpy(self.breakers(breakers)).to(device)
                self._breakers_on[(breakers, device)] = table
            tables.append(table)
        which = [distinct.index(b) for b in per_row]
        return torch.stack(tables), torch.tensor(which, dtype=torch.int64, device=device)

    def xtc_protected(self, device: torch.device) -> torch.Tensor:
        """Bool ``[vocab]`` on ``device``: newline tokens (when token texts are known) and EOS."""
        table = self._protected.get(device)
        if table is None:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            if self._pieces is not None:
                mask[[t for t, p in enumerate(self._pieces) if "\n" in p]] = True
            mask[self._eos] = True
            table = self._protected[device] = mask.to(device)
        return table

    def _need_pieces(self, what: str) -> list[str]:
        if self._pieces is None:
            raise ValueError(
                f"{what} need the token texts: build the Sampler with token_pieces=..., or give "
                "dry_sequence_breakers as token ids"
            )
        return self._pieces
