"""Tool calls read out of a chat reply (`deployments.tool_calls`): every model format, whole and streamed in pieces
of every size (the same calls and content however the text is cut), and the format a chat template shows."""
from __future__ import annotations

import json
import re

import pytest

from deployments.tool_calls import (PARSERS, JsonText, NamedToolReader, RequiredToolReader, ReplyDelta, detect,
                                    merge_calls, model_format_reader)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "C"}}'

# (format, reply, content, [(name, arguments)])
CASES = [
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", {"city": "Zürich", "unit": "C"})]),
    ("hermes", f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
     '{"name": "get_time", "arguments": {}}\n</tool_call>\n', "Let me look.\n",
     [("get_weather", {"city": "Zürich", "unit": "C"}), ("get_time", {})]),
    ("hermes", f"<tool_call>{WEATHER}", None, [("get_weather", {"city": "Zürich", "unit": "C"})]),  # cut at its end
    ("hermes", "No call: 2 < 3 and <tool", "No call: 2 < 3 and <tool", []),
    ("hermes", '<tool_call>{"name": oops}</tool_call> then text', '<tool_call>{"name": oops}</tool_call> then text',
     []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", {"a": 1})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "hello"}</tool_call>', None, [("f", "hello")]),  # (JSON text)
    ("hermes", '<tool_call>{"arguments": {"x": "</tool_call>"}, "name": "f"}</tool_call>', None,  # (theirs)
     [("f", {"x": "</tool_call>"})]),
    ("hermes", '<tool_call>{"name":"f","arguments":{"c":"a\tb"}} x</tool_call>Sure. ', "Sure. ",
     [("f", {"c": "a\tb"})]),
    ("qwen3_coder", "<tool_call><function=f><parameter=a>x</tool_call>y</parameter></function></tool_call> ok", " ok",
     [("f", {"a": "x</tool_call>y"})]),
    ("qwen3_coder", "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "I'll check.\n",
     [("get_weather", {"city": "Zürich", "days": 3})]),
    ("qwen3_coder", "<tool_call>\n<function=now>\n</function>\n</tool_call>", None, [("now", {})]),
    # a value whose </parameter> the model left out ends at the next parameter or the function's end (vLLM's)
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\nx\n</function>\n</tool_call>", None,
     [("f", {"a": 1, "b": "x"})]),
    # a call begun without <tool_call> (vLLM's parser reads it): it ends with its function
    ("qwen3_coder", "I will check.\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call> Done.",
     "I will check.\n Done.", [("f", {"a": 1})]),
    ("qwen3_coder", "<function=f>\n</function>\n<function=g>\n<parameter=a>\n[1]\n</parameter>\n</function>", None,
     [("f", {}), ("g", {"a": [1]})]),
    ("qwen3_coder", "Code: <function=x", "Code: <function=x", []),
    ("qwen3_coder", "<tool_call>{\"name\": \"f\"}</tool_call>", "<tool_call>{\"name\": \"f\"}</tool_call>", []),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"q": "é"}}; {"name": "g", "parameters": {}}', None,
     [("f", {"q": "é"}), ("g", {})]),
    ("llama3_json", '\n {"name": "f", "parameters": {"q": 1}}', None, [("f", {"q": 1})]),
    ("llama3_json", "Hello {there}", "Hello {there}", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    # a JSON answer with a "name" but no arguments is content, not a call (nothing marks llama3's calls; vLLM's)
    ("llama3_json", '{"name": "John Smith", "age": 31}', '{"name": "John Smith", "age": 31}', []),
    ("mistral", 'Sure[TOOL_CALLS][{"name": "f", "arguments": {"a": 2}}, {"name": "g", "arguments": {}}]', "Sure",
     [("f", {"a": 2}), ("g", {})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 2}[TOOL_CALLS]g{"b": [3]}', None, [("f", {"a": 2}), ("g", {"b": [3]})]),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": [1, {"b": "]"}]}}]', None,
     [("f", {"a": [1, {"b": "]"}]})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]"{\\"a\\": 1}"', None, [("f", {"a": 1})]),  # (arguments as JSON text)
    ("mistral", '[TOOL_CALLS][1, 2]', '[TOOL_CALLS][1, 2]', []),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 2} ok[TOOL_CALLS]g{}', " ok", [("f", {"a": 2}), ("g", {})]),
    ("mistral", "[TOOL_CALLS]not a call", "[TOOL_CALLS]not a call", []),
    ("mistral", "plain [TOOL", "plain [TOOL", []),
    # Python's True, False and None where JSON has true, false and null: JSON's, whole and streamed alike (the stream
    # sent the call and then cut its arguments at the first of them)
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": True, "b": [False, None], "c": "None"}}\n</tool_call>',
     None, [("f", {"a": True, "b": [False, None], "c": "None"})]),
    ("hermes", '<tool_call>{"arguments": {"a": None}, "name": "f"}</tool_call>', None, [("f", {"a": None})]),
    ("llama3_json", '{"name": "f", "parameters": {"q": True}}', None, [("f", {"q": True})]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": False}}]', None, [("f", {"a": False})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": None}', None, [("f", {"a": None})]),
    # an escape JSON has not (a regex, a Windows path, a cut \u): a backslash of its own, whole and streamed alike
    # (streamed, the arguments were no JSON; whole, the call was text)
    ("hermes", r'<tool_call>{"name": "grep", "arguments": {"p": "\d+", "dir": "C:\Users\me", "u": "\uZZ"}}'
     "</tool_call>", None, [("grep", {"p": r"\d+", "dir": r"C:\Users\me", "u": r"\uZZ"})]),
    ("llama3_json", r'{"name": "f", "parameters": {"q": "a\.b", "u": "\u12"}}', None,
     [("f", {"q": r"a\.b", "u": r"\u12"})]),
    ("mistral", r'[TOOL_CALLS]f[ARGS]{"re": "\s+\w"}', None, [("f", {"re": r"\s+\w"})]),
    # a mark that holds no call after a call: that call stands, the text from the mark is content (read whole, the
    # call was dropped); arguments as a string that is no JSON are a JSON string
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1} Use [TOOL_CALLS] to call.', " Use [TOOL_CALLS] to call.",
     [("f", {"a": 1})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]"hello"', None, [("f", "hello")]),
    # a qwen3_coder block of two functions, or a block left open before the next: each function a call (vLLM's
    # parser reads every function of a block; the second was dropped)
    ("qwen3_coder", "<tool_call>\n<function=f>\n</function>\n<function=g>\n<parameter=a>\n1\n</parameter>\n"
     "</function>\n</tool_call> ok", " ok", [("f", {}), ("g", {"a": 1})]),
    ("qwen3_coder", "<tool_call><function=f></function>\n<tool_call>\n<function=g></function></tool_call>", None,
     [("f", {}), ("g", {})]),
]


