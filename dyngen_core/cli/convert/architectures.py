"""The GGUF architectures `convert_gguf` knows, and what differs between them.

llama.cpp stores Llama and Qwen2 checkpoints with the same tensor names, but its converter treats
them differently: only Llama's q and k rows are permuted (for llama.cpp's rotary layout), and the
bias tensors differ. Llama has biases on all four attention projections or none, as the file
holds them; Qwen2 always has q/k/v biases and no output bias. Each `GgufArchitecture` says so,
and what its ``config.json`` holds beyond the fields every Llama-family config shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dyngen_core.errors import ConversionError


@dataclass(frozen=True)
class AttentionBiases:
    """Which attention projections carry a bias tensor."""

    qkv: bool
    output: bool


@dataclass(frozen=True)
class GgufArchitecture:
    """One GGUF architecture and its Hugging Face counterpart.

    gguf_name: ``general.architecture`` in the file.
    hf_architecture, model_type: what ``config.json`` names.
    rotary_rows_permuted: llama.cpp permuted the q/k rows, so converting undoes it.
    qkv_bias: whether q/k/v carry biases; None means as the file holds them (``attn_q.bias``).
    output_bias_follows_qkv: the output projection has a bias exactly when q/k/v do.
    """

    gguf_name: str
    hf_architecture: str
    model_type: str
    rotary_rows_permuted: bool
    qkv_bias: bool | None
    output_bias_follows_qkv: bool

    def biases(self, file_has_q_bias: bool) -> AttentionBiases:
        """The bias tensors a converted checkpoint of this architecture holds."""
        qkv = file_has_q_bias if self.qkv_bias is None else self.qkv_bias
        return AttentionBiases(qkv=qkv, output=qkv and self.output_bias_follows_qkv)

    def config_fields(self, biases: AttentionBiases, num_layers: int) -> dict[str, Any]:
        """The ``config.json`` fields particular to this architecture."""
        if self.model_type == "qwen2":
            # llama.cpp runs qwen2 with full attention: GGUF keeps no sliding window.
            return {"use_sliding_window": False, "sliding_window": None,
                    "max_window_layers": num_layers}
        return {"attention_bias": biases.qkv, "mlp_bias": False}


ARCHITECTURES = {
    arch.gguf_name: arch
    for arch in (
        GgufArchitecture("llama", "LlamaForCausalLM", "llama", rotary_rows_permuted=True,
                         qkv_bias=None, output_bias_follows_qkv=True),
        GgufArchitecture("qwen2", "Qwen2ForCausalLM", "qwen2", rotary_rows_permuted=False,
                         qkv_bias=True, output_bias_follows_qkv=False),
    )
}


def architecture(gguf_name: str) -> GgufArchitecture:
    """The architecture named ``gguf_name`` (``general.architecture``); ConversionError when
    dyngen does not convert it."""
    if gguf_name not in ARCHITECTURES:
        raise ConversionError(
            f"GGUF architecture {gguf_name!r} is not supported; dyngen converts "
            f"{', '.join(ARCHITECTURES)} files"
        )
    return ARCHITECTURES[gguf_name]
