"""The checkpoint's tokenizer: `tokenizers` for the ids, jinja2 for the chat template.

The chat template is rendered with the same environment transformers uses in `apply_chat_template`
(sandboxed, trim_blocks + lstrip_blocks, loopcontrols, `raise_exception`, `strftime_now`, a
`tojson` that does not HTML-escape, a no-op `{% generation %}` tag) and the same variables
(`messages`, `tools`, `documents`, `add_generation_prompt`, the named special tokens, and any extra
keyword such as `enable_thinking`), so any template a checkpoint ships renders as it would in
transformers.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

# The special-token attributes transformers passes to the template (its SPECIAL_TOKENS_ATTRIBUTES).
TEMPLATE_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class _GenerationTag(jinja2.ext.Extension):
    """The `{% generation %}...{% endgeneration %}` tag, rendered as its body alone.

    It marks assistant spans for training masks; rendering ignores it.
    """

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_content(value) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: tuple[int, ...] | None = None,
        bos_token_id: int | None = None,
    ):
        self._tok = tokenizer
        self.chat_template = chat_template
        # Named special tokens as strings, e.g. {"bos_token": "<bos>", ...}: template variables.
        self.special_tokens = dict(special_tokens or {})
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id = (
            bos_token_id if bos_token_id is not None else (self.token_to_id(bos) if bos else None)
        )
        if eos_token_ids is None:
            eos = self.special_tokens.get("eos_token")
            eos_token_ids = (
                (self.token_to_id(eos),) if eos and self.token_to_id(eos) is not None else ()
            )
        self.eos_token_ids = tuple(eos_token_ids)
        self.all_special_ids = sorted(
            i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        tok = HFTokenizer.from_file(str(tok_file))

        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        special = {}
        for name in TEMPLATE_TOKEN_NAMES:
            content = _token_content(cfg.get(name))
            if content is not None:
                special[name] = content

        # The template file wins over the (older) tokenizer_config.json field, as in transformers.
        template = None
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        elif isinstance(cfg.get("chat_template"), str):
            template = cfg["chat_template"]
        elif isinstance(
            cfg.get("chat_template"), list
        ):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in cfg["chat_template"]}
            template = named.get("default")

        eos_ids = bos_id = None
        gen_file = path / "generation_config.json"
        if gen_file.exists():
            gen = json.loads(gen_file.read_text())
            eos = gen.get("eos_token_id")
            if eos is not None:
                eos_ids = tuple([eos] if isinstance(eos, int) else eos)
            bos_id = gen.get("bos_token_id")
        return cls(
            tok,
            chat_template=template,
            special_tokens=special,
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
        )

    # ---- ids <-> text ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers.Tokenizer` (the streaming detokenizer drives it directly)."""
        return self._tok

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # Special-token strings inside `text` (e.g. "<|turn>" from the chat template) always map to
        # their ids; add_special_tokens only controls the post-processor (BOS/EOS insertion, none
        # for Gemma 4). encode_batch, unlike encode, releases the GIL: a long prompt does not stall
        # the event loop and the engine's thread while it is tokenized.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat template ---------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **template_kwargs,
    ) -> str:
        """The rendered prompt. `continue_final_message` cuts it right after the last message's
        text (as transformers does), so that the model continues that message."""
        source = chat_template or self.chat_template
        if source is None:
            raise ValueError(
                "this checkpoint has no chat template "
                "(chat_template.jinja or tokenizer_config.json)"
            )
        # Explicit keywords override the special tokens.
        variables = {**self.special_tokens, **template_kwargs}
        rendered = compile_chat_template(source).render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, messages[-1].get("content") or "")
        return rendered


def _cut_after_final_message(rendered: str, final: str) -> str:
    """transformers' rule: end the prompt where the final message's text ends (its trailing
    whitespace kept only where the template kept it)."""
    if final.strip() not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the prompt "
            "the chat template wrote"
        )
    start = rendered.rindex(final.strip())
    if rendered[start : start + len(final.lstrip())] == final.lstrip():
        return rendered[: start + len(final.lstrip())]
    return rendered[: start + len(final.strip())]
