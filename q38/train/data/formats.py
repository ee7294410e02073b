"""The common record shapes of chat and instruction data, converted to q38's records before tokenization.

q38's own records are ``{"text": str}`` and ``{"messages": [...], "tools": [...]}`` (``q38.train.data.chat``); the
other shapes users bring are read as ms-swift and LLaMA-Factory read them: ``sharegpt``, ``alpaca``, OpenAI-style
``messages``, and ``text``. ``auto`` recognises each record by its keys; a record that does not fit gets one line
naming it (``file:line``) and the field. The conversions:
docs/data.md#chat-formats-sharegpt-alpaca-openai-messages-with-tools.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from q38.errors import DataError

FORMATS = ("auto", "messages", "sharegpt", "alpaca", "text")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "function_call": "assistant", "observation": "tool", "tool": "tool",
                  "function": "tool"}
_MESSAGE_KEYS = ("role", "content", "tool_calls", "name", "tool_call_id", "reasoning_content", "thinking",
                 "reasoning")


def _fail(where: str, msg: str) -> None:
    raise DataError(f"{where}: {msg}")


def detect_format(record: Any) -> str | None:
    """The format ``record``'s keys say (None: none of them)."""
    if not isinstance(record, Mapping):
        return None
    if "text" in record or "messages" in record:
        return "messages" if "messages" in record else "text"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    return None


def to_record(record: Any, fmt: str, where: str) -> Any:
    """``record`` (of format ``fmt``, or recognised under ``auto``) as a q38 record; records that are not objects,
    and ``auto`` records of no known shape, are returned unchanged for ``data.validate_record`` to refuse."""
    if fmt not in FORMATS:
        raise DataError(f"--format is {fmt!r}; expected one of {', '.join(FORMATS)}")
    if not isinstance(record, Mapping):
        return record
    kind = detect_format(record) if fmt == "auto" else fmt
    if kind == "sharegpt":
        return sharegpt_to_messages(record, where)
    if kind == "alpaca":
        return alpaca_to_messages(record, where)
    if kind == "messages":
        if "messages" not in record:
            _fail(where, f"record has no \"messages\" (keys: {', '.join(map(repr, record)) or 'none'}); --format "
                         f"messages expects {{\"messages\": [{{\"role\", \"content\"}}, ...]}}")
        return openai_messages(record, where)
    if kind == "text" and "text" not in record:
        _fail(where, f"record has no \"text\" (keys: {', '.join(map(repr, record)) or 'none'}); --format text "
                     f"expects {{\"text\": str}}")
    return record


