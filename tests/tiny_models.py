"""Tiny random Llama-family models with a real trained tokenizer, written to a folder.

A folder looks like a Hugging Face download: config.json, model.safetensors,
generation_config.json, tokenizer.json and tokenizer_config.json. Weights come from the
transformers model classes with a fixed seed, then norms and biases are randomised too (left at
ones/zeros, a runtime that forgot to load them would still match). The byte-level BPE tokenizer
is trained on a built-in text so its vocabulary is exactly the model's.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

TINY_ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(4)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TRAINING_TEXT = """\
Once upon a time, in a small village between the mountains and the sea, there lived an old
clockmaker named Elias. Every morning he opened the green shutters of his shop, swept the
floor, and wound the hundred clocks that lined the walls. The children of the village liked to
press their noses against the window and watch the brass wheels turn.
One winter the great clock in the town square stopped at a quarter past three. The mayor asked
Elias to repair it before the spring festival, because without it nobody knew when the market
should open, when the bakers should light their ovens, or when the fishermen should return.
Elias climbed the narrow stairs of the tower with his lantern and his box of tools. Inside, he
found that a small gear had cracked, and the pendulum hung still in the cold air. He worked for
three days and three nights, cutting a new gear from a piece of old bronze, polishing every
tooth until it shone. On the fourth morning the clock began to tick again, and the whole village
cheered in the square. The mayor offered him a purse of gold, but Elias only asked for a warm
loaf of bread and a cup of tea. "Time," he said, "is the one thing we all share equally."
Machine learning models read text as tokens: numbers that stand for pieces of words. A language
model predicts the next token from the ones before it, one step at a time, and a cache keeps
the keys and values of earlier tokens so that each new step is cheap. Pages of the cache are
shared between requests that start with the same document, which saves memory and time.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! How
vexingly quick daft zebras jump; the five boxing wizards jump quickly. 0123456789 + - * / = ?
"""
_BASE_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": None,
}
_ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 10000.0},
    "llama3": {  # Llama 3.2 style: rope scaling with all three frequency bands hit, tied head
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        "tie_word_embeddings": True,
    },
    "mistral": {"rope_theta": 1000000.0, "sliding_window": None},
    "qwen2": {"rope_theta": 1000000.0, "tie_word_embeddings": True},
    "qwen3": {"rope_theta": 1000000.0, "head_dim": 32},
}


def write_tiny_model(folder: str | Path, arch: str = "llama", seed: int = 0,
                     **config_overrides: Any) -> Path:
    """Write a tiny random model of ``arch`` (one of TINY_ARCHS) into ``folder``; returns it.

    seed: fixes the weights. config_overrides: extra transformers config arguments.
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM), "llama3": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }
    if arch not in classes:
        raise ValueError(f"unknown tiny arch {arch!r}; use one of {TINY_ARCHS}")
    config_class, model_class = classes[arch]
    config = config_class(**{**_BASE_CONFIG, **_ARCH_CONFIG[arch], **config_overrides})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    _randomise_vectors(model, seed)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, config.vocab_size)
    return out


def load_quantizable_model(folder: str | Path) -> tuple[Any, Any]:
    """A tiny llama whose head_dim (32: 128 hidden, 4 heads, 2 KV heads) quantized caches
    accept, written into ``folder`` and loaded on the CPU in float32: (Model, Tokenizer)."""
    from dyngen_core import Model, Tokenizer

    path = write_tiny_model(folder, arch="llama", seed=5, hidden_size=128,
                            intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    return Model.load(path, device="cpu", dtype="float32"), Tokenizer.from_model_dir(path)


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """tokenizer.json (byte-level BPE of exactly ``vocab_size`` ids), tokenizer_config.json
    (ChatML template) and generation_config.json."""
    (folder / "tokenizer.json").write_text(trained_tokenizer_json(vocab_size), encoding="utf-8")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 4096,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))


@functools.lru_cache(maxsize=4)
def trained_tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE tokenizer trained on TRAINING_TEXT, serialised (cached per size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the built-in text trains only {tokenizer.get_vocab_size()} tokens; "
                         f"ask for vocab_size <= that")
    return str(tokenizer.to_str())


def _randomise_vectors(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim != 1:
                continue
            noise = torch.randn(param.shape, generator=generator)
            is_norm = name.endswith("norm.weight")
            param.copy_(1.0 + 0.2 * noise if is_norm else 0.1 * noise)
