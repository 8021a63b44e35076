"""Chat templates rendered the Hugging Face way, and the character spans of the assistant turns.

Where the template comes from, first match wins:

1. ``training.chat_template``: a ``.jinja`` file, or a ``tokenizer_config.json`` holding one;
2. the tokenizer's own ``chat_template`` attribute (a tokenizer that loads Hugging Face
   files can set it; this is the only hook this module asks of a tokenizer);
3. beside ``model.tokenizer_path`` (or inside it, for a folder): ``chat_template.jinja``
   (where transformers >= 4.50 saves it), else ``tokenizer_config.json``'s ``chat_template``;
4. otherwise ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``), what TRL's
   ``setup_chat_format`` installs on models that have no template. With the byte tokenizer
   its markers are plain bytes.

Rendering goes through ``transformers``' own ``render_jinja_template`` when transformers is
installed (so the text is exactly ``apply_chat_template``'s), else through a jinja2
sandbox set up like transformers'. Special-token strings the template emits (``<|im_end|>``,
``<|eot_id|>``) become their ids only if the tokenizer's ``encode`` maps them, as a
Hugging Face ``tokenizer.json`` does.

Assistant turns: a template with ``{% generation %}`` marks them itself; for any other
template, assistant turn ``i`` is the text that rendering ``messages[:i+1]`` adds to
rendering ``messages[:i]`` with the generation prompt (so the turn's header is prompt and its
end-of-turn marker is completion, as in TRL's ``assistant_only_loss``). A template that does
not render conversations prefix by prefix (one that drops earlier turns' reasoning, say)
is refused with a message rather than masked wrongly.
"""

from __future__ import annotations

import json
import os
import re