def _loads(text: str, where: str, msg: str, fix: str = "") -> Any:
    """JSON inside a record's string (tool schemas, call arguments): nested at most ``MAX_JSON_DEPTH`` deep, else a
    ``DataError`` naming ``where``; not JSON: ``DataError("where: msg (why)fix")``."""
    from q38.files import MAX_JSON_DEPTH, json_depth_over

    if json_depth_over(text):
        _fail(where, f"JSON inside a string nested too deeply (more than {MAX_JSON_DEPTH} levels of arrays / objects)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        _fail(where, f"{msg} ({e.msg}){fix}")
    except RecursionError:
        _fail(where, f"JSON inside a string nested too deeply (more than {MAX_JSON_DEPTH} levels of arrays / objects)")


def _tools(value: Any, where: str) -> list:
    if isinstance(value, str):
        if not value.strip():
            return []
        value = _loads(value, where, "\"tools\" is a string but not JSON", "; expected a list of function schemas")
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        _fail(where, "\"tools\" must be a list of function schemas like {\"name\": str, \"description\": str, "
                     "\"parameters\": {...}}")
    return [t if "function" in t or "type" in t else {"type": "function", "function": t} for t in value]


def _calls(value: Any, where: str, at: str) -> list[dict]:
    """A ShareGPT ``function_call`` value -> OpenAI ``tool_calls``."""
    if isinstance(value, str):
        value = _loads(value, where, f"{at}.value of a function_call turn must be a JSON call {{\"name\": str, "
                                     "\"arguments\": {...}} (or a list of them); it is not JSON")
    calls = value if isinstance(value, list) else [value]
    out = []
    for k, c in enumerate(calls):
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not c["name"]:
            _fail(where, f"{at}.value call {k} must be an object {{\"name\": str, \"arguments\": {{...}}}}")
        args = c.get("arguments", {})
        if isinstance(args, str):
            try:
                args = _loads(args, where, "not JSON")
            except DataError as e:
                if "nested too deeply" in str(e):
                    raise
                # else: a string the template prints as it is
        out.append({"type": "function", "function": {"name": c["name"], "arguments": args}})
    return out


def sharegpt_to_messages(record: Mapping[str, Any], where: str) -> dict[str, Any]:
    conv = record.get("conversations")
    if not isinstance(conv, list) or not conv:
        _fail(where, "\"conversations\" must be a non-empty list of {\"from\": ROLE, \"value\": str} turns")
    msgs: list[dict[str, Any]] = []
    system = record.get("system")
    if system is not None:
        if not isinstance(system, str):
            _fail(where, f"\"system\" must be a string, got {type(system).__name__}")
        if system:
            msgs.append({"role": "system", "content": system})
    for j, turn in enumerate(conv):
        at = f"conversations[{j}]"
        if not isinstance(turn, dict):
            _fail(where, f"{at} must be an object {{\"from\": ROLE, \"value\": str}}, got {type(turn).__name__}")
        frm = turn.get("from", turn.get("role"))
        if frm not in SHAREGPT_ROLES:
            _fail(where, f"{at}.from is {frm!r}; expected one of {', '.join(SHAREGPT_ROLES)}")
        value = turn.get("value", turn.get("content"))
        if frm == "function_call":
            msgs.append({"role": "assistant", "content": None, "tool_calls": _calls(value, where, at)})
            continue
        if not isinstance(value, str):
            _fail(where, f"{at}.value must be a string, got {type(value).__name__}")
        msgs.append({"role": SHAREGPT_ROLES[frm], "content": value})
    out: dict[str, Any] = {"messages": msgs}
    if record.get("tools") not in (None, "", []):
        out["tools"] = _tools(record["tools"], where)
    return out


def alpaca_to_messages(record: Mapping[str, Any], where: str) -> dict[str, Any]:
    for key in ("instruction", "output"):
        if not isinstance(record.get(key), str):
            _fail(where, f"\"{key}\" must be a string (an Alpaca record is {{\"instruction\": str, \"input\": str, "
                         f"\"output\": str}}), got {type(record.get(key)).__name__}")
    msgs: list[dict[str, Any]] = []
    for key in ("input", "system"):
        if record.get(key) is not None and not isinstance(record[key], str):
            _fail(where, f"\"{key}\" must be a string, got {type(record[key]).__name__}")
    if record.get("system"):
        msgs.append({"role": "system", "content": record["system"]})
    history = record.get("history") or []
    if not isinstance(history, list):
        _fail(where, "\"history\" must be a list of [query, reply] pairs")
    for k, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            _fail(where, f"history[{k}] must be a [query, reply] pair of strings")
        msgs += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    query = record["instruction"] + ("\n" + record["input"] if record.get("input") else "")
    msgs += [{"role": "user", "content": query}, {"role": "assistant", "content": record["output"]}]
    return {"messages": msgs}


def _content(content: Any, where: str, j: int) -> Any:
    """OpenAI content parts -> one string (text parts only)."""
    if not isinstance(content, list):
        return content
    parts = []
    for k, p in enumerate(content):
        if isinstance(p, str):
            parts.append(p)
        elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
            parts.append(p["text"])
        else:
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            _fail(where, f"messages[{j}].content[{k}] is a {kind!r} part; only text parts ({{\"type\": \"text\", "
                         f"\"text\": str}}) can be trained on")
    return "".join(parts)


def openai_messages(record: Mapping[str, Any], where: str) -> dict[str, Any]:
    msgs = record["messages"]
    if not isinstance(msgs, list):
        return dict(record)  # validate_chat_record names the problem
    out_msgs = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict):
            out_msgs.append(m)
            continue
        m = {k: v for k, v in m.items() if v is not None or k in _MESSAGE_KEYS}
        if m.get("role") == "developer":
            m["role"] = "system"
        if "content" in m:
            m["content"] = _content(m["content"], where, j)
        out_msgs.append(m)
    out = dict(record, messages=out_msgs)
    if isinstance(out.get("tools"), str):
        out["tools"] = _tools(out["tools"], where)
    return out


__all__ = ["FORMATS", "SHAREGPT_ROLES", "detect_format", "to_record", "sharegpt_to_messages", "alpaca_to_messages",
           "openai_messages"]