def _streamed(reader, text: str, step: int) -> ReplyDelta:
    out = ReplyDelta()
    for k in range(0, len(text), step):
        out.add(reader.feed(text[k:k + step]))
    return out.add(reader.end())


def _named(calls: list[dict]) -> list[tuple[str, object]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("fmt,reply,content,calls", CASES)
def test_a_reply_reads_as_the_same_content_and_calls_whole_and_in_every_cut(fmt, reply, content, calls) -> None:
    got_content, got_calls = model_format_reader(fmt).whole(reply)
    assert got_content == content and _named(got_calls) == calls
    # (Mistral's: 9 letters and digits, all its chat templates take back on the next turn; vLLM's)
    assert all((re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) if fmt == "mistral" else c["id"].startswith("chatcmpl-tool-"))
               and c["type"] == "function" for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)
    for step in range(1, len(reply) + 1):
        d = _streamed(model_format_reader(fmt), reply, step)
        assert (d.content if d.content.strip() or not d.calls else None) == content, step
        assert [c["index"] for c in d.calls if "id" in c] == list(range(len(calls)))  # each call once, in order
        assert _named(merge_calls(d.calls)) == calls, step
        assert [c["function"]["arguments"] for c in merge_calls(d.calls)] == \
            [c["function"]["arguments"] for c in got_calls], step  # the same text, not only the same JSON


