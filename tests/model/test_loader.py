"""Model.load: every error it promises (type and message), sharded and tied checkpoints,
dtype and device choices."""

from __future__ import annotations

import json
import shutil
import tempfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from dyngen_core.config import ModelConfig
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.errors import (
    DynGenError,
    ModelFolderError,
    UnsupportedArchitectureError,
    WeightsError,
)
from dyngen_core.kv.attention import SdpaBackend
from dyngen_core.kv.attention.base import build_forward_batch
from dyngen_core.kv.cache import Cache
from dyngen_core.model import Model
from dyngen_core.model.loader import WEIGHT_DTYPES, checked_layout, read_inventory

WEIGHTS = "model.safetensors"


@pytest.fixture
def llama_copy(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny Llama folder, free to break."""
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))


def edit_weights(folder: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    tensors = load_file(folder / WEIGHTS)
    edit(tensors)
    save_file(tensors, folder / WEIGHTS)


def edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def logits_of(model: Model, ids: list[int]) -> torch.Tensor:
    cache = Cache(model, max_tokens=256)
    batch = build_forward_batch(StepPlan([SequenceSlice(0, ids, 0, [0], True)]), 256,
                                model.device)
    return model.forward(batch, cache.storage, SdpaBackend())


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelFolderError, match="does not exist"):
        Model.load(tmp_path / "nowhere")


def test_missing_config(llama_copy: Path) -> None:
    (llama_copy / "config.json").unlink()
    with pytest.raises(ModelFolderError, match=r"config\.json'? is missing"):
        Model.load(llama_copy)


def test_unsupported_architecture(llama_copy: Path) -> None:
    edit_config(llama_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel") as info:
        Model.load(llama_copy)
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                      "Qwen3ForCausalLM"):
        assert supported in str(info.value)


def test_unsupported_rope_scaling(llama_copy: Path) -> None:
    edit_config(llama_copy, rope_scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(UnsupportedArchitectureError, match="'longrope'.*supported: default"):
        Model.load(llama_copy)


def test_no_weights(llama_copy: Path) -> None:
    (llama_copy / WEIGHTS).unlink()
    with pytest.raises(ModelFolderError, match=r"no \.safetensors weights"):
        Model.load(llama_copy)
    (llama_copy / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelFolderError, match="pytorch_model.bin: pickled weights"):
        Model.load(llama_copy)


def test_missing_tensor(llama_copy: Path) -> None:
    edit_weights(llama_copy, lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(WeightsError, match="lacks 1 tensor.*'model.layers.1.self_attn.v_proj"):
        Model.load(llama_copy)


def test_missing_lm_head_suggests_tying(llama_copy: Path) -> None:
    edit_weights(llama_copy, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(WeightsError, match="'lm_head.weight'.*tie_word_embeddings"):
        Model.load(llama_copy)


def test_unexpected_tensor(llama_copy: Path) -> None:
    def add(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(128)

    edit_weights(llama_copy, add)
    with pytest.raises(WeightsError, match="does not use: 'model.layers.0.mlp.gate_proj.bias'"):
        Model.load(llama_copy)


def test_wrong_shape(llama_copy: Path) -> None:
    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    edit_weights(llama_copy, shrink)
    message = (r"'model.layers.0.self_attn.k_proj.weight' in model.safetensors has shape "
               r"\[16, 64\] but config.json implies \[32, 64\]")
    with pytest.raises(WeightsError, match=message):
        Model.load(llama_copy)


def test_absurd_layer_count_fails_before_anything_is_built(llama_copy: Path) -> None:
    edit_config(llama_copy, num_hidden_layers=10**6)
    tracemalloc.start()
    try:
        with pytest.raises(WeightsError, match=r"config.json says num_hidden_layers=1000000, but "
                                               r"the checkpoint holds 2 layer\(s\); set "
                                               r"num_hidden_layers to 2"):
            Model.load(llama_copy)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20  # no layout, no parameters for the million layers


@pytest.mark.parametrize(("field", "value", "blame"), [
    ("hidden_size", 10**9, r"model.embed_tokens.weight.*\(dimension 1 from hidden_size\)"),
    ("vocab_size", 10**9, r"model.embed_tokens.weight.*\(dimension 0 from vocab_size\)"),
    ("intermediate_size", 10**9,
     r"gate_proj.weight.*\(dimension 0 from intermediate_size\)"),
    ("num_attention_heads", 64,
     r"o_proj.weight.*\(dimension 1 from num_attention_heads x head_dim\)"),
])
def test_absurd_sizes_name_the_field(llama_copy: Path, field: str, value: int,
                                     blame: str) -> None:
    edit_config(llama_copy, **{field: value})
    with pytest.raises(WeightsError, match=blame):
        Model.load(llama_copy)


def test_layers_with_a_gap(llama_copy: Path) -> None:
    def renumber(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.startswith("model.layers.1.")]:
            tensors[name.replace("layers.1.", "layers.5.")] = tensors.pop(name)

    edit_weights(llama_copy, renumber)
    with pytest.raises(WeightsError, match="not numbered 0 to 1: it holds model.layers.5 but no "
                                           "model.layers.1, 2, 3, 4, 6"):
        Model.load(llama_copy)


def test_integer_weights_are_refused(llama_copy: Path) -> None:
    def to_int(tensors: dict[str, torch.Tensor]) -> None:
        name = "model.layers.0.mlp.up_proj.weight"
        tensors[name] = tensors[name].to(torch.int64)

    edit_weights(llama_copy, to_int)
    with pytest.raises(WeightsError, match="up_proj.weight' in model.safetensors is stored as "
                                           "I64; dyngen loads floating-point weights"):
        Model.load(llama_copy)


@pytest.mark.parametrize("index", [
    {"weight_map": {"model.norm.weight": "../model.safetensors"}},
    {"weight_map": {"model.norm.weight": "/etc/passwd"}},
    {"weight_map": {"model.norm.weight": 5}},
    {"weight_map": [1]},
    {"no_map": {}},
])
def test_bad_shard_index(llama_copy: Path, index: object) -> None:
    (llama_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="shard|not a valid safetensors index"):
        Model.load(llama_copy)
    (llama_copy / "model.safetensors.index.json").write_bytes(b"\xff\xfe")
    with pytest.raises(WeightsError, match="not a valid safetensors index"):
        Model.load(llama_copy)


def test_corrupt_header(llama_copy: Path) -> None:
    data = (llama_copy / WEIGHTS).read_bytes()
    (llama_copy / WEIGHTS).write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(WeightsError, match="model.safetensors' is not a readable safetensors"):
        Model.load(llama_copy)


def test_truncated_file(llama_copy: Path) -> None:
    data = (llama_copy / WEIGHTS).read_bytes()
    (llama_copy / WEIGHTS).write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="corrupt or truncated"):
        Model.load(llama_copy)


def test_sharded_equals_single_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert (sharded / "model.safetensors.index.json").is_file()
    single, split = Model.load(tiny_llama_dir), Model.load(sharded)
    split_params = dict(split.named_parameters())
    for name, param in single.named_parameters():
        assert torch.equal(param, split_params[name]), name
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelFolderError, match=f"missing.*'{shard.name}'"):
        Model.load(sharded)


def test_tied_embeddings(tiny_model_dirs: Callable[[str], Path], tmp_path: Path) -> None:
    tied_dir = tiny_model_dirs("qwen2")
    model = Model.load(tied_dir)
    assert model.config.tie_word_embeddings
    assert model.lm_head_weight is model.embed_weight
    # A tied checkpoint that still carries an lm_head copy loads too (the copy is ignored).
    copy = Path(shutil.copytree(tied_dir, tmp_path / "with_head"))
    edit_weights(copy, lambda t: t.update({"lm_head.weight": torch.zeros(512, 64)}))
    reloaded = Model.load(copy)
    assert torch.equal(reloaded.lm_head_weight, model.embed_weight)


def test_every_rope_scaling_type_has_an_implementation() -> None:
    from dyngen_core.config import ROPE_SCALING_FIELDS
    from dyngen_core.model.rope import _BY_TYPE

    assert set(_BY_TYPE) == {"default", *ROPE_SCALING_FIELDS}


@pytest.mark.parametrize("dtype", ["bfloat16", torch.float16])
def test_half_precision_load(tiny_llama_dir: Path, dtype: str | torch.dtype) -> None:
    expected = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    model = Model.load(tiny_llama_dir, dtype=dtype)
    assert model.dtype == expected
    assert {p.dtype for p in model.parameters()} == {expected}
    ids = list(range(20, 60))
    half, full = logits_of(model, ids), logits_of(Model.load(tiny_llama_dir), ids)
    assert half.dtype == torch.float32
    assert (half - full).abs().max().item() < 0.1


def test_auto_dtype_and_device_on_cpu(llama_copy: Path) -> None:
    edit_config(llama_copy, dtype="bfloat16")
    model = Model.load(llama_copy, device="auto", dtype="auto")
    if not torch.cuda.is_available():
        assert (model.device, model.dtype) == (torch.device("cpu"), torch.float32)
    assert model.layer_devices == [model.device] * model.config.num_layers
    assert model.model_dir == llama_copy
    with pytest.raises(ValueError, match="dtype 'float8' is unknown"):
        Model.load(llama_copy, dtype="float8")


def test_progress_bar_counts_bytes(tiny_llama_dir: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    from tqdm import tqdm

    model = Model.load(tiny_llama_dir, progress=True)
    err = capsys.readouterr().err
    size = tqdm.format_sizeof(sum(p.numel() * 4 for p in model.parameters()))  # float32 file
    assert f"Loading {tiny_llama_dir.name}" in err
    assert "100%" in err and f"{size}/{size}" in err


# ---- fuzz: the safetensors reader never raises anything but dyngen's errors ----

FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
header_entries = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "X", 3]),
    "shape": st.lists(st.integers(-2, 70), max_size=3) | st.text(max_size=3),
    "data_offsets": st.lists(st.integers(-5, 300), max_size=3),
})
headers = st.dictionaries(
    st.sampled_from(["model.norm.weight", "model.embed_tokens.weight", "__metadata__",
                     "model.layers.0.mlp.up_proj.weight", "model.layers.99999999999.x", "x"]),
    header_entries | st.dictionaries(st.text(max_size=3), st.text(max_size=3)) | st.integers(),
    max_size=4)


def inventory_then_layout(data: bytes, config: ModelConfig) -> None:
    """The header-side half of Model.load on one model.safetensors holding ``data``: a
    dyngen error, or a layout whose every tensor is there with its shape and a float dtype."""
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / WEIGHTS
        path.write_bytes(data)
        try:
            inventory = read_inventory([path])
            layout = checked_layout(inventory, config)
        except DynGenError:
            return
    for name, slot in layout.items():
        assert inventory[name].shape == slot.shape and inventory[name].dtype in WEIGHT_DTYPES


@FUZZ
@given(data=st.binary(max_size=300))
def test_fuzz_arbitrary_bytes(tiny_llama_dir: Path, data: bytes) -> None:
    inventory_then_layout(data, ModelConfig.from_model_dir(tiny_llama_dir))


@FUZZ
@given(header=headers, length_delta=st.integers(-3, 3) | st.just(2**62),
       body=st.binary(max_size=300))
def test_fuzz_headers(tiny_llama_dir: Path, header: dict[str, object], length_delta: int,
                      body: bytes) -> None:
    encoded = json.dumps(header).encode()
    length = max(0, len(encoded) + length_delta) if length_delta < 2**62 else length_delta
    inventory_then_layout(length.to_bytes(8, "little") + encoded + body,
                          ModelConfig.from_model_dir(tiny_llama_dir))


tensor_names = st.sampled_from(["model.embed_tokens.weight", "lm_head.weight",
                                 "rotary_emb.inv_freq"]) | st.builds(
    "model.layers.{}.{}".format, st.integers(0, 3) | st.integers(0, 10**12),
    st.sampled_from(["input_layernorm.weight", "self_attn.q_proj.weight", "mlp.up_proj.weight",
                     "self_attn.q_proj.bias", "x"]))
edits = st.lists(st.tuples(
    tensor_names, st.sampled_from(["drop", "add", "reshape", "retype"]),
    st.lists(st.integers(0, 70), max_size=2),
    st.sampled_from(["float32", "float16", "float64", "int64", "uint8", "bool"])), max_size=3)


@FUZZ
@given(changes=edits)
def test_fuzz_edited_tensor_tables(
    tiny_llama_dir: Path, changes: list[tuple[str, str, list[int], str]]
) -> None:
    import numpy as np
    from safetensors.numpy import load_file as load_numpy
    from safetensors.numpy import save

    arrays = load_numpy(tiny_llama_dir / WEIGHTS)
    for name, change, shape, dtype in changes:
        if change == "drop":
            arrays.pop(name, None)
        elif change == "add" or name in arrays:
            old = arrays.get(name, np.zeros(shape))
            arrays[name] = np.zeros(shape if change != "retype" else old.shape,
                                    dtype if change != "reshape" else old.dtype)
    inventory_then_layout(save(arrays), ModelConfig.from_model_dir(tiny_llama_dir))


@FUZZ
@given(flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1,
                      max_size=4),
       cut=st.none() | st.floats(0, 1))
def test_fuzz_damaged_checkpoint_loads_or_fails_cleanly(
    tiny_llama_dir: Path, flips: list[tuple[float, int]], cut: float | None
) -> None:
    original = (tiny_llama_dir / WEIGHTS).read_bytes()
    header_end = 8 + int.from_bytes(original[:8], "little")
    data = bytearray(original)
    for where, value in flips:  # mostly inside the header, where parsing happens
        data[int(where * (header_end - 1))] = value
    if cut is not None:
        data = data[: int(cut * len(data))]
    with tempfile.TemporaryDirectory() as work:
        folder = Path(shutil.copytree(tiny_llama_dir, Path(work) / "m"))
        (folder / WEIGHTS).write_bytes(bytes(data))
        try:
            Model.load(folder)
        except DynGenError:
            pass
