"""Text in and out: tokenizer, chat templates, the incremental detokenizer, stop and banned
strings, tool calls and constraints. Pure Python; nothing here imports torch."""
