"""Chat records rendered by the tokenizer's own chat template: ids and assistant masks against transformers'
``apply_chat_template`` (a small byte-level BPE built here, saved as a Hugging Face tokenizer directory with a
Qwen3.5-style template written for these tests), the prefix method against an independent structural computation,
train_on variants, and one-line errors naming file and line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from q38.train.data.chat import render_chat_prompt
from q38.train.data.loader import IGNORE_INDEX, DataError, build_dataset, encode_record, load_documents
from q38.train.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

# A Qwen3.5-style template written for these tests (ChatML turns; a <think> block on assistant turns after the last
# user query, dropped before it; XML-style tool calls; consecutive tool results grouped into one user turn wrapped
# in <tool_response>; generation prompt opening a <think> block unless enable_thinking is false). GEN_OPEN/GEN_CLOSE
# become {% generation %}/{% endgeneration %} in the training variant and disappear in the plain one.
QWEN_LIKE = r"""
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' and m.content is string and not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if ns.last_query < 0 %}
    {{- raise_exception('The conversation needs at least one user message.') }}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou can call these functions:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call one, reply with\n<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
    {%- set content = m.content if m.content is string else '' %}
    {%- if m.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('A system message must come first.') }}
        {%- endif %}
    {%- elif m.role == 'user' %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if m.reasoning_content is string %}
            {%- set reasoning = m.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        GEN_OPEN
        {%- if loop.index0 > ns.last_query %}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- content.strip('\n') }}
        {%- if m.tool_calls %}
            {%- for call in m.tool_calls %}
                {%- set fn = call.function if call.function is defined else call %}
                {%- if not loop.first %}
                    {{- '\n' }}
                {%- elif content.strip('\n') %}
                    {{- '\n\n' }}
                {%- endif %}
                {{- '<tool_call>\n<function=' + fn.name + '>\n' }}
                {%- if fn.arguments is mapping %}
                    {%- for key, value in fn.arguments.items() %}
                        {{- '<parameter=' + key + '>\n' + (value if value is string else value | tojson) + '\n</parameter>\n' }}
                    {%- endfor %}
                {%- elif fn.arguments is string %}
                    {{- fn.arguments + '\n' }}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>' }}
        GEN_CLOSE
        {{- '\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""
PLAIN_TEMPLATE = QWEN_LIKE.replace("GEN_OPEN", "").replace("GEN_CLOSE", "")
GEN_TEMPLATE = QWEN_LIKE.replace("GEN_OPEN", "{%- generation %}").replace("GEN_CLOSE", "{%- endgeneration %}")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]}}}
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


