"""Converting qwen2 GGUF files: a tiny model written as llama.cpp writes one (tests/qwen2_gguf.py)
must convert back to the values its quantized blocks stand for, with its q/k rows left as they
are, its q/k/v biases kept and an untied lm_head; dyngen and transformers' Qwen2 must agree on
the converted folder; and its tokenizer must encode like transformers' own GGUF tokenizer."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from dyngen_core.cli.convert.gguf import convert_gguf
from dyngen_core.engine.plan import SequenceSlice, StepPlan
from dyngen_core.errors import ConversionError
from dyngen_core.kv.attention import SdpaBackend
from dyngen_core.kv.attention.base import build_forward_batch
from dyngen_core.kv.cache import Cache
from dyngen_core.model import Model
from dyngen_core.text.tokenizer import Tokenizer
from tests.qwen2_gguf import MIXED, TinyQwen2, write_qwen2_gguf

Converted = tuple[Path, Path, dict[str, np.ndarray]]  # GGUF, folder, the weights it stands for
LOGIT_TOLERANCE = 1e-4
SAMPLES = [
    "def add(a, b):\n    return a + b\n\nprint(add(12, 345))  # 357\n",
    "for (let i = 0; i < 10; i++) {\n\tconsole.log(`i=${i}`);\r\n}",
    "The quick brown fox DOESN'T jump; it's lazy. I'll see, they'd go.",
    "Grüße aus Köln! Ça va? 日本語 😀👍🏽 3.14159 and 1,000,000.",
    "<|im_start|>user\n<tool_call>{\"a\": 1}</tool_call><|im_end|>\n",
    "   leading\n\n\n\ttabs\t\tand   trailing   ",
]


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Converted:
    folder = tmp_path_factory.mktemp("qwen2")
    weights = write_qwen2_gguf(folder / "tiny-qwen2.gguf")
    return folder / "tiny-qwen2.gguf", convert_gguf(folder / "tiny-qwen2.gguf",
                                                   folder / "out"), weights


def test_weights_are_the_blocks_values_with_biases_and_an_untied_head(
    tiny_qwen2: Converted,
) -> None:
    _, out, expected = tiny_qwen2
    converted = load_file(str(out / "model.safetensors"))
    assert sorted(converted) == sorted(expected)
    assert "lm_head.weight" in converted and "model.layers.0.self_attn.q_proj.bias" in converted
    assert not any(name.endswith("o_proj.bias") for name in converted)
    for name, value in expected.items():  # q/k rows included: qwen2 is stored unpermuted
        np.testing.assert_array_equal(converted[name], value, err_msg=name)


def test_config_is_a_qwen2_config(tiny_qwen2: Converted) -> None:
    shape, out = TinyQwen2(), tiny_qwen2[1]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["intermediate_size"], config["num_hidden_layers"], config["head_dim"]) == (
        shape.hidden, shape.heads, shape.kv_heads, shape.ffn, shape.layers, shape.head_dim)
    assert config["rope_theta"] == 1000000.0 and config["rms_norm_eps"] == 1e-6
    assert config["max_position_embeddings"] == shape.context
    assert config["tie_word_embeddings"] is False
    assert config["use_sliding_window"] is False and config["sliding_window"] is None
    assert "attention_bias" not in config  # Qwen2 configs do not name it: the biases are fixed
    tokens = Tokenizer.from_model_dir(out)
    assert config["eos_token_id"] == tokens.piece_to_id("<|im_end|>")
    assert config["bos_token_id"] == config["pad_token_id"] == tokens.piece_to_id("<|endoftext|>")


def dyngen_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    model = Model.load(folder, device="cpu", dtype="float32")
    cache = Cache(model, max_tokens=256)
    batch = build_forward_batch(StepPlan([SequenceSlice(0, ids, 0, [0], True)]), 256,
                                model.device)
    return model.forward(batch, cache.storage, SdpaBackend())


def transformers_qwen2(weights: dict[str, np.ndarray]) -> torch.nn.Module:
    """transformers' Qwen2 of the tiny shape, built from the test's own numbers and weights
    (not from the converted folder)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = TinyQwen2()
    config = Qwen2Config(
        vocab_size=weights["model.embed_tokens.weight"].shape[0], hidden_size=shape.hidden,
        intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.context, rms_norm_eps=shape.rms_eps,
        rope_theta=shape.rope_theta, tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    return model


def test_dyngen_and_transformers_qwen2_agree_on_the_converted_folder(
    tiny_qwen2: Converted,
) -> None:
    from transformers import AutoModelForCausalLM

    _, out, weights = tiny_qwen2
    ids = Tokenizer.from_model_dir(out).encode(SAMPLES[0] + SAMPLES[2])
    with torch.no_grad():
        reference = transformers_qwen2(weights)(torch.tensor([ids])).logits[0, -1]
        from_folder = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        folder_logits = from_folder(torch.tensor([ids])).logits[0, -1]
        ours = dyngen_logits(out, ids)[0]
    assert type(from_folder).__name__ == "Qwen2ForCausalLM"
    assert (folder_logits - reference).abs().max().item() <= LOGIT_TOLERANCE
    assert (ours - reference).abs().max().item() <= LOGIT_TOLERANCE
    assert reference.abs().max().item() > 1.0  # the logits are not trivially all near zero


def test_tokenizer_encodes_like_transformers_gguf_tokenizer(tiny_qwen2: Converted) -> None:
    from transformers import AutoTokenizer

    gguf_path, out, _ = tiny_qwen2
    ours = Tokenizer.from_model_dir(out)
    theirs = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    assert ours.vocab_size == len(theirs) == len(json.loads(
        (out / "tokenizer.json").read_text())["model"]["vocab"])
    for text in SAMPLES:
        ids = ours.encode(text, encode_special_tokens=True)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, decode_special_tokens=True) == text
    assert ours.encode("<tool_call>") == [ours.piece_to_id("<tool_call>")]  # user-defined: whole
    assert ours.special_token_ids == {ours.piece_to_id(t) for t in
                                      ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    rendered = ours.apply_chat_template([{"role": "user", "content": "hi"}],
                                        add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_composes_text_to_nfc_like_qwen2s_own(tiny_qwen2: Converted) -> None:
    from transformers import Qwen2Tokenizer

    out = tiny_qwen2[1]
    ours = Tokenizer.from_model_dir(out)
    model = json.loads((out / "tokenizer.json").read_text())["model"]
    qwen2 = Qwen2Tokenizer(vocab=model["vocab"],
                           merges=[tuple(m) if isinstance(m, list) else tuple(m.split(" "))
                                   for m in model["merges"]])
    decomposed = unicodedata.normalize("NFD", "Grüße aus Köln, Ça va")
    assert decomposed != unicodedata.normalize("NFC", decomposed)
    assert ours.encode(decomposed) == ours.encode(unicodedata.normalize("NFC", decomposed))
    assert ours.encode(decomposed) == qwen2.encode(decomposed, add_special_tokens=False)


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0], ids=lambda k: k.name)
def test_each_quant_type_dequantizes_to_its_definition(tmp_path: Path, kind: Q) -> None:
    """Every matrix in one GGML type, its blocks drawn at random (tests/ggml_blocks.py): the
    converted values are exactly what the block format defines."""
    shape = TinyQwen2(layers=1, quant=dict.fromkeys(MIXED, kind))
    expected = write_qwen2_gguf(tmp_path / "one-type.gguf", shape, seed=int(kind))
    converted = load_file(str(convert_gguf(tmp_path / "one-type.gguf", tmp_path / "out")
                              / "model.safetensors"))
    for name, value in expected.items():
        np.testing.assert_array_equal(converted[name], value, err_msg=name)


def test_tied_file_gets_no_lm_head(tmp_path: Path) -> None:
    expected = write_qwen2_gguf(tmp_path / "tied.gguf", TinyQwen2(layers=1, tied=True))
    out = convert_gguf(tmp_path / "tied.gguf", tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert sorted(load_file(str(out / "model.safetensors"))) == sorted(expected)
    assert "lm_head.weight" not in expected


@pytest.mark.parametrize(("change", "message"), [
    ({"drop": ("blk.0.attn_q.bias",)}, r"lacks 1 tensor.*blk\.0\.attn_q\.bias.*qwen2"),
    ({"extra": ("blk.0.attn_output.bias",)}, r"holds tensor.*blk\.0\.attn_output\.bias"),
], ids=["no q bias", "an output bias"])
def test_biases_other_than_qwen2s_are_refused(
    tmp_path: Path, change: dict[str, tuple[str, ...]], message: str
) -> None:
    write_qwen2_gguf(tmp_path / "odd.gguf", TinyQwen2(layers=1), **change)
    with pytest.raises(ConversionError, match=message):
        convert_gguf(tmp_path / "odd.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
