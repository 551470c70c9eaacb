"""Quantized pages (the "q8", "q6" and "q4" cache modes): format, storage, recent window,
write."""