from titan_ulysses.data.sources import DataError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _token_string(value):
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, origin: str = ""):
        self.source, self.origin = source, origin
        self.special_tokens = special_tokens or {}
        self.has_generation_tags = bool(re.search(r"\{%-?\s*generation\s*-?%\}", source))
        self._compiled = None
        self._jinja()  # a template that does not parse is refused here, naming its file and line, not per row

    def render(self, messages: list[dict], add_generation_prompt: bool = False, where="") -> str:
        try:
            from transformers.utils.chat_template_utils import render_jinja_template
        except ImportError:
            render_jinja_template = None
        try:
            if render_jinja_template is not None:
                rendered, _ = render_jinja_template(
                    conversations=[messages], chat_template=self.source,
                    add_generation_prompt=add_generation_prompt, **self.special_tokens,
                )
                return rendered[0]
            return self._jinja().render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except Exception as e:  # jinja2's TemplateError, or a TypeError inside the template
            raise self._refusal(e, where) from e

    def generation_spans(self, messages: list[dict], where="") -> tuple[str, list[tuple[int, int]]]:
        """Text and ``{% generation %}`` spans (templates that mark assistant output)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, indices = render_jinja_template(
                conversations=[messages], chat_template=self.source, return_assistant_tokens_mask=True,
                **self.special_tokens,
            )
        except Exception as e:
            raise self._refusal(e, where) from e
        return rendered[0], list(indices[0])

    def _refusal(self, error: Exception, where) -> DataError:
        """A template that raises on a row: one line naming the template, the row and its message."""
        return DataError(f"{where or 'a row'}: chat template ({self.origin}) failed on this row: "
                         f"{type(error).__name__}: {error}; fix the row or the template (training.chat_template)")

    def _jinja(self):
        if self._compiled is None:
            import jinja2
            import jinja2.ext  # not imported by ``import jinja2``
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols, _generation_tag()])
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            try:
                self._compiled = env.from_string(self.source)
            except jinja2.exceptions.TemplateSyntaxError as e:
                where = f"{self.origin}'s chat_template" if self.origin.endswith(".json") else self.origin
                raise DataError(f"{where or 'the chat template'} line {e.lineno}: the template does not parse "
                                f"(TemplateSyntaxError: {e.message}); fix the template, or name another with "
                                f"training.chat_template") from e
        return self._compiled


def _generation_tag():
    """``{% generation %}...{% endgeneration %}`` (transformers' marker of assistant output) as a plain
    block, so that templates using it parse here; transformers renders them itself."""
    import jinja2.nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    return Generation


def _read_config(path: str) -> dict:
    """A tokenizer_config.json; one that is not a JSON object is refused naming it (and the line)."""
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); copy it again from the model's folder") from e
    if not isinstance(cfg, dict):
        raise DataError(f"{path} holds a JSON {type(cfg).__name__}, not an object; copy it again from the model's folder")
    return cfg


def _special_tokens(path: str) -> dict[str, str]:
    """bos_token, eos_token, ... of a tokenizer_config.json: the variables templates use."""
    cfg = _read_config(path)
    special = {k: _token_string(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return {k: v for k, v in special.items() if v is not None}


def _from_tokenizer_config(path: str) -> ChatTemplate | None:
    template = _read_config(path).get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not template:
        return None
    return ChatTemplate(template, _special_tokens(path), origin=path)


def load_chat_template(setting: str, tokenizer, tokenizer_path: str | None = None) -> ChatTemplate:
    """The chat template to render ``messages`` rows with (see the module docstring for the order).

    ``tokenizer_path`` defaults to the folder the tokenizer was read from. A template whose
    file brings no special tokens gets the tokenizer's (``bos_token``, ``eos_token``), as
    transformers passes them.
    """
    template = _find_template(setting, tokenizer,
                              getattr(tokenizer, "folder", "") if tokenizer_path is None else tokenizer_path)
    own = getattr(tokenizer, "special_tokens", None) or {}
    template.special_tokens = {**own, **template.special_tokens}
    return template


def _find_template(setting: str, tokenizer, tokenizer_path: str) -> ChatTemplate:
    if setting:
        if not os.path.isfile(setting):
            raise DataError(f"training.chat_template {setting!r} is not a file (a .jinja template or tokenizer_config.json)")
        if setting.endswith(".json"):
            found = _from_tokenizer_config(setting)
            if found is None:
                raise DataError(f"training.chat_template {setting!r} has no 'chat_template' entry")
            return found
        with open(setting) as f:
            return ChatTemplate(f.read(), origin=setting)
    own = getattr(tokenizer, "chat_template", None)
    if own:
        return ChatTemplate(own, getattr(tokenizer, "special_tokens", None), origin="the tokenizer")
    if tokenizer_path:
        folder = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(os.path.abspath(tokenizer_path))
        cfg = os.path.join(folder, "tokenizer_config.json")
        found = _from_tokenizer_config(cfg) if os.path.isfile(cfg) else None
        jinja = os.path.join(folder, "chat_template.jinja")  # where transformers >= 4.50 saves it
        if os.path.isfile(jinja):
            with open(jinja) as f:
                specials = found.special_tokens if found else _special_tokens(cfg) if os.path.isfile(cfg) else {}
                return ChatTemplate(f.read(), specials, origin=jinja)
        if found is not None:
            return found
    return ChatTemplate(CHATML_TEMPLATE, origin="ChatML fallback")


def assistant_spans(template: ChatTemplate, messages: list[dict], first: int = 0,
                    where="") -> tuple[str, list[tuple[int, int]]]:
    """Rendered text and the character spans of assistant turns with index >= ``first``."""
    if template.has_generation_tags and first == 0:
        return template.generation_spans(messages, where)
    text = template.render(messages, where=where)
    spans = []
    for i, message in enumerate(messages):
        if i < first or message.get("role") != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True, where=where) if i else ""
        upto = template.render(messages[: i + 1], where=where)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise DataError(
                f"{where}: chat template ({template.origin}) does not render this conversation prefix by prefix, "
                f"so its assistant turns cannot be located; use a template with {{% generation %}} tags "
                f"(training.chat_template)"
            )
        spans.append((len(before), len(upto)))
    return text, spans
