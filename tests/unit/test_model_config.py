"""ModelConfig.from_dict / from_model_dir on untrusted config.json files (pure, no torch).

Every bad field ends in a dyngen error that names the field; a short hypothesis fuzz checks that
arbitrary JSON, arbitrary field values and arbitrary bytes never raise anything else, and that
what does parse is a shape the model can be built from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dyngen_core.config import ModelConfig
from dyngen_core.errors import DynGenError, ModelFolderError, UnsupportedArchitectureError

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "bos_token_id": 0, "eos_token_id": 1, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
DELETE = object()
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)


def config(**changes: Any) -> dict[str, Any]:
    raw = dict(BASE)
    for key, value in changes.items():
        if value is DELETE:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


@pytest.mark.parametrize(("field", "value", "message"), [
    ("num_attention_heads", 0, "num_attention_heads=0, but it must be a positive integer"),
    ("num_attention_heads", -4, "num_attention_heads=-4, but it must be a positive integer"),
    ("num_attention_heads", "four", 'num_attention_heads="four", but it must be a positive'),
    ("num_attention_heads", None, "lacks 'num_attention_heads'"),
    ("num_attention_heads", DELETE, "lacks 'num_attention_heads'"),
    ("num_attention_heads", 3, "num_attention_heads=3, which is not a multiple of "
                               "num_key_value_heads=2"),
    ("hidden_size", DELETE, "lacks 'hidden_size'"),
    ("hidden_size", "64", 'hidden_size="64", but it must be a positive integer'),
    ("hidden_size", 2, "hidden_size=2 / num_attention_heads=4 is below 1"),
    ("vocab_size", DELETE, "lacks 'vocab_size'"),
    ("intermediate_size", [128], r"intermediate_size=\[128\], but it must be a positive"),
    ("num_key_value_heads", 0, "num_key_value_heads=0, but it must be a positive integer"),
    ("head_dim", 0, "head_dim=0, but it must be a positive integer"),
    ("head_dim", 7.5, "head_dim=7.5, but it must be a positive integer"),
    ("head_dim", 15, "head_dim=15; rotary embedding needs an even head_dim"),
    ("num_hidden_layers", 2.5, "num_hidden_layers=2.5, but it must be a positive integer"),
    ("num_hidden_layers", True, "num_hidden_layers=true, but it must be a positive integer"),
    ("num_hidden_layers", 0, "num_hidden_layers=0, but it must be a positive integer"),
    ("max_position_embeddings", -1, "max_position_embeddings=-1, but it must be a positive"),
    ("rope_theta", "abc", 'rope_theta="abc", but it must be a finite number above 1'),
    ("rope_theta", 0, "rope_theta=0, but it must be a finite number above 1"),
    ("rope_theta", float("nan"), "rope_theta=NaN, but it must be a finite number above 1"),
    ("rms_norm_eps", -1, "rms_norm_eps=-1, but it must be a finite number at least 0"),
    ("tie_word_embeddings", "no", 'tie_word_embeddings="no", but it must be true or false'),
    ("attention_bias", "yes", 'attention_bias="yes", but it must be true or false'),
    ("torch_dtype", 5, "torch_dtype=5, but it must be a dtype name"),
    ("eos_token_id", "x", 'eos_token_id="x", but it must be a token id .* from 0 to 511'),
    ("eos_token_id", [[1]], r"eos_token_id=\[\[1\]\], but it must be a token id"),
    ("eos_token_id", -3, "eos_token_id=-3, but it must be a token id"),
    ("eos_token_id", 512, "eos_token_id=512, but it must be a token id .* from 0 to 511"),
    ("bos_token_id", {}, "bos_token_id={}, but it must be a token id"),
    ("rope_parameters", [1], r"rope_parameters=\[1\], but it must be an object"),
    ("rope_parameters", {"rope_theta": "x"},
     "config.json's rope_parameters has rope_theta=\"x\""),
    ("rope_scaling", "yes", 'rope_scaling="yes", but it must be an object'),
    ("rope_scaling", {"rope_type": "linear"}, "config.json's rope_scaling lacks 'factor'"),
    ("rope_scaling", {"rope_type": "linear", "factor": 0}, "factor=0, but it must be a finite "
                                                           "number above 0"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8}, "rope_scaling lacks "
                                                           "'low_freq_factor'"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1,
                      "high_freq_factor": 1, "original_max_position_embeddings": 64},
     "high_freq_factor=1, but it must be above low_freq_factor=1"),
    ("rope_scaling", {"rope_type": "yarn", "factor": "big"}, 'factor="big", but it must be'),
    ("rope_scaling", {"rope_type": "yarn", "truncate": "no"}, 'truncate="no", but it must be'),
])
def test_bad_fields_are_named(field: str, value: Any, message: str) -> None:
    with pytest.raises(ModelFolderError, match=message) as info:
        ModelConfig.from_dict(config(**{field: value}))
    assert "config.json" in str(info.value)


@pytest.mark.parametrize(("changes", "message"), [
    ({"architectures": "LlamaForCausalLM"}, r"'architectures' is 'LlamaForCausalLM'; it must "
                                            r"be a list"),
    ({"architectures": DELETE}, r"'architectures' is \(none given\)"),
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel.*is not supported"),
    ({"rope_scaling": {"type": 5}}, "rope_scaling type '5' .* supported: default, linear"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "'longrope'"),
])
def test_unsupported_architecture_and_rope_type(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedArchitectureError, match=message):
        ModelConfig.from_dict(config(**changes))


def test_generation_config_is_checked_too() -> None:
    with pytest.raises(ModelFolderError, match='generation_config.json has temperature="hot"'):
        ModelConfig.from_dict(config(), {"temperature": "hot"})
    with pytest.raises(ModelFolderError, match="generation_config.json has eos_token_id=9999"):
        ModelConfig.from_dict(config(), {"eos_token_id": 9999})
    with pytest.raises(ModelFolderError, match="generation_config.json must hold a JSON object"):
        ModelConfig.from_dict(config(), [1])  # type: ignore[arg-type]


def test_good_configs_keep_their_values() -> None:
    parsed = ModelConfig.from_dict(
        config(num_key_value_heads=None, eos_token_id=[1, 2], rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, rope_theta=None),
        {"bos_token_id": 3, "eos_token_id": [2, 4], "temperature": 0.6, "top_k": 20,
         "do_sample": True, "unrelated": "kept out"},
    )
    assert (parsed.num_kv_heads, parsed.head_dim, parsed.rope_theta) == (4, 16, 500000.0)
    assert parsed.rope_scaling is not None and parsed.rope_scaling["rope_type"] == "llama3"
    assert (parsed.bos_token_id, parsed.eos_token_ids) == (3, (1, 2, 4))
    assert parsed.generation_defaults == {"temperature": 0.6, "top_k": 20, "do_sample": True}
    default_rope = ModelConfig.from_dict(config(rope_scaling={"type": "default"}))
    assert default_rope.rope_scaling is None


def test_unreadable_config_files(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    for content, message in [(b"\xff\xfe{", "is not readable JSON"),
                             (b"[" * 100_000, "nests too deeply|is not readable JSON"),
                             (b"[1, 2]", "must hold a JSON object"),
                             (b"{'a': 1}", "is not readable JSON")]:
        path.write_bytes(content)
        with pytest.raises(ModelFolderError, match=message):
            ModelConfig.from_model_dir(tmp_path)
    with open(path, "wb") as f:  # sparse: 1 GB that takes no disk
        f.truncate(2**30)
    with pytest.raises(ModelFolderError, match="^'.*config.json' holds 1,073,741,824 bytes, far "
                                               "more than a model config"):
        ModelConfig.from_model_dir(tmp_path)


@FUZZ
@given(raw=json_values)
def test_fuzz_arbitrary_json_raises_only_dyngen_errors(raw: Any) -> None:
    try:
        ModelConfig.from_dict(raw)
    except DynGenError:
        pass


@FUZZ
@given(field=st.sampled_from([*BASE, "head_dim", "rope_scaling", "rope_parameters",
                              "attention_bias", "torch_dtype"]),
       value=json_values, rope_type=st.sampled_from(["linear", "llama3", "yarn", None]))
def test_fuzz_one_bad_field_raises_only_dyngen_errors(field: str, value: Any,
                                                      rope_type: str | None) -> None:
    if rope_type is not None and isinstance(value, dict) and field.startswith("rope_"):
        value = {**value, "rope_type": rope_type}
    try:
        parsed = ModelConfig.from_dict(config(**{field: value}))
    except DynGenError:
        return
    sizes = (parsed.vocab_size, parsed.hidden_size, parsed.intermediate_size,
             parsed.num_layers, parsed.num_heads, parsed.num_kv_heads, parsed.head_dim)
    assert all(type(size) is int and size > 0 for size in sizes)
    assert parsed.num_heads % parsed.num_kv_heads == 0 and parsed.head_dim % 2 == 0
    assert parsed.rope_theta > 1 and all(0 <= i < parsed.vocab_size for i in parsed.eos_token_ids)


@FUZZ
@given(content=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_fuzz_config_file_bytes_raise_only_dyngen_errors(content: bytes,
                                                         tmp_path_factory: Any) -> None:
    folder = tmp_path_factory.mktemp("config")
    (folder / "config.json").write_bytes(content)
    try:
        ModelConfig.from_model_dir(folder)
    except DynGenError:
        pass