def test_a_call_is_sent_once_its_name_is_read_and_its_arguments_as_they_are_written() -> None:
    """vLLM's streaming: the entry (id, name) as soon as the arguments' object opens, then each piece of them, as
    json.dumps writes them (however the model spaced them), before the call's text has ended."""
    for fmt, reply in [("hermes", '<tool_call>\n{"name":"get_weather" , "arguments":{"city":"Z\\u00fcrich",\n'
                                  '  "days":[1,2]}}\n</tool_call>'),
                       ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich", '
                                       '"days": [1, 2]}}'),
                       ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Zürich", '
                                   '"days": [1, 2]}}]'),
                       ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city":"Zürich","days":[1,2]}')]:
        r, sent = model_format_reader(fmt), []
        for k in range(len(reply)):
            sent.extend(r.feed(reply[k]).calls)
        sent.extend(r.end().calls)
        assert sent[0]["function"]["name"] == "get_weather" and sent[0]["id"] and sent[0]["index"] == 0
        assert len(sent) > 10 and all(set(e) == {"index", "function"} for e in sent[1:])  # piece by piece
        assert merge_calls(sent)[0]["function"]["arguments"] == '{"city": "Zürich", "days": [1, 2]}'
    r = model_format_reader("qwen3_coder")  # a parameter at a time
    d = [r.feed(p) for p in ("<tool_call>\n<function=get_weather>\n<parameter=city>\nZü", "rich\n</parameter>\n",
                             "<parameter=days>\n3\n</parameter>\n</function>", "\n</tool_call>")]
    assert d[0].calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert [e["function"]["arguments"] for x in d[1:] for e in x.calls] == ['{"city": "Zürich"', ', "days": 3}']
    r = RequiredToolReader()
    first = r.feed('[{"name": "f", "parameters": {"x": ')
    assert first.calls[0]["function"] == {"name": "f", "arguments": '{"x": '}
    rest = r.feed('1}}, {"name": "g", "parameters": {}}]').add(r.end())
    assert merge_calls(first.calls + rest.calls)[1]["function"] == {"name": "g", "arguments": "{}"}


@pytest.mark.parametrize("fmt,reply,whole,sent", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"q": "ab', 0, '{"q": "ab'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"q": [1}}</tool_call>', 0, '{"q": [1'),  # not JSON from `}`
    ("llama3_json", '{"name": "f", "parameters": {"q"', 0, '{"q"'),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=q>\n1\n</parameter>\n<parameter=r>", 0, '{"q": 1'),
    ("llama3_json", '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x"', 33, '{"x"'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"q": "ab', 0, '{"q": "ab'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"q"', 0, '{"q"'),
])
def test_a_call_cut_after_it_was_sent_stays_a_call_as_in_vllm(fmt, reply, whole, sent) -> None:
    """Read whole, a cut call stays text (as vLLM's reply; `whole`: where that text starts, the calls before it
    read); streamed, what was sent of it stays sent."""
    content, calls = model_format_reader(fmt).whole(reply)
    assert content == reply[whole:] and len(calls) == (whole > 0)
    d = _streamed(model_format_reader(fmt), reply, 1)
    assert d.content == "" and merge_calls(d.calls)[-1]["function"]["arguments"] == sent


@pytest.mark.parametrize("text", [
    '{"a": 1, "b": [true, false, null], "c": {"d": -1.5}}',
    ' {\n  "s" : "tab\\there \\"q\\" back\\\\slash \\/ \\u00e9 \\ud83d\\ude00 \\u0001 é 😀" ,"e":{} }',
    '{"lone": "\\ud83d then text", "low": "\\udc00", "ctl": "\\b\\f\\n\\r\\t"}',
    '[1, [2, [3]], "]"]',
])
def test_json_text_writes_what_it_is_fed_as_json_dumps_does_and_knows_where_it_ends(text) -> None:
    want = json.dumps(json.loads(text), ensure_ascii=False)
    if "lone" in text:  # json.dumps would write the lone surrogates as they are (no UTF-8 can)
        want = want.replace("\ud83d", "\\ud83d").replace("\udc00", "\\udc00")
    for step in range(1, len(text) + 2):
        j, out = JsonText(), []
        for k in range(0, len(text) + 5, step):
            out.append(j.feed((text + " tail")[k:k + step]))
        assert "".join(out) == want and j.end == len(text.rstrip()), step


