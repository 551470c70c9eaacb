"""Rebuilding a Hugging Face ``tokenizer.json`` and ``tokenizer_config.json`` from a GGUF file.

A GGUF keeps the vocabulary, the BPE merges, each token's type and the special token ids as
metadata, and names its pre-tokenizer (how text is split before merging) with
``tokenizer.ggml.pre``. This module turns byte-level BPE vocabularies (``tokenizer.ggml.model ==
"gpt2"``) back into the `tokenizers` pipeline the original model shipped: its normalizer (NFC for
Qwen2, none elsewhere), the split regex that llama.cpp uses for that pre-tokenizer name (the
same as transformers' GGUF loader), ByteLevel encoding, control tokens as special added tokens.
No torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from dyngen_core.errors import ConversionError

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special, USER_DEFINED are added
# tokens matched whole but not special.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _digits_then_gpt2_split() -> pre_tokenizers.PreTokenizer:
    # llama.cpp splits off each \p{N} before the GPT-2 regex; the original HF files (StarCoder,
    # SmolLM) say the same with a Digits pre-tokenizer.
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2_split()]
    )


def _regex_split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )


# tokenizer.ggml.pre name -> how the original tokenizer.json pre-tokenizes.
PRE_TOKENIZERS = {
    "default": _gpt2_split,
    "gpt-2": _gpt2_split,
    "phi-2": _gpt2_split,
    "smollm": _digits_then_gpt2_split,
    "starcoder": _digits_then_gpt2_split,
    "refact": _digits_then_gpt2_split,
    "llama-bpe": lambda: _regex_split(_LLAMA3_SPLIT),
    "llama3": lambda: _regex_split(_LLAMA3_SPLIT),
    "smaug-bpe": lambda: _regex_split(_LLAMA3_SPLIT),
    "falcon3": lambda: _regex_split(_LLAMA3_SPLIT),
    "dbrx": lambda: _regex_split(_LLAMA3_SPLIT),
    "qwen2": lambda: _regex_split(_QWEN2_SPLIT),
    "deepseek-r1-qwen": lambda: _regex_split(_QWEN2_SPLIT),
}


# tokenizer.ggml.pre name -> the normalizer of the original tokenizer.json, where it has one.
# Qwen2's composes text to NFC (as its tiktoken original did); llama.cpp and transformers' GGUF
# loader skip this step, which changes only text that is not already NFC.
NORMALIZERS = {"qwen2": normalizers.NFC}


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer metadata of a GGUF file."""

    model: str
    pre: str
    tokens: Sequence[str]
    token_types: Sequence[int]
    merges: Sequence[str]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    chat_template: str | None

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def build_tokenizer(vocab: GgufVocab) -> Tokenizer:
    """The `tokenizers` pipeline a GGUF vocabulary describes (byte-level BPE only)."""
    if vocab.model != "gpt2":
        raise ConversionError(
            f"tokenizer.ggml.model is {vocab.model!r}; dyngen converts byte-level BPE "
            "vocabularies ('gpt2') only. Use the model's original Hugging Face folder instead."
        )
    if vocab.pre not in PRE_TOKENIZERS:
        raise ConversionError(
            f"tokenizer.ggml.pre {vocab.pre!r} is not known; known: {', '.join(PRE_TOKENIZERS)}. "
            "Use the model's original Hugging Face folder instead."
        )
    if not vocab.merges:
        raise ConversionError("the GGUF file has no tokenizer.ggml.merges; cannot rebuild BPE")
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    merges = [_split_merge(m) for m in vocab.merges]
    try:
        tokenizer = Tokenizer(models.BPE(ids, merges, fuse_unk=False, byte_fallback=False))
        if vocab.pre in NORMALIZERS:
            tokenizer.normalizer = NORMALIZERS[vocab.pre]()
        tokenizer.pre_tokenizer = PRE_TOKENIZERS[vocab.pre]()
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.post_processor = _post_processor(vocab)
        specials, plain = _added_tokens(vocab)
        tokenizer.add_special_tokens(specials)
        tokenizer.add_tokens(plain)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # `tokenizers` raises Exception, or panics (BaseException)
        raise ConversionError(
            f"the GGUF vocabulary does not make a BPE tokenizer ({type(exc).__name__}: {exc}); "
            "the file is damaged: use the model's original Hugging Face folder"
        ) from exc
    return tokenizer


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise ConversionError(f"malformed BPE merge {merge!r} in tokenizer.ggml.merges")
    return left, right


def _post_processor(vocab: GgufVocab) -> processors.PostProcessor:
    byte_level = processors.ByteLevel(trim_offsets=False)
    bos = vocab.token(vocab.bos_id)
    if not vocab.add_bos or bos is None:
        return byte_level
    template = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, vocab.bos_id)],
    )
    return processors.Sequence([byte_level, template])


def _added_tokens(vocab: GgufVocab) -> tuple[list[AddedToken], list[AddedToken]]:
    specials, plain = [], []
    for token, kind in zip(vocab.tokens, vocab.token_types, strict=True):
        if kind == TOKEN_TYPE_CONTROL:
            specials.append(AddedToken(token, special=True, normalized=False))
        elif kind == TOKEN_TYPE_USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    return specials, plain


def tokenizer_config(vocab: GgufVocab, model_max_length: int) -> dict[str, Any]:
    """What transformers keeps in ``tokenizer_config.json`` for this vocabulary."""
    config: dict[str, Any] = {
        "add_bos_token": vocab.add_bos,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    for name, token_id in (("bos_token", vocab.bos_id), ("eos_token", vocab.eos_id),
                           ("unk_token", vocab.unk_id), ("pad_token", vocab.pad_id)):
        if token_id is not None:
            config[name] = vocab.tokens[token_id]
    if vocab.chat_template:
        config["chat_template"] = vocab.chat_template
    return config


def write_tokenizer_files(tokenizer: Tokenizer, vocab: GgufVocab, model_max_length: int,
                          tokenizer_path: Path, config_path: Path) -> None:
    """Write ``tokenizer.json`` (the built `tokenizer`) and ``tokenizer_config.json``."""
    tokenizer.save(str(tokenizer_path))
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(vocab, model_max_length), f, indent=2, ensure_ascii=False)
        f.write("\n")
