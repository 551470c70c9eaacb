"""Fixtures of the GPU tests: the device they run on, and a tiny random model on it.

Every test module here sets ``pytestmark = pytest.mark.gpu``. They run on CUDA; without CUDA
they are skipped, except that ``TRITON_INTERPRET=1`` runs the Triton kernels on the CPU through
Triton's interpreter (slow, small shapes only) so kernel logic can be checked without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dyngen_core import Model

# `decode_geometry`'s keywords and the constants of `attention.triton.decode` they set.
DECODE_GEOMETRY = {"block_n": "BLOCK_N", "max_splits": "MAX_SPLITS",
                   "programs_per_sm": "PROGRAMS_PER_SM"}


def interpreter_mode() -> bool:
    """True when Triton kernels run on the CPU through Triton's interpreter."""
    return (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
            and importlib.util.find_spec("triton") is not None)


def _let_interpreter_index_scalars() -> None:
    """Triton 3.6's interpreter turns scalars into 1-element arrays and calls ``int()`` on them
    for ``range``; numpy >= 2.4 refuses that, so read the single element explicitly."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if interpreter_mode():
    _let_interpreter_index_scalars()


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CUDA when present; the CPU under the Triton interpreter; else the test is skipped."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if interpreter_mode():
        return torch.device("cpu")
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1 with triton installed, for kernel logic)")


@pytest.fixture(scope="session")
def cuda_device() -> torch.device:
    """CUDA only (CUDA graphs, the generator on the GPU); skipped elsewhere."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="session")
def bf16_fused_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (hidden 256, intermediate 512, 4 heads, 2 KV heads) and its
    tokenizer, for `bf16_fused_model`."""
    from tests.tiny_models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("bf16_fused"), "llama", seed=3,
                            hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2)


@pytest.fixture(scope="session")
def bf16_fused_model(bf16_fused_folder: Path, cuda_device: torch.device) -> Model:
    """`bf16_fused_folder`'s model in bf16 on CUDA with the default path's kernels: one-row
    products through the skinny matmul, fused norm, SiLU-and-mul and rotary."""
    model = Model.load(bf16_fused_folder, device=cuda_device, dtype="bfloat16")
    model.set_skinny_matmul(1)
    model.set_fused_ops(True)
    return model


@pytest.fixture(autouse=True)
def _restore_decode_geometry() -> Iterator[None]:
    """Every test starts and ends with the decode kernel's own geometry (`decode_geometry`)."""
    if importlib.util.find_spec("triton") is None:
        yield
        return
    from dyngen_core.kv.attention.triton import decode

    saved = {name: getattr(decode, name) for name in DECODE_GEOMETRY.values()}
    yield
    for name, value in saved.items():
        setattr(decode, name, value)


def decode_geometry(**values: int) -> None:
    """Set the decode kernel's tile and split constants for the running test (`block_n`,
    `max_splits`, `programs_per_sm` as `DECODE_GEOMETRY` names them); the autouse fixture
    puts them back after it. For helpers that have no ``monkeypatch``."""
    from dyngen_core.kv.attention.triton import decode

    for key, value in values.items():
        setattr(decode, DECODE_GEOMETRY[key], value)