def test_json_text_writes_pythons_true_false_and_none_as_json_and_breaks_on_other_words() -> None:
    for step in (1, 2, 3, 100):
        text, j, out = '{"a": [True, False, None], "T": "None"}', JsonText(), []
        for k in range(0, len(text), step):
            out.append(j.feed(text[k:k + step]))
        assert "".join(out) == '{"a": [true, false, null], "T": "None"}' and j.end == len(text), step
    for bad, at in (('{"a": Nonsense}', 6), ('{"a": Tru}', 6), ('{"a": NaN}', 6)):
        j = JsonText()
        j.feed(bad)
        assert j.broken == at and j.end is None, bad


def test_hermes_streams_text_at_once_and_holds_only_what_could_open_a_call() -> None:
    """Text before a call is streamed as it comes; only a tail that could be `<tool_call>`'s start waits."""
    r = model_format_reader("hermes")
    assert r.feed("Hello <").content == "Hello "
    assert r.feed("b>").content == "<b>"
    assert r.feed(" <tool_").content == " "
    d = r.feed('call>{"name": "f", "arguments": {}}</tool_call>')
    assert d.content == "" and d.calls[0]["function"] == {"name": "f", "arguments": "{}"}
    assert r.feed("\n\n").content == ""  # whitespace after a call is dropped ...
    assert r.feed(" more").content == "\n\n more"  # ... unless text follows
    assert r.end().content == ""


def test_a_named_tool_streams_its_arguments_and_required_reads_a_list() -> None:
    r = NamedToolReader("pick")
    first, second = r.feed('{"a"'), r.feed(": 1}")
    assert first.calls[0]["function"] == {"name": "pick", "arguments": '{"a"'} and first.calls[0]["id"]
    assert second.calls == [{"index": 0, "function": {"arguments": ": 1}"}}]
    assert NamedToolReader("pick").whole('{"a": 1') == ('{"a": 1', [])  # cut by its cap: text
    r = NamedToolReader("pick")  # the whitespace around the arguments is not sent (read whole it is stripped)
    pieces = [r.feed(t) for t in ("\n ", '{"a":', " ", "\n", "1}", "\n\n", "  ")] + [r.end()]
    assert "".join(e["function"]["arguments"] for d in pieces for e in d.calls) == '{"a": \n1}'
    assert NamedToolReader("pick").whole('\n {"a": \n1}\n\n  ')[1][0]["function"]["arguments"] == '{"a": \n1}'

    assert not NamedToolReader("pick").as_calls
    content, calls = RequiredToolReader().whole('[{"name": "f", "parameters": {"x": 1}}, {"name": "g", '
                                                '"parameters": {}}]')
    assert content is None and _named(calls) == [("f", {"x": 1}), ("g", {})]
    assert RequiredToolReader().whole('[{"name": "f", "parameters"') == ('[{"name": "f", "parameters"', [])
    assert RequiredToolReader().whole("[]") == ("[]", [])


# excerpts of real chat templates: the marks each writes a call with
QWEN = ("{%- if tools %}{{- '<|im_start|>system\\n' }}# Tools\\n<tools>{%- for tool in tools %}{{- tool | tojson }}"
        "{%- endfor %}</tools>\\n\\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags{%- endif %}")
LLAMA31 = ('{{- "<|start_header_id|>user<|end_header_id|>\\n\\n" -}}{{- "Given the following functions, please '
           'respond with a JSON for a function call with its proper arguments that best answers the given prompt.'
           '\\n\\n" }}{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument '
           'name and its value}.\' }}{%- if builtin_tools is defined %}{{- "<|python_tag|>" }}{%- endif %}')
QWEN3_CODER = ("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{%- for args_name, args_value in "
               "tool_call.arguments|items %}{{- '<parameter=' + args_name + '>\\n' }}")
MISTRAL = "{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}{%- for tool in message.tool_calls %}"
CHATML = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"


