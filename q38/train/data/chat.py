"""Chat records formatted as the checkpoint formats them: its own Jinja chat template, exact assistant-only masks.

A ``{"messages": [...], "tools": [...]}`` record is rendered with the tokenizer directory's chat template exactly
as transformers' ``apply_chat_template`` renders it, so the ids equal transformers' ids; the targets follow
``train_on`` (``assistant``: the template's ``{% generation %}`` blocks, else the prefix method; ``last_assistant``;
``all``). Without a template, plain ChatML (``encode_chat``), which refuses tools, tool calls and reasoning. How the
rendering matches transformers and how the masks are found: docs/data.md#chat-templates-and-targets.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import threading
import time
import weakref
from datetime import datetime
from typing import Any, Mapping, Sequence

import attrs

from q38.batch import IGNORE_INDEX
from q38.errors import DataError
from q38.train.data.options import TRAIN_ON
from q38.train.data.tokenizer import IM_END, IM_START, HFTokenizer, Tokenizer, read_json_object

ROLES = ("system", "user", "assistant", "tool")
# Keys a message may carry (transformers reads reasoning under any of the last three names).
MESSAGE_KEYS = ("role", "content", "tool_calls", "name", "tool_call_id", "reasoning_content", "thinking",
                "reasoning")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# Template variables transformers fills from the tokenizer's special tokens.
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_RECORD_HINT = ('expected {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str, ...}, ...], '
                '"tools": [...] (optional)}')


# ----------------------------------------------------------------------------------------------------------------
# Record validation


def _fail(where: str, msg: str) -> None:
    raise DataError(f"{where}: {msg}")


def _check_tool_call(call: Any, where: str, j: int, k: int) -> None:
    at = f"messages[{j}].tool_calls[{k}]"
    if not isinstance(call, dict):
        _fail(where, f"{at} must be an object like {{\"type\": \"function\", \"function\": {{\"name\": str, "
                     f"\"arguments\": {{...}}}}}}, got {type(call).__name__}")
    fn = call.get("function", call)  # the OpenAI form nests under "function"; the flat form is also accepted
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        _fail(where, f"{at} needs a function name: {{\"type\": \"function\", \"function\": {{\"name\": str, "
                     f"\"arguments\": {{...}}}}}}")
    args = fn.get("arguments")
    if args is not None and not isinstance(args, (dict, str)):
        _fail(where, f"{at}.arguments must be an object (or a JSON string), got {type(args).__name__}")


def validate_chat_record(record: Mapping[str, Any], where: str) -> None:
    """Raise ``DataError`` (prefixed with ``where``, e.g. ``file:line``) unless ``record`` is a chat record as
    transformers/TRL users write it: ``messages`` (system/user/assistant/tool; assistant turns may carry
    ``tool_calls`` and ``reasoning_content``), optional ``tools`` (JSON-schema objects) and optional
    ``chat_template_kwargs`` (extra template variables, as TRL's column of that name, e.g. ``enable_thinking``)."""
    msgs = record["messages"]
    if not isinstance(msgs, list) or not msgs:
        _fail(where, f"\"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects; {_RECORD_HINT}")
    tools = record.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            _fail(where, "\"tools\" must be a list of JSON-schema objects like {\"type\": \"function\", "
                         "\"function\": {\"name\": str, \"description\": str, \"parameters\": {...}}}")
    kwargs = record.get("chat_template_kwargs")
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        _fail(where, "\"chat_template_kwargs\" must be an object of template variables, e.g. "
                     "{\"enable_thinking\": false}")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m:
            _fail(where, f"messages[{j}] must be an object with a \"role\" key; {_RECORD_HINT}")
        role = m["role"]
        if role not in ROLES:
            _fail(where, f"messages[{j}].role is {role!r}; expected one of {', '.join(ROLES)}")
        unknown = [k for k in m if k not in MESSAGE_KEYS]
        if unknown:
            _fail(where, f"messages[{j}] has unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                         f"{', '.join(MESSAGE_KEYS)}")
        content = m.get("content")
        calls = m.get("tool_calls")
        if content is None:
            if not (role == "assistant" and calls):
                _fail(where, f"messages[{j}] ({role}) needs a string \"content\" (only an assistant message with "
                             f"\"tool_calls\" may omit it)")
        elif not isinstance(content, str):
            _fail(where, f"messages[{j}].content must be a string, got {type(content).__name__}")
        for key in _REASONING_KEYS:
            if m.get(key) is not None:
                if role != "assistant":
                    _fail(where, f"messages[{j}].{key} is only allowed on assistant messages (this one is {role})")
                if not isinstance(m[key], str):
                    _fail(where, f"messages[{j}].{key} must be a string, got {type(m[key]).__name__}")
        if calls is not None:
            if role != "assistant":
                _fail(where, f"messages[{j}].tool_calls is only allowed on assistant messages (this one is {role})")
            if not isinstance(calls, list):
                _fail(where, f"messages[{j}].tool_calls must be a list, got {type(calls).__name__}")
            for k, call in enumerate(calls):
                _check_tool_call(call, where, j, k)
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                _fail(where, f"messages[{j}].{key} must be a string, got {type(m[key]).__name__}")


# ----------------------------------------------------------------------------------------------------------------
# The template environment (the same one transformers renders with)


class _Tracker:
    """Per-render state of the ``{% generation %}`` tag: the chunks emitted so far and the character spans."""

    def __init__(self) -> None:
        self.chunks: list[str] | None = None
        self.spans: list[tuple[int, int]] = []


def _make_environment() -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox
    import jinja2.utils

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body unchanged and records its character span in
        the output (the output length so far is the span's start: rendering is streamed chunk by chunk)."""

        tags = {"generation"}

        def __init__(self, environment: Any) -> None:
            super().__init__(environment)
            environment.extend(q38_tracker=_Tracker())

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_record"), [], [], body).set_lineno(lineno)

        def _record(self, caller: Any) -> str:
            text = caller()
            tracker = self.environment.q38_tracker
            if tracker.chunks is not None:
                start = sum(len(c) for c in tracker.chunks)
                tracker.spans.append((start, start + len(text)))
            return text

    def raise_exception(message: Any) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson HTML-escapes; chat templates expect plain json.dumps.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class SafeDict:
        """``dict(...)`` for templates without exposing the type itself."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class SafeNamespace(jinja2.utils.Namespace):
        """``namespace(...)`` that refuses underscore-prefixed attributes (no route to Python internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            values = dict(*rest, **kwargs)
            for name in values:
                SafeNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, values)

        def __setitem__(self, name: Any, value: Any) -> None:
            SafeNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set the namespace attribute {name!r}")

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.intercepted_binops = frozenset({"*", "**"})  # bounded (_bounded_binop); read when a template compiles
    env.call_binop = _bounded_binop
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=SafeDict(),
                       namespace=SafeNamespace)
    return env


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ----------------------------------------------------------------------------------------------------------------
# The budget of one rendering: a chat template is code from the tokenizer directory, so a rendering is bounded in
# time and in size (docs/data.md).

RENDER_SECONDS = 10.0  # wall-clock seconds one rendering may take
RENDER_CHARS = 16 << 20  # characters one rendering may produce (and any string or list one `*` may build)
POWER_BITS = 4096  # the largest result (in bits) an integer `**` may have


class _RenderTimeout(BaseException):
    """Raised into a rendering thread past its deadline (a BaseException: the template's own handlers and jinja's
    ``except Exception`` do not catch it)."""


class _Deadlines:
    """One watcher thread per process. ``arm(s)`` starts a deadline for the calling thread; past it the watcher
    raises ``_RenderTimeout`` in that thread (``PyThreadState_SetAsyncExc``: delivered at the next bytecode, so
    any Python-level loop of a compiled template stops, whichever thread renders); ``disarm`` ends it and clears an
    exception raised but not yet delivered. What it cannot stop is one long call into C; the size limits bound
    those that allocate (``*`` / ``**`` on big operands)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.job: list | None = None  # [thread ident, deadline, fired]
        self.thread: threading.Thread | None = None

    def arm(self, seconds: float) -> list:
        job = [threading.get_ident(), time.monotonic() + seconds, False]
        with self.cond:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._watch, name="q38-template-deadline", daemon=True)
                self.thread.start()
            self.job = job
            self.cond.notify()
        return job

    def disarm(self, job: list) -> None:
        with self.cond:
            if self.job is job:
                self.job = None
            if job[2]:  # fired: make sure it is not delivered after this point
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(job[0]), None)

    def _watch(self) -> None:
        with self.cond:
            while True:
                job = self.job
                if job is None:
                    self.cond.wait()
                    continue
                left = job[1] - time.monotonic()
                if left > 0:
                    self.cond.wait(left)
                    continue
                job[2], self.job = True, None
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(job[0]), ctypes.py_object(_RenderTimeout))


_DEADLINES = _Deadlines()


def _fresh_deadlines() -> None:  # a forked worker (prepare-data) starts its own watcher
    global _DEADLINES
    _DEADLINES = _Deadlines()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_deadlines)


def _bounded_binop(context: Any, operator: str, left: Any, right: Any) -> Any:
    """``*`` and ``**`` of a template, refused when the result would be huge (one C call the deadline cannot
    stop)."""
    import jinja2.exceptions
    import jinja2.sandbox

    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > RENDER_CHARS:
                raise jinja2.exceptions.SecurityError(f"a repetition of {len(seq):,} x {n:,} is over the "
                                                      f"{RENDER_CHARS:,} limit")
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
            right * max(abs(left).bit_length(), 1) > POWER_BITS:
        raise jinja2.exceptions.SecurityError(f"{left} ** {right} is over the {POWER_BITS}-bit limit")
    return jinja2.sandbox.SandboxedEnvironment.call_binop(context.environment, context, operator, left, right)


@attrs.define
class ChatFormat:
    """A tokenizer's chat templates (by name; a single template is ``"default"``), compiled lazily."""

    tokenizer: HFTokenizer
    source: str  # where the templates came from, for error messages
    templates: dict[str, str]
    special_tokens: dict[str, str]
    _compiled: dict[str, Any] = attrs.field(factory=dict)
    _env: Any = None

    def select(self, tools: Sequence[Any] | None) -> str:
        """The template name transformers would use: ``tool_use`` when tools are given and it exists, else
        ``default``."""
        if tools is not None and "tool_use" in self.templates:
            return "tool_use"
        if "default" in self.templates:
            return "default"
        raise DataError(f"{self.source} has several chat templates ({', '.join(sorted(self.templates))}) and none "
                        f"named \"default\"; name one of them default")

    def compiled(self, name: str) -> Any:
        if name not in self._compiled:
            import jinja2

            if self._env is None:
                self._env = _make_environment()
            try:
                self._compiled[name] = self._env.from_string(self.templates[name])
            except jinja2.TemplateSyntaxError as e:
                raise DataError(f"chat template {name!r} of {self.source} does not parse (template line "
                                f"{e.lineno}): {_one_line(e)}") from None
        return self._compiled[name]

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None, *,
               add_generation_prompt: bool, template_kwargs: Mapping[str, Any] | None = None
               ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of its ``{% generation %}`` blocks (as transformers'
        ``render_jinja_template``: ``None``-valued message keys dropped, reasoning aliased to ``reasoning_content``
        and ``thinking``, the special tokens and ``template_kwargs`` passed as variables)."""
        name = self.select(tools)
        template = self.compiled(name)
        tracker = self._env.q38_tracker
        chunks: list[str] = []
        tracker.chunks, tracker.spans = chunks, []
        variables = {**self.special_tokens, **(template_kwargs or {})}
        size = 0
        try:
            job = _DEADLINES.arm(RENDER_SECONDS)
            try:
                for chunk in template.generate(messages=_template_messages(messages),
                                               tools=None if tools is None else [dict(t) for t in tools],
                                               documents=None, add_generation_prompt=add_generation_prompt,
                                               **variables):
                    size += len(chunk)
                    if size > RENDER_CHARS:
                        raise DataError(f"the chat template {name!r} of {self.source} rendered more than "
                                        f"{RENDER_CHARS:,} characters for one record (the limit); fix the template")
                    chunks.append(chunk)
            finally:
                _DEADLINES.disarm(job)
        except _RenderTimeout:
            raise DataError(f"the chat template {name!r} of {self.source} ran longer than {RENDER_SECONDS:g} s for "
                            "one record (the limit on one rendering); fix the template") from None
        except DataError:
            raise
        except Exception as e:  # jinja2.TemplateError (incl. raise_exception), or a Python error inside the template
            raise DataError(f"the chat template of {self.source} raised: {_one_line(e)}") from None
        finally:
            tracker.chunks = None
        return "".join(chunks), list(tracker.spans)

    def has_generation_blocks(self, tools: Sequence[Any] | None) -> bool:
        return re.search(r"\{%-?\s*generation\s*-?%\}", self.templates[self.select(tools)]) is not None


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def load_chat_format(tokenizer: HFTokenizer) -> ChatFormat | None:
    """The chat templates of a tokenizer directory, or ``None`` if it has none. Like transformers, template files
    (``chat_template.jinja`` and ``additional_chat_templates/*.jinja``) take precedence over ``chat_template`` in
    ``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}``)."""
    root = tokenizer.path if tokenizer.path.is_dir() else tokenizer.path.parent
    config = read_json_object(root / "tokenizer_config.json")
    templates: dict[str, str] = {}
    sources: list[str] = []
    if (root / "chat_template.jinja").is_file():
        templates["default"] = (root / "chat_template.jinja").read_text(encoding="utf-8")
        sources.append(str(root / "chat_template.jinja"))
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
            sources.append(str(f))
    if not templates:
        value = config.get("chat_template")
        where = f"{root / 'tokenizer_config.json'} chat_template"
        if isinstance(value, str):
            templates["default"] = value
        elif isinstance(value, list):
            for item in value:
                if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                        and isinstance(item.get("template"), str)):
                    raise DataError(f"{where}: each entry must be {{\"name\": str, \"template\": str}}")
                templates[item["name"]] = item["template"]
        elif value is not None:
            raise DataError(f"{where} must be a string or a list of {{\"name\", \"template\"}}, got "
                            f"{type(value).__name__}")
        sources.append(where)
    if not templates:
        return None
    legacy = read_json_object(root / "special_tokens_map.json")
    special: dict[str, str] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key, legacy.get(key))
        content = value if isinstance(value, str) else value.get("content") if isinstance(value, dict) else None
        if isinstance(content, str):
            special[key] = content
    return ChatFormat(tokenizer, source=" + ".join(sources), templates=templates, special_tokens=special)


_FORMATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chat_format(tokenizer: Tokenizer) -> ChatFormat | None:
    """The tokenizer's chat template (cached per tokenizer object); ``None`` means plain ChatML."""
    if not isinstance(tokenizer, HFTokenizer):
        return None
    if tokenizer not in _FORMATS:
        _FORMATS[tokenizer] = load_chat_format(tokenizer)
    return _FORMATS[tokenizer]


# ----------------------------------------------------------------------------------------------------------------
# Masks


def spans_to_token_mask(encoding: Any, spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Token mask of character spans, as transformers' ``return_assistant_tokens_mask``: the tokens from the one
    holding a span's first character to the one holding its last (to the end if that is unmapped); an unmapped
    first character stops the scan (transformers' truncation guard)."""
    n = len(encoding.ids)
    mask = [False] * n
    for start, end in spans:
        first = encoding.char_to_token(start)
        if first is None:
            break
        last = encoding.char_to_token(end - 1) if end > 0 else None
        for t in range(first, n if last is None else last + 1):
            mask[t] = True
    return mask


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _end_marker(text: str, added: Sequence[str]) -> str | None:
    """The added token whose occurrence in ``text`` ends last (ties: the longest) — a turn's end token."""
    best: tuple[int, int] | None = None
    found = None
    for tok in added:
        i = text.rfind(tok)
        if i >= 0 and (best is None or (i + len(tok), len(tok)) > best):
            best, found = (i + len(tok), len(tok)), tok
    return found


def _nth_end(text: str, marker: str, count: int) -> int | None:
    """Character position just after the ``count``-th occurrence of ``marker`` in ``text`` (0 for count 0)."""
    pos = 0
    for _ in range(count):
        i = text.find(marker, pos)
        if i < 0:
            return None
        pos = i + len(marker)
    return pos


def prefix_spans(fmt: ChatFormat, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None, full: str,
                 template_kwargs: Mapping[str, Any] | None = None) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in ``full`` (the rendering of all ``messages``) by rendering growing
    prefixes (see the module docstring). Raises ``DataError`` where a turn cannot be located exactly."""
    added = [t.content for t in fmt.tokenizer.added_tokens()]
    spans: list[tuple[int, int]] = []
    prev_end, prev_marker = 0, None

    def render(k: int, gen: bool) -> str:
        try:
            return fmt.render(messages[:k], tools, add_generation_prompt=gen, template_kwargs=template_kwargs)[0]
        except DataError as e:
            raise DataError(f"{e} (rendering messages[:{k}]{' with add_generation_prompt' if gen else ''} to locate "
                            f"the assistant turns for the loss mask; a template with {{% generation %}} blocks, or "
                            f"data.train_on: all, needs no such renders)") from None

    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise DataError("messages[0] is an assistant message: there is no prompt before it to tell its turn "
                            "from the template's framing; start the conversation with a system or user message, or "
                            "use data.train_on: all")
        prompt = render(i, True)
        turn = render(i + 1, False)
        tail = turn[_common_prefix_len(turn, prompt):]  # what the model generates for this turn, as the last turn
        marker = _end_marker(tail, added)
        # Align the prompt with `full` after the previous turn's end token (earlier turns may render differently
        # in the prompt, e.g. with their reasoning, but with as many end tokens).
        offset = 0 if prev_marker is None else _nth_end(prompt, prev_marker, full[:prev_end].count(prev_marker))
        if offset is None:
            raise DataError(f"cannot locate assistant message {i}: the chat template renders fewer "
                            f"{prev_marker!r} tokens before it in the prompt than in the full conversation")
        start = prev_end + _common_prefix_len(full[prev_end:], prompt[offset:])
        if marker is not None:
            k = full.find(marker, start)
            if k < 0:
                raise DataError(f"cannot locate assistant message {i}: no {marker!r} after its start in the "
                                f"rendered conversation")
            end = k + len(marker)
        elif full.startswith(tail, start) and tail:
            end = start + len(tail)
        else:
            raise DataError(
                f"cannot locate assistant message {i}: the chat template has no end token after an assistant turn "
                f"and renders the turn differently when later messages follow; add {{% generation %}} blocks to "
                f"the template, or use data.train_on: last_assistant or all")
        spans.append((start, end))
        prev_end, prev_marker = end, marker
    return spans


# ----------------------------------------------------------------------------------------------------------------
# Records -> (input_ids, labels)


def _check_train_on(train_on: str) -> None:
    if train_on not in TRAIN_ON:
        raise DataError(f"train_on is {train_on!r}; expected one of {', '.join(TRAIN_ON)}")


def encode_chat_record(record: Mapping[str, Any], tokenizer: Tokenizer, *, train_on: str = "assistant"
                       ) -> tuple[list[int], list[int]]:
    """A validated chat record -> ``(input_ids, labels)``: rendered by the tokenizer's chat template (ids equal to
    transformers' ``apply_chat_template``), or ChatML without one; labels per ``train_on``."""
    _check_train_on(train_on)
    messages, tools, kwargs = record["messages"], record.get("tools"), record.get("chat_template_kwargs")
    fmt = chat_format(tokenizer)
    if fmt is None:
        if kwargs:
            raise DataError(f"the record sets chat_template_kwargs, but tokenizer {tokenizer!r} has no chat template")
        return _encode_chatml(messages, tools, tokenizer, train_on)
    full, gen_spans = fmt.render(messages, tools, add_generation_prompt=False, template_kwargs=kwargs)
    encoding = fmt.tokenizer.encoding(full)
    ids = list(encoding.ids)
    if train_on == "all":
        return ids, list(ids)
    if fmt.has_generation_blocks(tools):
        spans = gen_spans
    else:
        spans = prefix_spans(fmt, messages, tools, full, kwargs)
    if train_on == "last_assistant":
        spans = spans[-1:]
    mask = spans_to_token_mask(encoding, spans)
    return ids, [t if keep else IGNORE_INDEX for t, keep in zip(ids, mask)]


def _encode_chatml(messages: Sequence[Mapping[str, Any]], tools: Any, tokenizer: Tokenizer, train_on: str
                   ) -> tuple[list[int], list[int]]:
    extras = sorted({k for m in messages for k in ("tool_calls", *_REASONING_KEYS) if m.get(k) is not None})
    if tools is not None or extras:
        what = ", ".join((["tools"] if tools is not None else []) + extras)
        raise DataError(f"the record uses {what}, but tokenizer {tokenizer!r} has no chat template (plain ChatML has "
                        f"no notation for them); set data.tokenizer to a tokenizer directory with a chat template "
                        f"(chat_template.jinja or chat_template in tokenizer_config.json)")
    ids, labels = encode_chat([{"role": m["role"], "content": m.get("content") or ""} for m in messages], tokenizer)
    if train_on == "all":
        return ids, list(ids)
    if train_on == "last_assistant":  # keep the last run of targets (each assistant turn is one contiguous run)
        t = len(labels)
        while t > 0 and labels[t - 1] == IGNORE_INDEX:
            t -= 1
        s = t
        while s > 0 and labels[s - 1] != IGNORE_INDEX:
            s -= 1
        labels = [IGNORE_INDEX] * s + labels[s:t] + [IGNORE_INDEX] * (len(labels) - t)
    return ids, labels


def _render_with_template(messages: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, *,
                       add_generation_prompt: bool = True, tools: Sequence[Any] | None = None,
                       **template_kwargs: Any) -> list[int] | None:
    """Prompt ids rendered by the tokenizer's chat template (as ``apply_chat_template(messages, tools=tools,
    add_generation_prompt=..., **template_kwargs)``), or ``None`` when it has none (the caller uses ChatML)."""
    fmt = chat_format(tokenizer)
    if fmt is None:
        return None
    validate_chat_record({"messages": list(messages), "tools": tools}, "render_chat_prompt")
    text, _ = fmt.render(messages, tools, add_generation_prompt=add_generation_prompt,
                         template_kwargs=template_kwargs)
    return list(fmt.tokenizer.encoding(text).ids)



# ----------------------------------------------------------------------------------------------------------------
# ChatML (records and prompts of a tokenizer without a chat template)


def _special_id(tokenizer: Tokenizer, token: str) -> int:
    i = tokenizer.token_to_id(token)
    if i is None:
        raise DataError(
            f"tokenizer {tokenizer!r} has no {token} token; chat (\"messages\") records need {IM_START} and "
            f"{IM_END} in the vocabulary (use a ChatML tokenizer, or plain \"text\" records)"
        )
    return i


def encode_chat(messages: Sequence[Mapping[str, str]], tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message; targets are the assistant contents and
    their ``<|im_end|>``; everything else is labelled -100."""
    im_start, im_end = _special_id(tokenizer, IM_START), _special_id(tokenizer, IM_END)
    newline = tokenizer.encode("\n")
    ids: list[int] = []
    labels: list[int] = []
    for m in messages:
        head = [im_start] + tokenizer.encode(m["role"] + "\n")
        body = tokenizer.encode(m["content"]) + [im_end]
        ids += head + body + newline
        labels += [IGNORE_INDEX] * len(head)
        labels += list(body) if m["role"] == "assistant" else [IGNORE_INDEX] * len(body)
        labels += [IGNORE_INDEX] * len(newline)
    return ids, labels


def render_chat_prompt(messages: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, *,
                       add_generation_prompt: bool = True, tools: Sequence[Any] | None = None,
                       **template_kwargs: Any) -> list[int]:
    """Prompt ids for sampling: the tokenizer's chat template when it has one (as transformers'
    ``apply_chat_template(messages, tools=tools, add_generation_prompt=..., **template_kwargs)``), else ChatML
    ending with ``<|im_start|>assistant\\n``."""
    ids = _render_with_template(messages, tokenizer, add_generation_prompt=add_generation_prompt, tools=tools,
                               **template_kwargs)
    if ids is not None:
        return ids
    if tools is not None or template_kwargs:
        raise DataError(f"tokenizer {tokenizer!r} has no chat template; tools and template arguments need one")
    ids, _ = encode_chat(messages, tokenizer)
    if add_generation_prompt:
        ids += [_special_id(tokenizer, IM_START)] + tokenizer.encode("assistant\n")
    return ids


__all__ = ["TRAIN_ON", "ROLES", "ChatFormat", "validate_chat_record", "load_chat_format", "chat_format",
           "spans_to_token_mask", "prefix_spans", "encode_chat_record", "encode_chat", "render_chat_prompt"]
