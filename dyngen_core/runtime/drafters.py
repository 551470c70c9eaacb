"""Where drafts come from: the `Drafter` protocol, the requests and answers that cross it, and
its two drafters.

- `NgramDrafter`: prompt lookup over the job's own history (prompt and output); no model. Its
  index is `engine.speculation.NgramIndex`, compiled (`engine.ngram_native`) wherever it can
  be built.
- `ModelDrafter`: a smaller model of the same vocabulary. It drafts greedily for greedy and
  seeded jobs (whose output is then plain decoding's), and samples for unseeded sampled jobs
  from its own distribution ``q`` (the job's temperature and top-k), which the verify step's
  accept rule weighs against the target's (the same distribution, more drafts kept). Its
  cache has the target cache's page ids (the same page size and count): a page holds the same
  positions in both, so prefix dedup, prompt-cache hits, preemption and defragmentation stay
  valid for both. It follows every plan's page copies and prefill chunks (`follow`), and
  catches up on the tokens a job accepted since it last drafted in its first draft forward.

A constrained job's drafts follow its constraint: the draft model drafts under its mask (the
`Speculator` then cuts any draft before the first token the constraint forbids).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from dyngen_core.engine.ngram_native import compiled_ngram
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.engine.speculation import NgramIndex, propose_all
from dyngen_core.kv.attention import AttentionBackend, get_backend
from dyngen_core.kv.cache import Cache
from dyngen_core.model import Model
from dyngen_core.runtime.runner import ModelRunner
from dyngen_core.sampling.rng import perturb, row_keys, seed_key
from dyngen_core.text.constraints import bitmask_to_bool

# Drafts of a seeded job are drawn with the job's seed mixed with this, so that they are
# independent of the target's draws at the same counters.
_DRAFT_SEED_SALT = 0x9E3779B97F4A7C15


class DraftSampling(NamedTuple):
    """How a sampled job's drafts are drawn: its temperature and top-k (0: off), and the seed
    and counter of its next token."""

    temperature: float
    top_k: int
    seed: int
    counter: int


class Draft(NamedTuple):
    """A drafter's answer for one job: the tokens, and for sampled drafts the distribution
    each was drawn from (``[len(tokens), vocab]`` probabilities; None for deterministic
    drafts)."""

    tokens: list[int]
    probs: Any = None


class DraftRequest(NamedTuple):
    """One job's draft: ``length`` tokens after ``history`` (prompt and accepted tokens; its
    last token sits at position ``len(history) - 1`` and is fed by this step), written, for a
    draft model, through ``page_table``; ``sampling`` for a job whose drafts may be sampled
    (None: draft deterministically); ``matcher``: the job's constraint matcher (drafts under
    its mask; left as it was found), or None."""

    job_id: int
    history: Sequence[int]
    page_table: Sequence[int]
    length: int
    sampling: DraftSampling | None = None
    matcher: Any = None


class Drafter(Protocol):
    """Where drafts come from (see the module docstring)."""

    @property
    def cost_ratio(self) -> float:
        """One draft position's cost as a fraction of a target step (0 for lookups)."""
        ...

    def follow(self, plan: StepPlan) -> None:
        """See the target's plan before it runs (a draft cache copies pages and prefills)."""

    @property
    def samples(self) -> bool:
        """Whether it can sample drafts (and so wants `DraftRequest.sampling`)."""
        ...

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """Up to ``request.length`` tokens per request (fewer, or none, when it has none)."""
        ...

    def settle(self, job_id: int, valid: int) -> None:
        """The job's first ``valid`` positions are verified; anything drafted past them is not."""

    def forget(self, job_id: int) -> None:
        """The job ended."""


class SharedPrefix:
    """A run of full pages that jobs' histories begin with (their ids and tokens), and once a
    job extends it, the n-gram index of their tokens (`NgramDrafter`)."""

    __slots__ = ("pages", "tokens", "index", "users")

    def __init__(self, pages: tuple[int, ...], tokens: list[int]) -> None:
        self.pages, self.tokens = pages, tokens
        self.index: Any = None  # an NgramIndex (Python or compiled)
        self.users = 0