def _call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# (id, record); every kind the issue names: system, multi-turn, tool call + response, reasoning, empty assistant
# turn, non-ASCII, plus inline <think>, parallel calls, a reasoning agent turn followed by a new user query.
CONVERSATIONS = [
    ("single", {"messages": [{"role": "user", "content": "What is two plus two?"},
                             {"role": "assistant", "content": "Two plus two is four."}]}),
    ("system", {"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Name a colour."},
                             {"role": "assistant", "content": "Blue."}]}),
    ("multi_turn", {"messages": [{"role": "system", "content": "You are a calculator."},
                                 {"role": "user", "content": "What is 2 plus 2?"},
                                 {"role": "assistant", "content": "4."},
                                 {"role": "user", "content": "And 3 plus 3?"},
                                 {"role": "assistant", "content": "6."}]}),
    ("reasoning_last", {"messages": [{"role": "user", "content": "Is 7 prime?"},
                                     {"role": "assistant", "reasoning_content": "7 has no divisor but 1 and 7.",
                                      "content": "Yes."}]}),
    ("reasoning_dropped", {"messages": [{"role": "user", "content": "Is 9 prime?"},
                                        {"role": "assistant", "reasoning_content": "9 = 3 * 3.", "content": "No."},
                                        {"role": "user", "content": "And 11?"},
                                        {"role": "assistant", "reasoning_content": "Only 1 and 11.",
                                         "content": "Yes, 11 is prime."}]}),
    ("tool_call", {"tools": [WEATHER_TOOL], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {"city": "Paris"})]},
        {"role": "tool", "content": "{\"temp\": 18, \"sky\": \"clear\"}"},
        {"role": "assistant", "content": "18 degrees and clear."}]}),
    ("parallel_calls_system", {"tools": [WEATHER_TOOL, ADD_TOOL], "messages": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Oslo and Rome, in celsius?"},
        {"role": "assistant", "content": "Checking both.",
         "tool_calls": [_call("get_weather", {"city": "Oslo", "unit": "celsius"}),
                        _call("get_weather", {"city": "Rome", "unit": "celsius"})]},
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "21"},
        {"role": "assistant", "content": "Oslo 3, Rome 21."}]}),
    ("empty_assistant", {"messages": [{"role": "user", "content": "Say nothing."},
                                      {"role": "assistant", "content": ""},
                                      {"role": "user", "content": "Now say hi."},
                                      {"role": "assistant", "content": "hi"}]}),
    ("non_ascii", {"messages": [{"role": "system", "content": "Réponds en français 🙂"},
                                {"role": "user", "content": "你好，天气怎么样？ Ünïcödé"},
                                {"role": "assistant", "content": "Très beau — 晴天 ☀️!"}]}),
    ("inline_think", {"messages": [{"role": "user", "content": "Is 4 even?"},
                                   {"role": "assistant", "content": "<think>\n4 = 2 * 2\n</think>\n\nYes."}]}),
    ("no_content_string_args", {"tools": [ADD_TOOL], "messages": [
        {"role": "user", "content": "Add 2 and 5."},
        {"role": "assistant", "tool_calls": [_call("add", "{\"a\": 2, \"b\": 5}")]},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "7."}]}),
    ("agent_then_new_query", {"tools": [ADD_TOOL], "messages": [
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "reasoning_content": "Use the add tool.", "content": "",
         "tool_calls": [_call("add", {"a": 1, "b": 2})]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "reasoning_content": "The tool said 3.", "content": "3."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome."}]}),
    ("consecutive_assistant", {"messages": [{"role": "user", "content": "Count to two."},
                                            {"role": "assistant", "content": "One."},
                                            {"role": "assistant", "content": "Two."}]}),
]
IDS = [name for name, _ in CONVERSATIONS]


def _make_tokenizer_dir(directory: Path, template: str | None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers import AddedToken

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [json.dumps(r) for _, r in CONVERSATIONS] + ["the weather is clear and the sky is blue"] * 3
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 4096}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tok")
    return {"plain": _make_tokenizer_dir(root / "plain", PLAIN_TEMPLATE),
            "gen": _make_tokenizer_dir(root / "gen", GEN_TEMPLATE),
            "none": _make_tokenizer_dir(root / "none", None)}


@pytest.fixture(scope="module")
def hf(tok_dirs):
    from transformers import AutoTokenizer

    return {k: AutoTokenizer.from_pretrained(str(tok_dirs[k])) for k in ("plain", "gen")}


@pytest.fixture(scope="module")
def ours(tok_dirs):
    return {k: load_tokenizer(str(d)) for k, d in tok_dirs.items()}


def _hf_ids(hf_tok, record, **kw):
    out = hf_tok.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=True,
                                     return_dict=True, **kw)
    return out


def _structural_targets(full: str, n_assistant: int) -> list[tuple[int, int]]:
    """Independent reference for the prefix method on this template (written from its structure, not by rendering
    prefixes): the j-th assistant turn starts after the j-th ``<|im_start|>assistant\\n`` header and after as much
    of the generation prompt's ``<think>\\n`` as the turn repeats, and ends with the first ``<|im_end|>``."""
    header, spans, pos = "<|im_start|>assistant\n", [], 0
    for _ in range(n_assistant):
        h = full.index(header, pos)
        start = h + len(header)
        k = 0
        while k < len("<think>\n") and full[start + k:start + k + 1] == "<think>\n"[k]:
            k += 1
        start += k
        end = full.index("<|im_end|>", start) + len("<|im_end|>")
        spans.append((start, end))
        pos = end
    return spans


def _overlap_mask(offsets, spans) -> list[bool]:
    return [any(a < e and b > s for s, e in spans) for a, b in offsets]


@pytest.mark.parametrize("name,record", CONVERSATIONS, ids=IDS)
def test_ids_and_generation_masks_equal_transformers(name, record, hf, ours):
    for kind in ("plain", "gen"):
        ids, labels = encode_record(record, ours[kind])
        out = _hf_ids(hf[kind], record, return_assistant_tokens_mask=(kind == "gen"))
        assert ids == list(out["input_ids"]), kind
        if kind == "gen":
            hf_mask = list(out["assistant_masks"])
            assert [int(x != IGNORE_INDEX) for x in labels] == hf_mask
            assert sum(hf_mask) > 0
            # last_assistant: transformers' mask with all but its last run of ones cleared
            last_start = max(t for t in range(len(hf_mask)) if hf_mask[t] and (t == 0 or not hf_mask[t - 1]))
            _, last = encode_record(record, ours[kind], train_on="last_assistant")
            assert [int(x != IGNORE_INDEX) for x in last] == [m if t >= last_start else 0 for t, m in enumerate(hf_mask)]


@pytest.mark.parametrize("name,record", CONVERSATIONS, ids=IDS)
def test_prefix_masks_equal_structural_reference(name, record, hf, ours):
    ids, labels = encode_record(record, ours["plain"])
    hf_tok = hf["plain"]
    full = hf_tok.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=False)
    enc = hf_tok(full, add_special_tokens=False, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == ids
    n_assistant = sum(m["role"] == "assistant" for m in record["messages"])
    spans = _structural_targets(full, n_assistant)
    expected = _overlap_mask(enc["offset_mapping"], spans)
    assert [x != IGNORE_INDEX for x in labels] == expected
    # last_assistant keeps only the last span; all keeps everything
    _, last = encode_record(record, ours["plain"], train_on="last_assistant")
    assert [x != IGNORE_INDEX for x in last] == _overlap_mask(enc["offset_mapping"], spans[-1:])
    _, every = encode_record(record, ours["plain"], train_on="all")
    assert every == ids


def _target_texts(tok: HFTokenizer, ids, labels) -> list[str]:
    runs, cur = [], []
    for i, lab in zip(ids, labels):
        if lab != IGNORE_INDEX:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur)), cur.clear()
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_targets_by_hand(ours):
    """What is trained, written out by hand for three conversations (prefix method, then generation blocks)."""
    tok = ours["plain"]
    rec = dict(CONVERSATIONS)["reasoning_dropped"]
    assert _target_texts(tok, *encode_record(rec, tok)) == [
        "No.<|im_end|>", "Only 1 and 11.\n</think>\n\nYes, 11 is prime.<|im_end|>"]
    rec = dict(CONVERSATIONS)["tool_call"]
    texts = _target_texts(tok, *encode_record(rec, tok))
    assert texts == ["\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                     "</function>\n</tool_call><|im_end|>", "\n</think>\n\n18 degrees and clear.<|im_end|>"]
    rec = dict(CONVERSATIONS)["agent_then_new_query"]
    assert _target_texts(tok, *encode_record(rec, tok)) == [
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>", "3.<|im_end|>", "\n</think>\n\nYou are welcome.<|im_end|>"]
    # the training template's generation blocks also cover the <think> opener of the final turn
    gtok = ours["gen"]
    assert _target_texts(gtok, *encode_record(dict(CONVERSATIONS)["reasoning_last"], gtok)) == [
        "<think>\n7 has no divisor but 1 and 7.\n</think>\n\nYes.<|im_end|>"]


def test_render_chat_prompt_uses_template(hf, ours):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    for kind in ("plain", "gen"):
        want = hf[kind].apply_chat_template(msgs, tools=[WEATHER_TOOL], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        assert render_chat_prompt(msgs, ours[kind], tools=[WEATHER_TOOL]) == list(want)
    want = hf["plain"].apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False,
                                           tokenize=True, return_dict=True)["input_ids"]
    got = render_chat_prompt(msgs, ours["plain"], enable_thinking=False)
    assert got == list(want) and ours["plain"].decode(got).endswith("<think>\n\n</think>\n\n")


def test_no_template_falls_back_to_chatml(ours, tmp_path):
    tok = ours["none"]
    rec = dict(CONVERSATIONS)["multi_turn"]
    ids, labels = encode_record(rec, tok)
    assert tok.decode(ids) == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                                      for m in rec["messages"])
    assert _target_texts(tok, ids, labels) == ["4.<|im_end|>", "6.<|im_end|>"]
    _, last = encode_record(rec, tok, train_on="last_assistant")
    assert _target_texts(tok, ids, last) == ["6.<|im_end|>"]
    _, every = encode_record(rec, ByteTokenizer(), train_on="all")
    assert every == encode_record(rec, ByteTokenizer())[0]
    f = tmp_path / "tools.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                 + json.dumps(dict(CONVERSATIONS)["tool_call"]) + "\n")
    with pytest.raises(DataError) as e:
        load_documents(f, ByteTokenizer())
    msg = str(e.value)
    assert f"{f}:2:" in msg and "no chat template" in msg and "tool_calls" in msg and "\n" not in msg


@pytest.mark.parametrize("record,pattern", [
    ({"messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\]\.role is 'bot'; expected one of system, user, "
                                                       r"assistant, tool"),
    ({"messages": [{"role": "user", "content": None}]}, r"messages\[0\] \(user\) needs a string \"content\""),
    ({"messages": [{"role": "user", "content": "a", "reasoning_content": "r"}]},
     r"messages\[0\]\.reasoning_content is only allowed on assistant messages"),
    ({"messages": [{"role": "assistant", "content": "a", "tool_calls": [{"function": {"arguments": {}}}]}]},
     r"messages\[0\]\.tool_calls\[0\] needs a function name"),
    ({"messages": [{"role": "assistant", "content": "a", "tool_calls": {"name": "f"}}]},
     r"messages\[0\]\.tool_calls must be a list"),
    ({"messages": [{"role": "user", "content": "a", "weight": 1}]}, r"messages\[0\] has unknown key\(s\) 'weight'"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": {"name": "f"}}, r"\"tools\" must be a list"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": ["enable_thinking"]},
     r"\"chat_template_kwargs\" must be an object"),
])
def test_bad_records_one_line_with_file_and_line(record, pattern, tmp_path, ours):
    f = tmp_path / "bad.jsonl"
    good = json.dumps(dict(CONVERSATIONS)["single"])
    f.write_text(good + "\n\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError) as e:
        build_dataset(f, ours["plain"], 64)
    msg = str(e.value)
    assert msg.startswith(f"{f}:3: ") and "\n" not in msg
    assert re.search(pattern, msg), msg


def test_template_that_raises_names_file_and_line(tmp_path, ours):
    f = tmp_path / "late_system.jsonl"
    late = {"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"},
                         {"role": "assistant", "content": "ok"}]}
    f.write_text(json.dumps(dict(CONVERSATIONS)["single"]) + "\n" + json.dumps(late) + "\n")
    with pytest.raises(DataError) as e:
        build_dataset(f, ours["plain"], 64)
    msg = str(e.value)
    assert msg.startswith(f"{f}:2: the chat template of ") and msg.endswith("raised: A system message must come first.")
    assert "\n" not in msg
    # a template error that is not raise_exception (an undefined attribute on an undefined value) reads the same
    d = _make_tokenizer_dir(tmp_path / "broken", "{{ messages[0].nope.deeper }}")
    with pytest.raises(DataError, match=rf"^{re.escape(str(f))}:1: the chat template of .* raised: .*nope"):
        build_dataset(f, load_tokenizer(str(d)), 64)
    d = _make_tokenizer_dir(tmp_path / "syntax", "{% for m in messages %}{{ m.content }}")
    with pytest.raises(DataError, match=rf"^{re.escape(str(f))}:1: chat template 'default' of .* does not parse"):
        build_dataset(f, load_tokenizer(str(d)), 64)


def test_template_files_take_precedence(tmp_path, tok_dirs, ours):
    """chat_template.jinja overrides tokenizer_config.json, as in transformers; a named tool_use template is used
    when the record has tools."""
    import shutil

    d = tmp_path / "files"
    shutil.copytree(tok_dirs["plain"], d)
    (d / "chat_template.jinja").write_text(GEN_TEMPLATE)
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text(PLAIN_TEMPLATE)
    tok = load_tokenizer(str(d))
    rec = dict(CONVERSATIONS)["reasoning_last"]
    assert encode_record(rec, tok) == encode_record(rec, ours["gen"])
    rec = dict(CONVERSATIONS)["tool_call"]
    assert encode_record(rec, tok) == encode_record(rec, ours["plain"])


def test_train_on_config(tmp_path):
    from q38.model_config import ConfigError
    from q38.train.run.run_config import DataConfig

    assert DataConfig().train_on == "assistant"
    assert DataConfig(train_on="last_assistant").train_on == "last_assistant"
    with pytest.raises(ConfigError, match="data.train_on must be one of assistant, all, last_assistant"):
        DataConfig(train_on="assistants")


# No whitespace control in the tags: the output depends on the environment's trim_blocks/lstrip_blocks, which must be
# transformers' (both on).
LOOSE_TEMPLATE = """{% for message in messages %}
    {% if message.role == 'system' %}
[SYS] {{ message.content }}
    {% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def test_whitespace_sensitive_template(tmp_path):
    from transformers import AutoTokenizer

    d = _make_tokenizer_dir(tmp_path / "loose", LOOSE_TEMPLATE)
    tok, hf_tok = load_tokenizer(str(d)), AutoTokenizer.from_pretrained(str(d))
    for name in ("system", "multi_turn", "non_ascii"):
        rec = dict(CONVERSATIONS)[name]
        assert encode_record(rec, tok)[0] == list(hf_tok.apply_chat_template(rec["messages"], tokenize=True,
                                                                             return_dict=True)["input_ids"])
    ids, labels = encode_record(dict(CONVERSATIONS)["multi_turn"], tok)
    assert tok.decode(ids).startswith("[SYS] You are a calculator.\n<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n")
    assert _target_texts(tok, ids, labels) == ["4.<|im_end|>", "6.<|im_end|>"]


def test_readme_chat_record_is_valid(ours):
    """The chat record docs/finetuning.md shows (system prompt, tools, reasoning, a tool call) validates and renders."""
    from q38.train.data.loader import validate_record

    text = (Path(__file__).resolve().parents[1] / "docs" / "finetuning.md").read_text(encoding="utf-8")
    record = json.loads(re.search(r"### Chat data.*?```json\n(.*?)```", text, re.S).group(1))
    validate_record(record, "docs/finetuning.md")
    assert {m["role"] for m in record["messages"]} == {"system", "user", "assistant", "tool"}
    ids, labels = encode_record(record, ours["plain"])
    assert _target_texts(ours["plain"], ids, labels)[-1] == "\n</think>\n\n18 °C and clear.<|im_end|>"


def test_chat_template_kwargs(hf, ours):
    """A record's chat_template_kwargs reach the template (as apply_chat_template(**kwargs)): with thinking off the
    generation prompt already holds the empty think block, so the prefix method does not train it."""
    rec = {"messages": dict(CONVERSATIONS)["multi_turn"]["messages"],
           "chat_template_kwargs": {"enable_thinking": False}}
    ids, labels = encode_record(rec, ours["plain"])
    assert ids == list(hf["plain"].apply_chat_template(rec["messages"], enable_thinking=False, tokenize=True,
                                                       return_dict=True)["input_ids"])
    assert _target_texts(ours["plain"], ids, labels) == ["4.<|im_end|>", "6.<|im_end|>"]
    _, default = encode_record({"messages": rec["messages"]}, ours["plain"])
    assert _target_texts(ours["plain"], ids, default) == ["4.<|im_end|>", "\n</think>\n\n6.<|im_end|>"]


HELPERS_TEMPLATE = """{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}
{% set ns.n = ns.n + 1 %}<|im_start|>{{ m.role }}
{{ m.content }}{{ eos_token }}
{% endfor %}{{ strftime_now('%Y') }} {{ {'note': 'é <b>', 'n': ns.n} | tojson }} {{ dict(a=1).a }} {{ pad_token }}
{{ 'bos' if bos_token is defined else 'no bos' }} {{ (tools or []) | length }} {{ documents is none }}"""


def test_template_helpers_and_variables(tmp_path):
    """The helpers and variables transformers passes: namespace, loopcontrols, eos/pad tokens from
    tokenizer_config.json (bos unset), strftime_now, non-escaping tojson, dict, tools and documents."""
    from transformers import AutoTokenizer

    d = _make_tokenizer_dir(tmp_path / "helpers", HELPERS_TEMPLATE)
    tok, hf_tok = load_tokenizer(str(d)), AutoTokenizer.from_pretrained(str(d))
    rec = {"messages": dict(CONVERSATIONS)["system"]["messages"], "tools": [ADD_TOOL]}
    ids, _ = encode_record(rec, tok, train_on="all")
    assert ids == list(hf_tok.apply_chat_template(rec["messages"], tools=rec["tools"], tokenize=True,
                                                  return_dict=True)["input_ids"])
    text = tok.decode(ids)
    assert '{"note": "é <b>", "n": 2} 1 <|endoftext|>\nno bos 1 True' in text and "Be brief." not in text


def test_prefix_method_errors_name_the_render(tmp_path, ours):
    f = tmp_path / "a.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "assistant", "content": "Hi."},
                                          {"role": "user", "content": "Hello."}]}) + "\n")
    with pytest.raises(DataError, match=rf"^{re.escape(str(f))}:1: messages\[0\] is an assistant message"):
        build_dataset(f, ours["plain"], 64)
    assert build_dataset(f, ours["plain"], 64, train_on="all").num_targets > 0
    # the template raises on a prefix only (no user message before the first assistant turn after the system)
    f.write_text(json.dumps({"messages": [{"role": "system", "content": "S."},
                                          {"role": "assistant", "content": "A."},
                                          {"role": "user", "content": "U."}]}) + "\n")
    with pytest.raises(DataError) as e:
        build_dataset(f, ours["plain"], 64)
    msg = str(e.value)
    assert msg.startswith(f"{f}:1: the chat template of ") and "raised: The conversation needs at least one user" in msg
    assert "rendering messages[:1] with add_generation_prompt" in msg and "\n" not in msg
