"""The Triton attention backend: paged prefill and decode over fp16 or quantized pages, and
shared-prefix (cascade) decode. Kernel modules import triton at the top."""
