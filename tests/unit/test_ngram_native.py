"""The compiled n-gram index (`engine.ngram_native`): the Python index's drafts, a step's
drafts in one call, a build cached by source, and a fallback to the Python index, with a
warning, where it cannot be built."""

from __future__ import annotations

import logging
import random
import sysconfig

import pytest

from dyngen_core.engine import ngram_native
from dyngen_core.engine.speculation import NgramIndex, propose_all
from dyngen_core.runtime.drafters import Draft, DraftRequest, NgramDrafter


@pytest.fixture
def compiled():
    module = ngram_native.compiled_ngram()
    if module is None:
        pytest.skip("the compiled n-gram index cannot be built here (no C compiler)")
    return module


def grow(rng: random.Random, history: list[int], vocab: int) -> None:
    """Append a few tokens: copies of earlier spans (drafts found) or random ones; now and
    then rewind first (a banned string's rewind)."""
    if history and rng.random() < 0.1:
        del history[-rng.randint(1, min(NgramIndex.TAIL, len(history))):]
    if len(history) > 8 and rng.random() < 0.5:
        start = rng.randrange(len(history) - 4)
        history.extend(history[start:start + rng.randint(1, 4)])
    else:
        history.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))


@pytest.mark.parametrize("vocab", [3, 50, 2 ** NgramIndex.TOKEN_BITS - 1])
def test_a_step_of_drafts_in_one_call_equals_the_python_index(compiled, vocab):
    """Many jobs (some over a shared base, some with no index yet) draft step by step through
    `propose_all`: every draft equals the Python index's, and both return None for jobs with
    no index."""
    rng = random.Random(vocab)
    document = [rng.randrange(vocab) for _ in range(40)]
    python_base, compiled_base = NgramIndex(), compiled.NgramIndex()
    python_base.sync(document)
    compiled_base.sync(document)
    histories = {job: (list(document) if job % 3 == 0 else []) + [rng.randrange(vocab)]
                 for job in range(24)}
    python_indexes: dict[int, object] = {}
    compiled_indexes: dict[int, object] = {}
    for step in range(60):
        if step % 5 == 0:  # a few jobs get their indexes now; the others draft nothing yet
            for job in histories:
                if job not in python_indexes and rng.random() < 0.5:
                    shared = job % 3 == 0
                    python_indexes[job] = NgramIndex(base=python_base if shared else None)
                    compiled_indexes[job] = compiled.NgramIndex(
                        base=compiled_base if shared else None)
        requests = [DraftRequest(job, history, [], rng.randint(0, 6))
                    for job, history in histories.items()]
        expected = propose_all(python_indexes, requests, Draft)
        drafts = compiled.propose_all(compiled_indexes, requests, Draft)
        assert drafts == expected
        assert all(draft is None or type(draft) is Draft for draft in drafts)
        for history in histories.values():
            grow(rng, history, vocab)


def test_the_compiled_index_checks_what_the_python_index_checks(compiled):
    with pytest.raises(ValueError, match="min_n"):
        compiled.NgramIndex(max_n=1, min_n=2)
    with pytest.raises(ValueError, match="at most 4"):
        compiled.NgramIndex(max_n=ngram_native.MAX_N + 1)
    with pytest.raises(TypeError, match="compiled NgramIndex"):
        compiled.NgramIndex(base=NgramIndex())
    with pytest.raises(TypeError, match="compiled NgramIndex"):
        compiled.propose_all({0: NgramIndex()}, [DraftRequest(0, [1, 2], [], 2)], Draft)
    with pytest.raises(TypeError, match="DraftRequest"):
        compiled.propose_all({}, [(0, [1])], Draft)
    index = compiled.NgramIndex()
    with pytest.raises(ValueError, match="outside the n-gram index's range"):
        compiled.propose_all({0: index}, [DraftRequest(0, [1, 2, -5], [], 2)], Draft)
    assert index.indexed == 0 and index.nbytes >= 0


def test_the_build_is_cached_by_source_and_interpreter(compiled, tmp_path, monkeypatch):
    monkeypatch.setenv("DYNGEN_CACHE_DIR", str(tmp_path))
    path = ngram_native.built_path()
    assert path.parent == tmp_path / "native" and not path.exists()
    ngram_native.build(path)
    assert path.is_file()
    assert list(path.parent.iterdir()) == [path]  # nothing half-written left beside it


def test_a_cache_that_cannot_be_written_builds_in_the_temporary_directory(compiled, tmp_path,
                                                                          monkeypatch):
    # A cache folder that cannot be made (under a file): a read-only home, which root, who
    # runs CI, could still write to.
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("DYNGEN_CACHE_DIR", str(blocked / "dyngen"))
    monkeypatch.setattr(ngram_native.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    built = ngram_native._built_somewhere(ngram_native.built_path())
    assert built.is_file() and built.parent.parent == tmp_path / "tmp"
    assert ngram_native._built_somewhere(ngram_native.built_path()) == built  # found again


def test_a_failed_build_falls_back_to_the_python_index_with_a_warning(tmp_path, monkeypatch,
                                                                      caplog):
    monkeypatch.setenv("DYNGEN_CACHE_DIR", str(tmp_path))
    real = sysconfig.get_config_var
    monkeypatch.setattr(sysconfig, "get_config_var",
                        lambda name: "false" if name == "LDSHARED" else real(name))
    ngram_native._load.cache_clear()
    ngram_native._warn_once.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="dyngen"):
            assert ngram_native.compiled_ngram() is None
            drafter = NgramDrafter(page_size=8)
        assert "uses the Python index" in caplog.text and "failed" in caplog.text
        assert drafter.index_type is NgramIndex
        history = [1, 2, 3, 1, 2]
        assert [d.tokens for d in drafter.draft([DraftRequest(0, history, [], 2)])] == [[3, 1]]
        assert not list((tmp_path / "native").iterdir())
    finally:
        ngram_native._load.cache_clear()
        ngram_native._warn_once.cache_clear()
