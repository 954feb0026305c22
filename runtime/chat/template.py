"""The model's own chat template (Jinja, from the export) rendered the way Hugging Face renders it.

Sandboxed (ImmutableSandboxedEnvironment: a template can read what it is given, never change it
or reach Python internals), trim_blocks/lstrip_blocks, loopcontrols, `tojson`, `raise_exception`
and `strftime_now`, with the tokenizer's special tokens (bos_token, eos_token, ...) as variables.
A template is untrusted code: its compile and every render run within TemplateLimits
(template_sandbox.py); one past a bound is refused in one line naming the bound.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from hybrid_npu.chat_files import chat_template, read_json
from hybrid_npu.errors import UserError
from hybrid_npu.manifest import Manifest, load_manifest

from .template_sandbox import BoundedEnvironment, StopRequested, TemplateLimit, TemplateLimits

MAX_SOURCE_CHARS = 1_000_000  # Qwen3.5's template is 7 KB; the parser recurses on nesting
MAX_JSON_INDENT = 32
MAX_STRFTIME_CHARS = 256
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _template_error(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    if isinstance(indent, str) and len(indent) > MAX_JSON_INDENT or isinstance(indent, int) and indent > MAX_JSON_INDENT:
        raise TemplateLimit(f"tojson indent over the bound of {MAX_JSON_INDENT}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > MAX_STRFTIME_CHARS:  # '%c' expands 12-fold
        raise TemplateLimit(f"a strftime_now format over {MAX_STRFTIME_CHARS} characters")
    return datetime.now().strftime(fmt)


def _one_line(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "…"


def _token_text(value):
    return value.get("content") if isinstance(value, dict) else value


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, origin: str = "chat template",
                 limits: TemplateLimits | None = None):
        import jinja2.ext

        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.origin = origin
        self.limits = limits or TemplateLimits()
        if len(source) > MAX_SOURCE_CHARS:
            raise UserError(f"{origin} is {len(source):,} characters, over the bound of {MAX_SOURCE_CHARS:,}; "
                            "re-export the model with a valid chat_template")
        env = BoundedEnvironment(self.limits, trim_blocks=True, lstrip_blocks=True,
                                 extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.bound_filters()
        env.globals["raise_exception"] = _template_error
        env.globals["strftime_now"] = _strftime_now
        self._env = env
        try:  # Jinja folds constant expressions while compiling: the compile runs under the bounds too
            self._template = env.run(lambda: env.from_string(source))
        except TemplateLimit as e:
            raise UserError(f"{origin} went past a bound while compiling: {e}; "
                            "use a trusted model's chat_template") from None
        except jinja2.TemplateError as e:
            raise UserError(f"{origin} does not compile ({_one_line(e)}); "
                            "re-export the model with a valid chat_template") from None
        except Exception as e:  # noqa: BLE001 - untrusted code: every failure is one line
            raise UserError(f"{origin} does not compile ({type(e).__name__}: {_one_line(e)}); "
                            "re-export the model with a valid chat_template") from None

    @property
    def has_thinking_switch(self) -> bool:
        """The template reads `enable_thinking` (Qwen3-style reasoning on/off)."""
        return "enable_thinking" in self.source

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, tools: list[dict] | None = None,
               should_stop=None) -> str:
        """As transformers' apply_chat_template(messages, tools=tools, ...): tools are OpenAI-style
        function specs, passed to the template as they are. should_stop (Ctrl-C) ends the render
        with a UserError; the caller's conversation is untouched."""
        import jinja2

        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        limit = self.limits.output_chars

        def produce() -> str:
            parts, n = [], 0
            budget = self._env.budget()
            for piece in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 tools=tools or None, documents=None, **self.special_tokens, **extra):
                n += len(piece)
                if n > limit:
                    raise TemplateLimit(f"output over the bound of {limit:,} characters")
                budget.tick()
                parts.append(piece)
            return "".join(parts)

        try:
            return self._env.run(produce, should_stop)
        except StopRequested:
            raise UserError("stopped while rendering the chat template (Ctrl-C); the conversation is kept") from None
        except TemplateLimit as e:
            raise UserError(f"{self.origin} went past a bound: {e}; use a trusted model's chat_template") from None
        except jinja2.TemplateError as e:
            raise UserError(f"{self.origin} refused the conversation: {_one_line(e)}") from None
        except Exception as e:  # noqa: BLE001 - untrusted code: every failure is one line
            raise UserError(f"{self.origin} failed on this conversation ({type(e).__name__}: {_one_line(e)}); "
                            "use a trusted model's chat_template") from None

    @classmethod
    def from_export(cls, path, manifest: Manifest | None = None) -> "ChatTemplate":
        """model.json's copy first (what the exporter chose, by transformers 5's precedence), else
        the export's own files by that precedence (exports made before the manifest recorded it).
        manifest: the export's, where the caller has loaded it."""
        path = Path(path)
        tok_cfg = read_json(path / "tokenizer_config.json", "tokenizer_config.json") or {}
        manifest = manifest or load_manifest(path)
        source = manifest.tokenizer.chat_template if manifest.tokenizer is not None else None
        source = source if source is not None else chat_template(path)[0]
        if not source:
            raise UserError(f"{path} has no chat template (no chat_template.jinja, and tokenizer_config.json has no "
                            "chat_template); re-export from a checkpoint whose tokenizer has one")
        special = {k: _token_text(tok_cfg[k]) for k in SPECIAL_TOKEN_KEYS if _token_text(tok_cfg.get(k))}
        return cls(source, special, origin=f"the chat template of {path}")
