"""The paged KV cache as one subsystem: the cache, its storage modes (fp16, q8, q6, q4) and the
attention backends that read them."""
