"""`Tokenizer`: text to token ids and back, special tokens, end-of-sequence ids, chat templates.

A thin layer over the `tokenizers` library (the folder's ``tokenizer.json``) plus what Hugging Face
keeps in ``tokenizer_config.json`` (named special tokens, chat template), ``config.json`` and
``generation_config.json`` (the ids that end generation). Pure Python: no torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from dyngen_core.errors import TokenizerError
from dyngen_core.text.chat_template import ChatTemplate
from dyngen_core.text.detokenize import TokenPieces
from dyngen_core.text.template_sandbox import TemplateLimits

# The named special tokens transformers hands a chat template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)


class Tokenizer:
    """Encodes and decodes text for one model.

    backend: a `tokenizers.Tokenizer` (what ``tokenizer.json`` holds).
    special_tokens: named special tokens as text, e.g. ``{"bos_token": "<s>"}``.
    eos_token_ids: every id that ends generation (besides the ``eos_token``'s own id).
    chat_template: a jinja2 template, or a dict of named templates (``"default"``,
        ``"tool_use"``, ...), or None when the model has none.
    add_bos_token: what the model's tokenizer_config says about a leading BOS (informational;
        `encode` adds one only when asked).
    model_max_length: the longest input the model was trained for, when known.
    template_limits: how long one chat-template render may run and how much text it may
        produce (templates come from the model folder: untrusted code); settable later.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | Mapping[str, str] | None = None,
        add_bos_token: bool = False,
        model_max_length: int | None = None,
        template_limits: TemplateLimits | None = None,
    ) -> None:
        # `encode_special_tokens` is a mutable flag on the backend, so each mode gets its own
        # backend: encode() may be called from several threads at once.
        self._parsing = backend
        self._splitting = tokenizers.Tokenizer.from_str(backend.to_str())
        self._splitting.encode_special_tokens = True
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.add_bos_token = add_bos_token
        self.model_max_length = model_max_length
        self._templates = _named_templates(chat_template)
        self._compiled: dict[str, ChatTemplate] = {}
        self._template_limits = template_limits or TemplateLimits()
        self.special_token_ids = frozenset(
            token_id
            for token_id, added in backend.get_added_tokens_decoder().items()
            if added.special
        )
        self.eos_token_id = self._id_of("eos_token")
        first = [] if self.eos_token_id is None else [self.eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*first, *eos_token_ids]))
        if self.eos_token_id is None and self.eos_token_ids:
            self.eos_token_id = self.eos_token_ids[0]
        self.bos_token_id = self._id_of("bos_token")
        self.pad_token_id = self._id_of("pad_token")
        self.unk_token_id = self._id_of("unk_token")
        self._pieces: TokenPieces | None = None
        self._pieces_built = False

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Read ``tokenizer.json`` and, when present, ``tokenizer_config.json``,
        ``chat_template.jinja``, ``config.json`` and ``generation_config.json`` from a folder."""
        folder = Path(model_dir)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"{str(path)!r} is missing; dyngen needs a fast-tokenizer tokenizer.json (save one "
                "with transformers' tokenizer.save_pretrained, or convert a GGUF file with "
                "`dyngen convert-gguf MODEL.gguf OUT_DIR`)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # plain Exception, or a Rust panic (a BaseException)
            raise TokenizerError(f"{str(path)!r} cannot be read by `tokenizers`: {exc}; "
                                 "re-download it") from exc
        config = _read_json(folder / "tokenizer_config.json")
        template = _folder_template(folder, config)
        bos_eos = [_read_json(folder / name) for name in ("generation_config.json", "config.json")]
        backend_bos = _special_ids(bos_eos, "bos_token_id")
        special = {
            name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name)))
        }
        if "bos_token" not in special and backend_bos:
            special["bos_token"] = backend.id_to_token(backend_bos[0]) or ""
        max_length = config.get("model_max_length")
        return cls(
            backend,
            special_tokens=special,
            eos_token_ids=_special_ids(bos_eos, "eos_token_id"),
            chat_template=template,
            add_bos_token=_flag(config, "add_bos_token", folder / "tokenizer_config.json"),
            model_max_length=int(max_length) if isinstance(max_length, int) else None,
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (special tokens in text are parsed)."""
        return self._parsing

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self._parsing.get_vocab_size(with_added_tokens=True))

    def encode(
        self, text: str, add_bos: bool = False, encode_special_tokens: bool = False
    ) -> list[int]:
        """Token ids of ``text``.

        add_bos: start with the BOS token (not doubled when the text already starts with it).
        encode_special_tokens: read special-token strings in the text (``"<|im_end|>"``) as those
            tokens; when False they are plain text, which is what untrusted input needs.
        """
        backend = self._parsing if encode_special_tokens else self._splitting
        ids: list[int] = backend.encode(text, add_special_tokens=False).ids
        return self._with_bos(ids) if add_bos else ids

    def encode_batch(
        self, texts: Sequence[str], add_bos: bool = False, encode_special_tokens: bool = False
    ) -> list[list[int]]:
        """`encode` over many texts at once (in parallel in the Rust backend)."""
        backend = self._parsing if encode_special_tokens else self._splitting
        encodings = backend.encode_batch(list(texts), add_special_tokens=False)
        return [self._with_bos(e.ids) if add_bos else list(e.ids) for e in encodings]

    def decode(self, ids: Iterable[int], decode_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens are dropped unless ``decode_special_tokens``."""
        return str(
            self._parsing.decode(list(ids), skip_special_tokens=not decode_special_tokens)
        )

    def token_pieces(self) -> TokenPieces | None:
        """The detokenizer's table of every token's text (`TokenPieces`), built on the first
        call (two decodes per id) and shared by every generator over this tokenizer; None when
        the decoder is not token-local. Two threads asking at once may each build one: both
        are right, one is kept."""
        if not self._pieces_built:
            self._pieces = TokenPieces.build(self)
            self._pieces_built = True
        return self._pieces

    def id_to_piece(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` as stored (e.g. ``"Ġthe"``, ``"<0xE2>"``)."""
        return self._parsing.id_to_token(token_id)

    def piece_to_id(self, piece: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        return self._parsing.token_to_id(piece)

    @property
    def template_limits(self) -> TemplateLimits:
        """The time and size limits of a chat-template render (see `TemplateLimits`)."""
        return self._template_limits

    @template_limits.setter
    def template_limits(self, limits: TemplateLimits) -> None:
        self._template_limits = limits
        self._compiled = {}  # compiled templates carry their limits

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    @property
    def chat_template(self) -> str | None:
        """The default chat template text, or None."""
        return self._templates.get("default") or next(iter(self._templates.values()), None)

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template, as transformers'
        ``apply_chat_template(..., tokenize=False)`` does. Encode the result with
        ``encode(text, encode_special_tokens=True)``.

        tools: JSON schemas of tools (``{"type": "function", "function": {...}}``).
        documents: ``{"title": ..., "text": ...}`` dicts for templates that take them.
        chat_template: a template text, or the name of one of the model's templates.
        continue_final_message: end inside the last message so the model continues it.
        kwargs: extra template variables; they override the special tokens of the same name.
        """
        template = self._template_for(chat_template, tools)
        return template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            continue_final_message=continue_final_message,
            **kwargs,
        )

    def _template_for(self, name_or_source: str | None, tools: Any) -> ChatTemplate:
        if name_or_source is None:
            if not self._templates:
                raise TokenizerError(
                    "this model has no chat template; pass a prompt string instead of messages, or "
                    "pass chat_template=... (a jinja2 template) to apply_chat_template"
                )
            key = "tool_use" if tools is not None and "tool_use" in self._templates else "default"
            if key not in self._templates:
                raise TokenizerError(
                    f"this model has several chat templates {sorted(self._templates)} and no "
                    "'default'; pass chat_template=NAME"
                )
            source = self._templates[key]
        else:
            source = self._templates.get(name_or_source, name_or_source)
        compiled = self._compiled
        if source not in compiled:
            compiled[source] = ChatTemplate(source, self.special_tokens, self._template_limits)
        return compiled[source]

    def _id_of(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return None if text is None else self._parsing.token_to_id(text)

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.bos_token_id is None:
            raise TokenizerError(
                "this model's tokenizer has no BOS token; encode with add_bos=False"
            )
        return ids if ids[:1] == [self.bos_token_id] else [self.bos_token_id, *ids]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, RecursionError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{str(path)!r} is not readable JSON ({exc}); re-download it"
                             ) from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{str(path)!r} must hold a JSON object")
    return data


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{str(path)!r} is not readable UTF-8 text ({exc}); re-download "
                             "it") from exc


def _flag(config: dict[str, Any], key: str, path: Path) -> bool:
    value = config.get(key, False)
    if not isinstance(value, bool):
        raise TokenizerError(f"{str(path)!r} has {key}={value!r}, but it must be true or false; "
                             f"fix {key} there")
    return value


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _special_ids(configs: Sequence[dict[str, Any]], key: str) -> list[int]:
    ids: list[int] = []
    for config in configs:
        value = config.get(key)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return ids


def _named_templates(template: str | Mapping[str, str] | None) -> dict[str, str]:
    if template is None:
        return {}
    if isinstance(template, str):
        return {"default": template}
    return dict(template)


def _folder_template(folder: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """The chat template(s) as transformers finds them: ``chat_template.jinja`` and
    ``chat_templates/*.jinja`` first, then ``chat_template`` in tokenizer_config.json."""
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for entry in raw:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise TokenizerError(
                    "tokenizer_config.json's chat_template list holds "
                    f"{str(entry)[:60]!r}; each entry must be "
                    '{"name": "...", "template": "..."}: fix or remove it')
            templates[entry["name"]] = entry["template"]
    elif raw is not None:
        raise TokenizerError("tokenizer_config.json's chat_template must be a string or a list "
                             f"of named templates, not {type(raw).__name__}: fix or remove it")
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = _read_text(jinja_file)
    named_dir = folder / "chat_templates"
    if named_dir.is_dir():
        for path in sorted(named_dir.glob("*.jinja")):
            templates[path.stem] = _read_text(path)
    if not templates:
        return None
    return templates["default"] if list(templates) == ["default"] else templates
