"""Text on the server: chat templates in, detokenised streams with stop strings out.

Chat prompts use the checkpoint's chat template (tokenizer_config.json's `chat_template`,
or a chat_template.jinja file), rendered with jinja2 in a sandbox as transformers does.
A checkpoint without one (the built-in model) gets FALLBACK_TEMPLATE: one
`role: content` line per message, then `assistant:`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from shardwise.engine.text import StreamDecoder

__all__ = ["ChatTemplate", "TextStream", "FALLBACK_TEMPLATE"]

FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _token_text(value) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config.json files
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    own: bool
    """True: the checkpoint's template (it adds its own special tokens); False: the fallback."""
    bos_token: str = ""
    eos_token: str = ""

    @staticmethod
    def load(model_dir: str | Path) -> ChatTemplate:
        from shardwise.gguf import gguf_tokenizer_config, is_gguf

        model_dir = Path(model_dir)
        cfg_file = model_dir / "tokenizer_config.json"
        if is_gguf(model_dir):  # tokenizer.chat_template and the bos/eos tokens in its metadata
            cfg = gguf_tokenizer_config(model_dir)
        else:
            cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        source = cfg.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        jinja_file = model_dir / "chat_template.jinja"
        if not source and jinja_file.exists():
            source = jinja_file.read_text()
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        if not source:
            return ChatTemplate(FALLBACK_TEMPLATE, own=False, bos_token=bos, eos_token=eos)
        return ChatTemplate(source, own=True, bos_token=bos, eos_token=eos)

    def render(self, messages: list[dict]) -> str:
        """The prompt text; raises ValueError when the template refuses the messages."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.source).render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token
            )
        except (jinja2.TemplateError, TypeError, AttributeError, KeyError, IndexError) as e:
            raise ValueError(f"the chat template failed: {e}") from None


class TextStream:
    """Token ids -> text pieces, holding back incomplete UTF-8 and possible starts of a stop string."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.decoder = StreamDecoder(tokenizer)
        self.text = ""  # the text so far (cut at a stop string once one is found)
        self.sent = 0  # characters of self.text already returned
        self.stopped = False
        self.tokens = 0  # tokens consumed (the usage count)

    def push(self, token: int) -> str:
        """Add a token; returns the text that is now safe to show."""
        if self.stopped:
            return ""
        self.tokens += 1
        self.text += self.decoder.push(token)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text, once no token will follow (incomplete UTF-8 included)."""
        if not self.stopped:
            self.text = self.tokenizer.decode(self.decoder.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if not self.stopped and self.stop:
            hits = [i for s in self.stop if (i := self.text.find(s, max(0, self.sent - len(s)))) >= 0]
            if hits:
                self.text, self.stopped = self.text[: min(hits)], True
        end = len(self.text)
        if not (final or self.stopped):  # hold back a suffix that could begin a stop string
            end -= max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        end = max(end, self.sent)
        piece, self.sent = self.text[self.sent : end], end
        return piece
