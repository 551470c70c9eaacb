"""The fused draw replayed from CUDA graphs (`sampling.draw.DrawGraphs`) against the eager fused
draw: the same tokens step after step while the batch shrinks and grows inside a buffer,
settings change, buffers differ and graphs are evicted; rows with logit edits keep the eager
draw. CUDA only (graphs)."""

from __future__ import annotations

import pytest
import torch

from dyngen_core import SamplerSettings
from dyngen_core.engine.record import SampleRequest
from dyngen_core.sampling.draw import ROW_BUCKET
from dyngen_core.sampling.sampler import Sampler

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

VOCAB = 4096
PLAIN = [SamplerSettings(temperature=0.8, top_p=0.9, top_k=50),
         SamplerSettings(temperature=1.3, top_k=7),
         SamplerSettings(top_k=40, top_p=0.5)]
OTHER = [SamplerSettings(temperature=0.5, top_k=50, top_p=0.7)]


def _requests(settings: list[SamplerSettings], rows: int, step: int,
              seed_base: int = 1000) -> list[SampleRequest]:
    return [SampleRequest(settings=settings[i % len(settings)], seed=seed_base + i,
                          counter=step) for i in range(rows)]


def _pair(device: torch.device) -> tuple[Sampler, Sampler]:
    return (Sampler(VOCAB, device, draw_graphs=True),
            Sampler(VOCAB, device, draw_graphs=False))


def test_replayed_draw_equals_the_eager_draw(cuda_device: torch.device) -> None:
    graphed, eager = _pair(cuda_device)
    assert graphed.draw_graphs is not None and eager.draw_graphs is None
    buffer = torch.randn(96, VOCAB, device=cuda_device) * 3
    counts = [70, 70, 65, 96, 3, 33, 64]
    for step, count in enumerate(counts):
        buffer.normal_(0, 3)  # new logits in the same buffer, as a decode graph's output
        logits = buffer[:count]
        settings = PLAIN if step < 4 else OTHER + PLAIN
        requests = _requests(settings, count, step)
        launched = graphed.launch_tokens(logits, requests)
        assert launched is not None
        expected = eager.launch_tokens(logits, _requests(settings, count, step))
        assert expected is not None
        assert launched.tolist() == expected.tolist(), step
        ids, _ = graphed.sample_tokens(logits, _requests(settings, count, step))
        assert ids == expected.tolist()
    # Buckets of ROW_BUCKET rows, capped at the buffer's 96: 70 and 65 share one.
    buckets = {min(96, -(-c // ROW_BUCKET) * ROW_BUCKET) for c in counts}
    assert len(graphed.draw_graphs) == len(buckets)


def test_kept_rows_follow_their_counters(cuda_device: torch.device) -> None:
    graphed, eager = _pair(cuda_device)
    logits = torch.randn(40, VOCAB, device=cuda_device) * 2
    requests = _requests(PLAIN, 40, 0)
    mirror = _requests(PLAIN, 40, 0)
    for step in range(5):
        for request, twin in zip(requests, mirror, strict=True):
            request.counter = twin.counter = step
        got = graphed.launch_tokens(logits, requests, kept=True)
        want = eager.launch_tokens(logits, mirror, kept=True)
        assert got is not None and want is not None
        assert got.tolist() == want.tolist(), step


def test_each_buffer_gets_its_graph_and_old_ones_are_dropped(cuda_device: torch.device) -> None:
    graphed, eager = _pair(cuda_device)
    assert graphed.draw_graphs is not None
    graphed.draw_graphs.max_graphs = 2
    buffers = [torch.randn(32, VOCAB, device=cuda_device) for _ in range(3)]
    for step in range(2):
        for index, buffer in enumerate(buffers):
            requests = _requests(PLAIN, 32, step, seed_base=100 * index)
            got = graphed.launch_tokens(buffer, requests)
            want = eager.launch_tokens(buffer, _requests(PLAIN, 32, step, seed_base=100 * index))
            assert got is not None and want is not None
            assert got.tolist() == want.tolist(), (step, index)
    assert len(graphed.draw_graphs) == 2


def test_rows_with_logit_edits_are_drawn_eagerly(cuda_device: torch.device) -> None:
    graphed, eager = _pair(cuda_device)
    assert graphed.draw_graphs is not None
    logits = torch.randn(16, VOCAB, device=cuda_device)
    settings = [SamplerSettings(temperature=0.7, top_k=20, token_bias={3: 5.0})]
    got = graphed.launch_tokens(logits, _requests(settings, 16, 0))
    want = eager.launch_tokens(logits, _requests(settings, 16, 0))
    assert got is not None and want is not None
    assert got.tolist() == want.tolist()
    assert len(graphed.draw_graphs) == 0


def test_padding_rows_never_reach_the_caller(cuda_device: torch.device) -> None:
    """A NaN row past the batch (in the bucket's padding) does not mark any batch row."""
    graphed, _ = _pair(cuda_device)
    buffer = torch.randn(64, VOCAB, device=cuda_device)
    buffer[40:] = float("nan")
    got = graphed.launch_tokens(buffer[:33], _requests(PLAIN, 33, 0))
    assert got is not None and got.shape == (33,)
    assert all(0 <= t < VOCAB for t in got.tolist())


def test_a_failed_capture_falls_back_to_the_eager_draw(cuda_device: torch.device,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch whose top-k cannot be captured: one warning, then the eager draw's tokens, and
    no further capture attempts."""
    graphed, eager = _pair(cuda_device)
    assert graphed.draw_graphs is not None
    attempts = []

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph", refuse)
    logits = torch.randn(24, VOCAB, device=cuda_device)
    with pytest.warns(RuntimeWarning, match="capturing the fused draw failed"):
        got = graphed.launch_tokens(logits, _requests(PLAIN, 24, 0))
    again = graphed.launch_tokens(logits, _requests(PLAIN, 24, 1))
    want = eager.launch_tokens(logits, _requests(PLAIN, 24, 0))
    want_again = eager.launch_tokens(logits, _requests(PLAIN, 24, 1))
    assert got is not None and again is not None and want is not None
    assert want_again is not None
    assert got.tolist() == want.tolist() and again.tolist() == want_again.tolist()
    assert len(attempts) == 1 and graphed.draw_graphs.failure is not None
    assert len(graphed.draw_graphs) == 0