class NgramDrafter:
    """Prompt-lookup drafts (`engine.speculation.NgramIndex`), one index per job: the compiled
    index (`engine.ngram_native`, the same drafts at a fraction of the host time) wherever it
    can be built, else the Python one.

    Jobs whose histories begin with the same full pages (one document asked several questions:
    deduplicated, its pages have the same ids in every job's page table) share one index of
    those pages' tokens, the base of each later job's own index, whatever pages follow them (a
    question longer than the document's last partial page): a document is indexed twice (by
    the first job, and as the shared base when a second job comes), not once a job. A job's
    pages are matched by id and then by content (a page id freed and reused holds other
    tokens), so sharing never changes a draft; a job that shares no page keeps a plain index.

    max_n / min_n: the longest and shortest suffix looked up.
    page_size: the cache's page size.
    """

    cost_ratio = 0.0
    samples = False

    def __init__(self, max_n: int = 4, min_n: int = 1, page_size: int = 256) -> None:
        NgramIndex(max_n, min_n)  # checks the sizes
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, not {page_size}")
        self.max_n, self.min_n, self.page_size = max_n, min_n, page_size
        compiled = compiled_ngram(max_n)
        self.index_type: Any = NgramIndex if compiled is None else compiled.NgramIndex
        self._propose_all = propose_all if compiled is None else compiled.propose_all
        self._indexes: dict[int, Any] = {}  # job -> its NgramIndex (Python or compiled)
        self._prefixes: dict[int, list[SharedPrefix]] = {}  # by their first page id
        self._prefix_of: dict[int, SharedPrefix] = {}  # job -> the prefix its index extends

    def follow(self, plan: StepPlan) -> None:
        return None

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = self._propose_all(self._indexes, requests, Draft)
        if None in drafts:  # jobs drafting for the first time: their indexes first
            new = [i for i, draft in enumerate(drafts) if draft is None]
            for i in new:
                self._indexes[requests[i].job_id] = self._new_index(requests[i])
            later = self._propose_all(self._indexes, [requests[i] for i in new], Draft)
            for i, draft in zip(new, later, strict=True):
                drafts[i] = draft
        return drafts

    def settle(self, job_id: int, valid: int) -> None:
        return None

    def forget(self, job_id: int) -> None:
        self._indexes.pop(job_id, None)
        prefix = self._prefix_of.pop(job_id, None)
        if prefix is not None:
            prefix.users -= 1
            if not prefix.users:
                shared = self._prefixes[prefix.pages[0]]
                shared.remove(prefix)
                if not shared:
                    del self._prefixes[prefix.pages[0]]

    def shared_prefixes(self) -> tuple[int, int]:
        """How many prefixes are known, and how many of them have a shared index."""
        known = [prefix for shared in self._prefixes.values() for prefix in shared]
        return len(known), sum(prefix.index is not None for prefix in known)

    def _new_index(self, request: DraftRequest) -> Any:
        """A job's index. Its full pages before its last token (its prompt's, at its first
        draft) are matched against the known prefixes: the longest run of leading pages it
        shares with one of them (by id, then by content) becomes a shared prefix if it is not
        one already, and the job's index extends that prefix's index (built on its first use).
        A job that shares no page keeps a plain index, its pages then known as a prefix."""
        history, table, size = request.history, request.page_table, self.page_size
        full = min((len(history) - 1) // size, len(table))
        if full < 1:
            return self.index_type(self.max_n, self.min_n)
        pages = tuple(table[:full])
        best, shared = None, 0
        for prefix in self._prefixes.get(pages[0], ()):
            common = _common_length(prefix.pages, pages)
            if common > shared or (common == shared and len(prefix.pages) == common):
                best, shared = prefix, common
        if best is None or history[:shared * size] != best.tokens[:shared * size]:
            # No page shared (or its id was freed and reused for other tokens).
            self._share(SharedPrefix(pages, list(history[:full * size])), request.job_id)
            return self.index_type(self.max_n, self.min_n)
        if len(best.pages) != shared:  # the pages this job shares with another: a new prefix
            best = SharedPrefix(pages[:shared], best.tokens[:shared * size])
        self._share(best, request.job_id)
        if best.index is None:
            best.index = self.index_type(self.max_n, self.min_n)
            best.index.sync(best.tokens)
        return self.index_type(self.max_n, self.min_n, base=best.index)

    def _share(self, prefix: SharedPrefix, job_id: int) -> None:
        """Count ``job_id`` as a user of ``prefix`` (known from its first user on)."""
        if not prefix.users:
            self._prefixes.setdefault(prefix.pages[0], []).append(prefix)
        prefix.users += 1
        self._prefix_of[job_id] = prefix


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


class ModelDrafter:
    """Drafts from a draft model over its own paged cache (same page ids as the
    target's; see the module docstring).

    model / cache: the draft model and its cache; the cache must have the target cache's page
        size and page count, and the model the target's vocabulary size.
    backend: the draft's attention backend ("auto" as for the generator).
    cuda_graphs / max_batch_size: as for `ModelRunner` (one-token draft forwards replay graphs).
    cost_ratio: a draft forward's cost over a target step's, for the draft-length rule; None
        takes the ratio of the two models' weight bytes (decoding reads every weight once).
        Kept as the ``cost_ratio`` attribute, which may be set later (e.g. from a measurement).
    """

    def __init__(self, model: Model, cache: Cache, *, target_cache: Cache,
                 target_vocab_size: int, backend: str | AttentionBackend = "auto",
                 cuda_graphs: bool = True, max_batch_size: int = 256,
                 cost_ratio: float | None = None, target_model: Model | None = None) -> None:
        if cache.page_size != target_cache.page_size or cache.num_pages != target_cache.num_pages:
            raise ValueError(
                f"the draft cache must have the target cache's pages: {cache.num_pages} pages of "
                f"{cache.page_size} tokens against {target_cache.num_pages} of "
                f"{target_cache.page_size}; build it with Cache(draft_model, "
                f"max_tokens={target_cache.max_tokens})")
        if model.config.vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({model.config.vocab_size} tokens) differs from the "
                f"target's ({target_vocab_size}); a draft model must share the target's tokenizer")
        self.model = model
        self.cache = cache
        self.runner = ModelRunner(model, cache, get_backend(backend, model.device),
                                  cuda_graphs=cuda_graphs, max_batch_size=max_batch_size)
        if cost_ratio is None:
            cost_ratio = (_weight_bytes(model) / _weight_bytes(target_model)
                          if target_model is not None else 0.5)
        self.cost_ratio = cost_ratio
        self.samples = True
        self._valid: dict[int, int] = {}  # job -> leading positions whose draft keys are right

    def follow(self, plan: StepPlan) -> None:
        """Run the plan's page copies and prefill chunks through the draft model (a chunk's
        keys and values then sit in the same slots of both caches). A one-token slice the
        target samples (a decode, or a prompt's last token fed alone after a prompt-cache hit)
        is the draft model's to feed from there on: what lies before it came from chunks,
        shared pages or copies, so at most its start is valid in the draft cache."""
        chunks = []
        valid = self._valid
        for s in plan.slices:
            if s.is_prefill:
                chunks.append(SequenceSlice(s.job_id, s.token_ids, s.start_pos, s.page_table,
                                            False))
            else:
                known = valid.get(s.job_id)
                if known is None or known > s.start_pos:
                    valid[s.job_id] = s.start_pos
        if not chunks and not plan.copies:
            return
        self.runner.run(StepPlan(slices=chunks, copies=plan.copies))
        for chunk in chunks:
            valid[chunk.job_id] = chunk.end_pos

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """Drafts (greedy, or sampled for requests with ``sampling``; under the constraint's
        mask for requests with a ``matcher``): the first forward feeds each job what its draft
        cache lacks up to its last token, each later one the previous draft token."""
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        advanced = [0] * len(requests)  # tokens each matcher took, given back at the end
        live = [i for i, r in enumerate(requests) if r.length > 0]
        first = True
        try:
            while live:
                slices = []
                for i in live:
                    r = requests[i]
                    last = len(r.history) - 1
                    if first:
                        start = min(self._valid.get(r.job_id, last), last)
                        fed = list(r.history[start:])
                    else:
                        start, fed = last + len(tokens[i]), [tokens[i][-1]]
                    slices.append(SequenceSlice(r.job_id, fed, start, list(r.page_table), True))
                logits = self.runner.run(StepPlan(slices=slices))
                assert logits is not None
                vocab = self.model.config.vocab_size
                masks = [None if requests[i].matcher is None
                         else requests[i].matcher.bitmask() for i in live]
                drawn = self._draw(logits[:, :vocab], [requests[i] for i in live],
                                   [len(tokens[i]) for i in live], masks)
                stopped = set()
                for i, (token, q), piece in zip(live, drawn, slices, strict=True):
                    matcher = requests[i].matcher
                    if matcher is not None:
                        if not matcher.accept(token):
                            stopped.add(i)
                            continue
                        advanced[i] += 1
                        if matcher.is_terminated():  # complete: nothing follows, stop here
                            stopped.add(i)
                    tokens[i].append(token)
                    if q is not None:
                        probs[i].append(q)
                    self._valid[requests[i].job_id] = piece.end_pos
                first = False
                live = [i for i in live if i not in stopped and len(tokens[i]) < requests[i].length]
        finally:
            for r, count in zip(requests, advanced):
                if count:
                    r.matcher.rollback(count)
        return [Draft(t, torch.stack(q) if q else None) for t, q in zip(tokens, probs)]

    @staticmethod
    def _draw(logits: torch.Tensor, requests: Sequence[DraftRequest], offsets: Sequence[int],
              masks: Sequence[np.ndarray | None]) -> list[tuple[int, torch.Tensor | None]]:
        """Each row's draft token: the argmax, or for a sampled request a Gumbel-max draw
        from ``q`` (its temperature and top-k over the row), keyed by its salted seed and the
        counter of the position drafted; with ``q`` for the sampled ones. A row with a mask
        (packed constraint words) draws among the tokens it allows."""
        if any(m is not None for m in masks):
            logits = logits.float().clone()
            for n, words in enumerate(masks):
                if words is not None:
                    allowed = torch.from_numpy(bitmask_to_bool(words, logits.shape[1]))
                    logits[n].masked_fill_(~allowed.to(logits.device), float("-inf"))
        greedy = logits.argmax(-1).tolist()
        out: list[tuple[int, torch.Tensor | None]] = [(int(t), None) for t in greedy]
        sampled = [n for n, r in enumerate(requests) if r.sampling is not None]
        if not sampled:
            return out
        rows = logits.index_select(0, torch.tensor(sampled, device=logits.device)).float()
        for n, row in zip(sampled, rows):
            setting = requests[n].sampling
            assert setting is not None
            if 0 < setting.top_k < row.shape[0]:
                cut = torch.topk(row, setting.top_k).values[-1]
                row = row.masked_fill(row < cut, float("-inf"))
            q = torch.softmax(row / max(setting.temperature, 1e-5), -1)
            keys = torch.from_numpy(row_keys([seed_key(setting.seed ^ _DRAFT_SEED_SALT)],
                                             [setting.counter + offsets[n]])).to(q.device)
            columns = torch.arange(q.shape[0], device=q.device)
            token = int(perturb(q.log().unsqueeze(0), keys, columns).argmax())
            out[n] = (token, q)
        return out

    def settle(self, job_id: int, valid: int) -> None:
        if job_id in self._valid:
            self._valid[job_id] = min(self._valid[job_id], valid)

    def forget(self, job_id: int) -> None:
        self._valid.pop(job_id, None)


def _weight_bytes(model: Model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


__all__ = ["Draft", "DraftRequest", "DraftSampling", "Drafter", "ModelDrafter", "NgramDrafter",
           "SharedPrefix"]