def test_qwen3_coders_values_are_typed_by_their_tools_schema() -> None:
    """A string parameter keeps its text (digits too); others are their JSON; a tool the request does not name, or
    a parameter it does not type, reads JSON where the text is JSON. As vLLM's parser: `null` is None, an integer,
    a number or a boolean reads so where its text does (`007`, `1e3`, `True`), an object may be a Python literal."""
    props = {"zip": {"type": "string"}, "n": {"type": "integer"}, "flag": {"type": "boolean"},
             "x": {"type": ["number", "null"]}, "o": {"type": "object"}, "s": {"type": "string"},
             "bad": {"type": "integer"}, "nan": {"type": "number"}, "e": {"type": "array"}}
    tools = [{"name": "f", "parameters": {"type": "object", "properties": props}}]
    values = {"zip": "01234", "n": "007", "extra": "[1, 2]", "flag": "True", "x": "1e3", "o": "{'a': True, 'b': None}",
              "s": "null", "bad": "seven", "nan": "nan", "e": "[1, 'x', (2,)]"}
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    reply = f"<tool_call>\n<function=f>\n{params}</function>\n</tool_call>"
    _, calls = model_format_reader("qwen3_coder", tools).whole(reply)
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "zip": "01234", "n": 7, "extra": [1, 2], "flag": True, "x": 1000.0, "o": {"a": True, "b": None}, "s": None,
        "bad": "seven", "nan": "nan", "e": "[1, 'x', (2,)]"}  # (a tuple is no JSON: the text)


def test_a_value_nested_past_what_json_reads_is_text_not_an_error() -> None:
    """A model's runaway brackets: Python's JSON reader raises RecursionError past its depth (a 500 before)."""
    deep = "[" * 5000 + "]" * 5000
    for fmt, reply in (("hermes", "<tool_call>" + "[" * 5000), ("hermes", '<tool_call>{"name": "f", "arguments": '
                                                                          + deep + "}</tool_call>"),
                       ("llama3_json", '{"name": "f", "parameters": ' + deep + "}"),
                       ("mistral", "[TOOL_CALLS]" + deep), ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n"
                                                          + deep + "\n</parameter>\n</function>")):
        content, calls = model_format_reader(fmt).whole(reply)
        assert (content, calls) == (reply, []) or calls and json.loads(calls[0]["function"]["arguments"]) in (
            {"a": deep},), fmt
        _streamed(model_format_reader(fmt), reply, 997)
    for reader in (NamedToolReader("f"), RequiredToolReader()):
        reader.whole('{"a": ' + deep + "}")
        _streamed(reader, '{"a": ' + deep + "}", 997)


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"zip": True, "n": {"type": "integer"}}},  # a boolean schema (JSON Schema's)
    {"type": "object", "properties": {"zip": "string", "n": {"type": "integer"}}},
    {"type": "object", "properties": ["zip", "n"]},
    ["not", "a", "schema"],
])
def test_qwen3_coders_reader_takes_any_parameters_a_tool_may_declare(parameters) -> None:
    """A tool's parameters whose properties are not all schema objects type nothing (was an AttributeError, a 500
    once the request ran): the values read as JSON where the text is JSON, as for a parameter nobody types."""
    reply = "<tool_call>\n<function=f>\n<parameter=zip>\nabc\n</parameter>\n<parameter=n>\n7\n</parameter>\n" \
            "</function>\n</tool_call>"
    _, calls = model_format_reader("qwen3_coder", [{"name": "f", "parameters": parameters}]).whole(reply)
    assert json.loads(calls[0]["function"]["arguments"]) == {"zip": "abc", "n": 7}


def test_the_format_is_the_one_the_chat_template_shows() -> None:
    assert detect(QWEN) == "hermes" and detect(LLAMA31) == "llama3_json" and detect(MISTRAL) == "mistral"
    assert detect(QWEN3_CODER) == "qwen3_coder"
    assert detect(CHATML) is None and detect(None) is None
    assert detect({"default": CHATML, "tool_use": QWEN}) == "hermes"  # a tokenizer's named templates
    assert set(PARSERS) == {"hermes", "qwen3_coder", "llama3_json", "mistral"}


def test_the_app_argument_names_the_formats_there_are() -> None:
    from typing import get_args

    from deployments.args import ServeArgs

    assert set(get_args(ServeArgs.model_fields["tool_call_parser"].annotation)) == {"auto", "none", *PARSERS}


