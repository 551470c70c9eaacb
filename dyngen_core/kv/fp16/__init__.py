"""Unquantized pages (the "fp16" cache mode: the model's own dtype)."""