def test_parallel_tool_calls_false_gives_the_first_call_only() -> None:
    """vLLM's: with parallel_tool_calls false, a reply of several calls (tool_choice auto) gives its first."""
    from deployments.reasoning import ReplyReader

    reply = ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
             '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    _, content, calls = ReplyReader(None, model_format_reader("hermes"), one_call=True).whole(reply)
    assert content is None and _named(calls) == [("f", {"a": 1})]
    r = ReplyReader(None, model_format_reader("hermes"), one_call=True)
    sent = [e for k in range(len(reply)) for e in r.feed(reply[k]).calls] + r.end().calls
    assert {e["index"] for e in sent} == {0} and _named(merge_calls(sent)) == [("f", {"a": 1})]
    _, _, calls = ReplyReader(None, model_format_reader("hermes")).whole(reply)
    assert len(calls) == 2


def test_arguments_that_are_no_json_leave_a_call_read_whole_as_text_and_no_lone_surrogate_is_sent() -> None:
    bad = '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>'
    assert model_format_reader("hermes").whole(bad) == (bad, [])
    _, calls = model_format_reader("qwen3_coder").whole("<tool_call><function=f><parameter=s>\"\\ud83d\"</parameter>"
                                                        "</function></tool_call>")
    _, more = model_format_reader("mistral").whole('[TOOL_CALLS]g[ARGS]{"s": "\\ud83d"}')
    for c in calls + more:  # (UTF-8 can carry no lone surrogate: it is sent as its escape)
        assert json.loads(c["function"]["arguments"]) == {"s": "\ud83d"}
        c["function"]["arguments"].encode()


def test_what_follows_a_sent_call_whose_json_broke_is_the_same_content_in_every_cut() -> None:
    """A listed call sent, then its JSON broke off (Python's quotes): the text from where it broke is content, in
    every cut of the stream (it was the rest of the piece it broke in dropped, and later pieces kept); a
    qwen3_coder integer past Python's int() digits stays text (it raised out of the reader)."""
    for fmt, reply, rest in (("mistral", "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {'a': 1}}] Done.",
                              "'a': 1}}] Done."),
                             ("llama3_json", '{"name": "f", "parameters": {"a": x}} ok', "x}} ok")):
        got = {(_streamed(model_format_reader(fmt), reply, step).content) for step in range(1, len(reply) + 1)}
        assert got == {rest}, (fmt, got)
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}]
    digits = "1" * 4301
    reply = f"<tool_call>\n<function=f>\n<parameter=n>\n{digits}\n</parameter>\n</function>\n</tool_call>"
    _, calls = model_format_reader("qwen3_coder", tools).whole(reply)
    assert json.loads(calls[0]["function"]["arguments"]) == {"n": digits}
    assert json.loads(merge_calls(_streamed(model_format_reader("qwen3_coder", tools), reply, 7).calls)[0][
        "function"]["arguments"]) == {"n": digits}


def test_a_mistral_models_calls_get_ids_its_templates_take_back_whatever_the_tool_choice():
    """Mistral's chat templates refuse a call id that is not 9 letters and digits on the next turn (a 400 for every
    second turn of a tool conversation): its own format's calls, "required"'s and a named tool's get such ids, as
    vLLM's; another model's keep OpenAI's shape."""
    from deployments.protocol import ChatCompletionRequest

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    for choice, reply in (("required", '[{"name": "f", "parameters": {"a": 1}}]'),
                          ({"type": "function", "function": {"name": "f"}}, '{"a": 1}'),
                          ("auto", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]')):
        req = ChatCompletionRequest.model_validate({**base, "tool_choice": choice})
        _, calls = req.tool_reader("mistral").whole(reply)
        assert len(calls) == 1 and re.fullmatch(r"[A-Za-z0-9]{9}", calls[0]["id"]), (choice, calls)
        if choice != "auto":
            _, calls = req.tool_reader("hermes").whole(reply)
            assert calls[0]["id"].startswith("chatcmpl-tool-")
            # a Mistral model whose app reads no format of its own (tool_call_parser none): its template's shape
            _, calls = req.tool_reader(None, model_format="mistral").whole(reply)
            assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[0]["id"]), calls
