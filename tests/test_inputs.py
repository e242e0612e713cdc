"""How a prompt becomes token ids (`engine.inputs`, `core.messages.PromptOptions`): a text prompt gets the
tokenizer's special tokens unless told otherwise, a chat prompt its template's; the chat template's generation
prompt, a continued last message and template variables, as vLLM's request fields say."""
import json

import pytest
from tokenizers.processors import TemplateProcessing

from core.messages import ChatTurn, PromptOptions
from engine.default_model import IM_END, IM_START
from engine.inputs import InputProcessor
from engine.testing import TINY_VOCAB, build_tokenizer

TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{% if not (continue_final_message and loop.last) %}{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{% endif %}{% endif %}"
    "{% if messages[0]['role'] == 'tool' %}{{ raise_exception('no tool turn first') }}{% endif %}")


@pytest.fixture(scope="module")
def bos_tokenizer():
    """The tiny tokenizer with a BOS its encode adds (as Llama's `<s> $A`)."""
    tok = build_tokenizer(TINY_VOCAB)
    bos = tok.convert_tokens_to_ids(IM_START)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{IM_START} $A", special_tokens=[(IM_START, bos)])
    tok.chat_template = TEMPLATE
    return tok


def _inputs(tok) -> InputProcessor:
    return InputProcessor(tok, len(tok), [0], max_model_len=4096, kv_capacity_tokens=1 << 20)


def test_a_text_prompt_gets_the_tokenizers_special_tokens_unless_told_not_to(bos_tokenizer):
    tok, inputs = bos_tokenizer, _inputs(bos_tokenizer)
    bos = tok.convert_tokens_to_ids(IM_START)
    plain = tok.encode("Hello world", add_special_tokens=False)
    assert inputs.process("Hello world", None, None, None).prompt_token_ids == [bos, *plain]  # as HF's tokenizer()
    assert inputs.process("Hello world", None, None, None, options=PromptOptions(add_special_tokens=False)
                          ).prompt_token_ids == plain
    assert inputs.process([5, 6], None, None, None).prompt_token_ids == [5, 6]  # token ids: as given


def test_chat_options_shape_the_prompt(bos_tokenizer):
    tok, inputs = bos_tokenizer, _inputs(bos_tokenizer)
    turns = [ChatTurn("user", "Hi"), ChatTurn("assistant", "Well,")]

    def text(options: PromptOptions, messages=turns) -> str:
        req = inputs.process(None, None, None, None, messages, options)
        return tok.decode(req.prompt_token_ids)

    opened = text(PromptOptions())
    assert opened.endswith(f"Well,{IM_END}\n{IM_START}assistant\n") and not opened.startswith(IM_START * 2)
    assert text(PromptOptions(add_special_tokens=True)).startswith(IM_START * 2)  # asked: the BOS too
    assert text(PromptOptions(add_generation_prompt=False)).endswith(f"Well,{IM_END}\n")
    assert text(PromptOptions(add_generation_prompt=False, continue_final_message=True)).endswith("assistant\nWell,")
    assert text(PromptOptions(chat_template_kwargs={"enable_thinking": False})).endswith("<think></think>")
    with pytest.raises(ValueError, match="cannot both be true"):
        text(PromptOptions(continue_final_message=True))
    assert text(PromptOptions(add_generation_prompt=False, continue_final_message=True), turns[:1]).endswith(
        "user\nHi")  # any last message continues (as HF's and vLLM's)
    with pytest.raises(ValueError, match="may not set add_generation_prompt, tokenize"):
        text(PromptOptions(chat_template_kwargs={"tokenize": True, "add_generation_prompt": False}))
    with pytest.raises(ValueError, match="chat template cannot render these messages: no tool turn first"):
        text(PromptOptions(), [ChatTurn("tool", "x")])


def test_without_a_template_the_plain_format_follows_the_options():
    tok = build_tokenizer(TINY_VOCAB)
    tok.chat_template = None
    inputs = _inputs(tok)
    turns = [ChatTurn("user", "Hi"), ChatTurn("assistant", "Well,")]

    def text(options: PromptOptions) -> str:
        return tok.decode(inputs.process(None, None, None, None, turns, options).prompt_token_ids)

    assert text(PromptOptions()) == "User: Hi\nAssistant: Well,\nAssistant:"
    assert text(PromptOptions(add_generation_prompt=False, continue_final_message=True)) == "User: Hi\nAssistant: Well,"


def test_a_text_prompt_with_a_token_past_the_embedding_rows_is_a_clear_error(bos_tokenizer):
    """A tokenizer with tokens the checkpoint has no embedding rows for (vocab_limit below len(tokenizer)): a text
    prompt that uses one is refused as a token-id prompt would be, before any step reads past the rows."""
    tok = bos_tokenizer
    top = max(tok.encode("Hello world", add_special_tokens=False))
    rows_short = InputProcessor(tok, top, [0], max_model_len=4096, kv_capacity_tokens=1 << 20)
    with pytest.raises(ValueError, match=f"token id {top}, beyond the model's {top} embedding rows") as e:
        rows_short.process("Hello world", None, None, None)
    assert str(e.value).startswith("prompt ")  # the 400's `param` (deployments.errors.param_named)
    rows_enough = InputProcessor(tok, top + 1, [0], max_model_len=4096, kv_capacity_tokens=1 << 20)
    assert max(rows_enough.process("Hello world", None, None, None).prompt_token_ids) == top


def test_a_request_arrives_before_its_prompt_is_rendered_and_tokenized(bos_tokenizer):
    """The TTFT SLO counts from when the request reached the engine's front, not from the end of its tokenization
    (vLLM's arrival time): a chat template and a long prompt take milliseconds the client waits for too."""
    import time

    from core.request import SLO

    inputs = _inputs(bos_tokenizer)
    encode = inputs.encode_special

    ran: list[float] = []

    def slow(text: str) -> list[int]:
        ran.append(time.monotonic())
        time.sleep(0.05)
        return encode(text)

    inputs.encode_special = slow
    t0 = time.monotonic()
    req = inputs.process("Hello world", None, SLO(ttft_ms=200.0), None)
    assert time.monotonic() - t0 >= 0.05
    assert t0 <= req.arrival_s <= ran[0]  # taken before the tokenizer ran
    assert req.deadline_s == pytest.approx(req.arrival_s + 0.2)


def test_a_max_tokens_beyond_the_window_is_clamped_to_what_the_window_leaves(bos_tokenizer):
    """max_tokens_over_context=clamp (an in-process engine's default): the reply ends at the window, so the request
    carries that cap, and the scheduler, which plans a reply forced to its cap (ignore_eos) for max_tokens, plans
    for the tokens it can get; min_tokens is clamped alike. Within the window max_tokens stays as given."""
    from core.sampling import SamplingParams

    tok = bos_tokenizer
    inputs = InputProcessor(tok, len(tok), [0], max_model_len=64, kv_capacity_tokens=1 << 20)
    prompt = [5] * 40
    req = inputs.process(prompt, SamplingParams(max_tokens=1000, min_tokens=500, ignore_eos=True), None, None)
    assert (req.params.max_tokens, req.params.min_tokens) == (24, 24)
    assert req.params.runs_to_cap
    req = inputs.process(prompt, SamplingParams(max_tokens=10, min_tokens=3), None, None)
    assert (req.params.max_tokens, req.params.min_tokens) == (10, 3)
    req = inputs.process(prompt, SamplingParams(max_tokens=None), None, None)
    assert req.params.max_tokens == 24  # chat's default: the rest of the window
    req = inputs.process(prompt, SamplingParams(max_tokens=None, min_tokens=24), None, None)
    assert (req.params.max_tokens, req.params.min_tokens) == (24, 24)
    with pytest.raises(ValueError, match=r"^min_tokens must be at most the context left for the reply, 24 tokens"):
        inputs.process(prompt, SamplingParams(max_tokens=None, min_tokens=25), None, None)  # vLLM's 400


def test_prompt_ids_are_what_a_generation_takes_and_detokenize_reads_them_back(bos_tokenizer):
    """vLLM's /tokenize and /detokenize: the ids of a text prompt or a chat are those `process` gives a request, and
    their text comes back whole (special tokens kept); ids outside the vocabulary are a clear error."""
    tok, inputs = bos_tokenizer, _inputs(bos_tokenizer)
    turns = [ChatTurn("user", "Hi there")]
    for prompt, messages, options in (("Hello world", None, PromptOptions()), ("Hello", None,
                                      PromptOptions(add_special_tokens=False)), (None, turns, PromptOptions())):
        ids = inputs.prompt_ids(prompt, messages, options)
        assert ids == inputs.process(prompt, None, None, None, messages, options).prompt_token_ids
    ids = inputs.prompt_ids(None, turns, PromptOptions())
    assert inputs.detokenize(ids) == f"{IM_START}user\nHi there{IM_END}\n{IM_START}assistant\n"
    with pytest.raises(ValueError, match="tokens must be integers in"):
        inputs.detokenize([1, len(tok)])


def test_tools_and_a_conversations_tool_turns_reach_the_chat_template():
    """OpenAI's tools (`PromptOptions.tools`) go to the template as `tools`; an assistant's tool calls with their
    arguments as objects (JSON text parsed, as vLLM does for templates that write them out), a tool reply's call
    id, a message's name (from the request's messages too); truncate_prompt_tokens keeps the prompt's last
    tokens."""
    import json

    from engine.inputs import render_chat

    tok = build_tokenizer(TINY_VOCAB)
    tok.chat_template = (
        "{% for t in tools or [] %}{{ t.function.name }};{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% if m.tool_calls %}={{ m.tool_calls[0].function.arguments.city }}{% endif %}"
        "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{% if m.name %}({{ m.name }}){% endif %}|"
        "{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather"}},
             {"type": "function", "function": {"name": "t2"}}]
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    turns = [ChatTurn("user", "hi"), ChatTurn("assistant", "", json.dumps(calls)), ChatTurn("tool", "21", None, "c1")]
    text = render_chat(tok, turns, PromptOptions(add_generation_prompt=False, tools=json.dumps(tools)))
    assert text == "get_weather;t2;user:hi|assistant:=Oslo|tool:21[c1]|"
    from deployments.protocol import ChatCompletionRequest

    sent = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "hi", "name": "ada"}, {"role": "tool", "content": "21", "tool_call_id": "c1",
                                                          "name": "get_weather"}]})
    assert render_chat(tok, sent.turns(), PromptOptions(add_generation_prompt=False)) == \
        "user:hi(ada)|tool:21[c1](get_weather)|"
    assert render_chat(tok, turns[:1], PromptOptions(add_generation_prompt=False)) == "user:hi|"
    own = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    assert render_chat(tok, turns[:1], PromptOptions(chat_template=own)) == "<user>hi>"  # a request's own template
    tok.chat_template = None  # (also where the tokenizer has none)
    assert render_chat(tok, turns[:1], PromptOptions(chat_template=own)) == "<user>hi>"
    with pytest.raises(ValueError, match="cannot render"):  # transformers' sandbox refuses what it must
        render_chat(tok, turns[:1], PromptOptions(chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"))
    inputs = _inputs(tok)
    whole = inputs.prompt_ids("one two three four five")
    assert inputs.prompt_ids("one two three four five", options=PromptOptions(truncate_prompt_tokens=2)) == whole[-2:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        inputs.prompt_ids("x", options=PromptOptions(truncate_prompt_tokens=0))
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens value \(4097\) is greater than max_model_len"):
        inputs.prompt_ids("x", options=PromptOptions(truncate_prompt_tokens=4097))  # (vLLM's 400)
    # a call of no arguments sent back as "", null or "null": an empty object, as vLLM gives templates (a template
    # that walks the arguments' items could not render the text)
    tok.chat_template = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}(" \
        "{% for k, v in c.function.arguments | items %}{{ k }}={{ v }}{% endfor %}){% endfor %}{% endfor %}"
    for args in ("", None, "null", " "):
        call = [{"id": "c1", "type": "function", "function": {"name": "now", "arguments": args}}]
        assert render_chat(tok, [ChatTurn("assistant", "", json.dumps(call))],
                           PromptOptions(add_generation_prompt=False)) == "now()", args


def test_a_guided_reasoning_replys_thinking_is_as_its_prompt_leaves_it():
    """A guided reply's thinking as the prompt leaves it (`InputProcessor.process`): a prompt that closed the
    thinking (a template that switched it off) holds the reply to its format from the first token; one that opened
    it starts the reply inside it; else as asked."""
    from core.sampling import SamplingParams

    inputs = _inputs(build_tokenizer(TINY_VOCAB))

    def thinking(prompt: str, asked: str) -> str | None:
        params = SamplingParams(max_tokens=4, json_object=True, thinking=asked)
        return inputs.process(prompt, params, None, None).params.thinking

    assert thinking("user: hi\nassistant: <think>\n\n</think>\n\n", "open") is None
    assert thinking("user: hi\nassistant: <think>\n", "tagged") == "open"
    assert thinking("user: hi\nassistant:", "tagged") == "tagged"
    assert thinking("user: hi\nassistant:", "open") == "open"


def test_bad_words_are_token_ids_as_vllm_makes_them():
    """A bad word's ids as at the text's start, and after a space where that gives as many with another first one
    (vLLM's rule); a word too long or past the vocabulary, or bans that leave allowed_token_ids nothing, is refused;
    one word given as a string is that word."""
    from core.sampling import SamplingParams
    from engine.inputs import MAX_BAD_WORD_TOKENS

    tok = build_tokenizer(TINY_VOCAB)
    inputs = _inputs(tok)
    for word in ("the", "Zebra", " sky"):
        bare, spaced = tuple(inputs.encode(word.strip())), tuple(inputs.encode(" " + word.strip()))
        want = [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
        assert list(inputs.bad_words_ids([word])) == want, word
    with pytest.raises(ValueError, match="bad_words"):
        inputs.bad_words_ids(["x" * (MAX_BAD_WORD_TOKENS * 8)])
    assert SamplingParams(bad_words="hello").bad_words == ("hello",)
    singles = tuple(w[0] for w in inputs.bad_words_ids(["the"]) if len(w) == 1)
    assert singles  # ("the" is a token of this tokenizer)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        inputs.process("x", SamplingParams(max_tokens=2, bad_words=("the",), allowed_token_ids=singles), None, None)
    with pytest.raises(ValueError, match="min_tokens"):
        inputs.process("x", SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=(0,)), None, None)
    # the two bans together leave nothing either (a greedy row wrote a token outside allowed_token_ids, a sampled one
    # failed)
    eos = sorted(inputs.eos_token_ids)[0]
    with pytest.raises(ValueError, match="bad_words and min_tokens"):
        inputs.process("x", SamplingParams(max_tokens=4, min_tokens=2, bad_words=("the",),
                                           allowed_token_ids=(*singles, eos)), None, None)


def test_developer_messages_are_system_ones_where_the_template_has_no_developer_role(bos_tokenizer):
    """vLLM's: OpenAI's `developer` role becomes `system` for a template that never names it, and the system
    messages are then one, first; a template that names it gets it as it is, and so does any other role."""
    tok, inputs = bos_tokenizer, _inputs(bos_tokenizer)

    def text(messages: list[ChatTurn], template: str | None = None) -> str:
        req = inputs.process(None, None, None, None, messages, PromptOptions(chat_template=template))
        return tok.decode(req.prompt_token_ids)

    got = text([ChatTurn("system", "A."), ChatTurn("user", "Hi"), ChatTurn("developer", "B.")])
    assert got.startswith(f"{IM_START}system\nA.\n\nB.{IM_END}\n{IM_START}user\nHi{IM_END}\n"), got
    assert text([ChatTurn("developer", "B."), ChatTurn("user", "Hi")]).startswith(f"{IM_START}system\nB.{IM_END}")
    knows = TEMPLATE.replace("{% for m in messages %}", "{% for m in messages %}{# 'developer' #}")
    assert text([ChatTurn("developer", "B."), ChatTurn("user", "Hi")], knows).startswith(f"{IM_START}developer\nB.")
    assert text([ChatTurn("ipython", "42"), ChatTurn("user", "Hi")]).startswith(f"{IM_START}ipython\n42{IM_END}")


def test_documents_go_to_the_chat_template(bos_tokenizer):
    """vLLM's `documents` (RAG): the chat template gets them, as HF's apply_chat_template(documents=...); a template
    that reads none ignores them."""
    tok, inputs = bos_tokenizer, _inputs(bos_tokenizer)
    rag = "{% for d in documents %}[{{ d['title'] }}: {{ d['text'] }}]{% endfor %}" + TEMPLATE
    docs = PromptOptions(chat_template=rag, documents=json.dumps([{"title": "a", "text": "b"}]))
    req = inputs.process(None, None, None, None, [ChatTurn("user", "Hi")], docs)
    assert tok.decode(req.prompt_token_ids).startswith("[a: b]")
    plain = inputs.process(None, None, None, None, [ChatTurn("user", "Hi")],
                           PromptOptions(documents=json.dumps([{"text": "b"}])))
    assert plain.prompt_token_ids == inputs.process(None, None, None, None, [ChatTurn("user", "Hi")],
                                                    PromptOptions()).prompt_token_ids


def test_the_chat_template_argument_is_a_files_text_or_a_template(tmp_path):
    """vLLM's --chat-template: a path is read (where it cannot be, or holds no template, a ValueError naming it); a
    template is taken as it is; the text read is read again as it is (the builder, the replica and the engine
    process each validate the config)."""
    from engine.config import EngineConfig, load_chat_template

    one_line = tmp_path / "t.jinja"  # (one line, a backslash, no line break at its end)
    one_line.write_text("{{ messages[0]['content'] | replace('\\'', '\"') }}")
    text = load_chat_template(str(one_line))
    assert text == one_line.read_text() == load_chat_template(text) == load_chat_template(load_chat_template(text))
    assert EngineConfig.model_validate(EngineConfig(chat_template=str(one_line)).model_dump()).chat_template == text
    assert load_chat_template("{{ 'a' }}\\n") == "{{ 'a' }}\\n" and load_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file's path"):
        EngineConfig(chat_template=str(tmp_path / "missing.jinja"))
    (tmp_path / "plain.txt").write_text("hello")
    with pytest.raises(ValueError, match="holds no Jinja template"):
        EngineConfig(chat_template=str(tmp_path / "plain.txt"))


def test_the_plain_chat_fallback_gets_the_tokenizers_bos_as_a_text_prompt_does(bos_tokenizer):
    """Without a chat template the chat is the plain `Role: content` text, which writes no BOS: a chat's default
    (add_special_tokens unset) then takes the tokenizer's, as the same text sent as a completion does (a base Llama
    without its <s> reads it worse); a template writes its own, and add_special_tokens false is kept."""
    tok = bos_tokenizer
    tok.chat_template = None
    inputs, bos = _inputs(tok), tok.convert_tokens_to_ids(IM_START)
    turns = [ChatTurn("user", "Hi")]

    def ids(options: PromptOptions) -> list[int]:
        return inputs.process(None, None, None, None, turns, options).prompt_token_ids

    assert ids(PromptOptions())[0] == bos and ids(PromptOptions()).count(bos) == 1
    assert ids(PromptOptions()) == inputs.process("User: Hi\nAssistant:", None, None, None).prompt_token_ids
    assert ids(PromptOptions(add_special_tokens=False))[0] != bos


def test_an_assistant_turns_thinking_sent_back_reaches_the_template():
    """vLLM's: an assistant message's `reasoning_content` (or its newer name, `reasoning`) goes to the chat template
    under both names (Qwen3's shows the latest turn's thinking); it was dropped."""
    from deployments.protocol import ChatCompletionRequest

    tok = build_tokenizer(TINY_VOCAB)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}:{% if m.reasoning_content %}<think>"
                         "{{ m.reasoning_content }}|{{ m.reasoning }}</think>{% endif %}{{ m['content'] }};{% endfor %}")
    for key in ("reasoning_content", "reasoning"):
        body = ChatCompletionRequest.model_validate({"messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", key: "greet back"},
            {"role": "user", "content": "Bye"}]})
        text = tok.decode(_inputs(tok).process(None, None, None, None, body.turns(), body.prompt_options())
                          .prompt_token_ids)
        assert text == "user:Hi;assistant:<think>greet back|greet back</think>Hello;user:Bye;", key


def test_the_models_reply_cap_holds_a_request_that_sets_none_within_the_context_left():
    """A checkpoint's max_new_tokens (`default_max_tokens`) caps a reply whose request sets no max_tokens, within
    the context its prompt leaves and never below its min_tokens: a cap above that context was sent as the
    request's own max_tokens, and an OpenAI server (max_tokens_over_context reject) refused every chat that set
    none with a 400 naming a max_tokens the client never sent."""
    from core.messages import ContextLengthExceeded
    from core.sampling import SamplingParams

    tok = build_tokenizer(TINY_VOCAB)
    inputs = InputProcessor(tok, len(tok), [0], max_model_len=64, kv_capacity_tokens=1 << 20,
                            reject_max_tokens_over_context=True, default_max_tokens=8192)
    prompt = "one two three"
    rest = 64 - len(inputs.prompt_ids(prompt))
    unset = SamplingParams(max_tokens=None)
    assert inputs.process(prompt, unset, None, None).params.max_tokens == rest
    inputs.default_max_tokens = 8
    assert inputs.process(prompt, unset, None, None).params.max_tokens == 8
    assert inputs.process(prompt, SamplingParams(max_tokens=None, min_tokens=10), None, None).params.max_tokens == 10
    assert inputs.process(prompt, SamplingParams(max_tokens=20), None, None).params.max_tokens == 20  # (its own)
    with pytest.raises(ContextLengthExceeded):  # (a max_tokens the client sent, past the context: vLLM's 400)
        inputs.process(prompt, SamplingParams(max_tokens=100), None, None)


def test_a_users_think_tags_do_not_say_where_the_prompt_leaves_the_thinking():
    """Where the prompt leaves the thinking is what the template writes to open the assistant's turn: a user's
    message that names `<think>` or `</think>` left the prompt's last tokens saying open or closed (a reply then read
    all as reasoning, or its thinking as content); a message the reply goes on from is the reply's own."""
    from core.sampling import SamplingParams

    tok = build_tokenizer(TINY_VOCAB)
    turns = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    for opening, want in (("", None), ("<think>\n", "open"), ("<think>\n\n</think>\n\n", "closed")):
        tok.chat_template = turns + "{% if add_generation_prompt %}<|im_start|>assistant\n" + opening + "{% endif %}"
        inputs = _inputs(tok)
        for text in ("hi", "Explain the </think> tag", "Explain <think> tags"):
            messages, options = (ChatTurn("user", text),), PromptOptions()
            ids = inputs.prompt_ids(None, messages, options)
            assert inputs.prompt_thinking(ids, messages, options) == want, (opening, text)
        guided = SamplingParams(max_tokens=4, json_object=True, thinking="tagged")
        got = inputs.process(None, guided, None, None, (ChatTurn("user", "Explain <think> tags"),)).params.thinking
        assert got == {None: "tagged", "open": "open", "closed": None}[want], opening
    continued = (ChatTurn("user", "q"), ChatTurn("assistant", "<think>\nhmm"))
    options = PromptOptions(add_generation_prompt=False, continue_final_message=True)
    assert inputs.prompt_thinking(inputs.prompt_ids(None, continued, options), continued, options) == "open"


def test_where_the_prompt_leaves_the_thinking_follows_an_earlier_messages_switch():
    """A template whose assistant turn follows from an earlier message (SmolLM3's: /no_think in the system prompt
    closes the thinking): the whole conversation says where the prompt leaves it (its last message alone read as
    none, so a deepseek_r1 reply was all reasoning, and a guided one waited for a </think> never written)."""
    from core.sampling import SamplingParams

    tok = build_tokenizer(TINY_VOCAB)
    tok.chat_template = (
        "{%- set ns = namespace(mode='think') -%}"
        "{%- for m in messages -%}{%- if m.role == 'system' and '/no_think' in m.content -%}"
        "{%- set ns.mode = 'no_think' -%}{%- endif -%}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
        "{%- if ns.mode == 'no_think' -%}<think>\n\n</think>\n{%- endif -%}{%- endif -%}")
    inputs = _inputs(tok)
    for system, want in (("Be terse. /no_think", "closed"), ("Be terse.", None)):
        messages = (ChatTurn("system", system), ChatTurn("user", "Capital of France?"))
        ids = inputs.prompt_ids(None, messages, PromptOptions())
        assert inputs.prompt_thinking(ids, messages, PromptOptions()) == want, system
        got = inputs.process(None, SamplingParams(max_tokens=4), None, None, messages, read_thinking=True)
        assert got.prompt_thinking == want, system
        guided = SamplingParams(max_tokens=4, json_object=True, thinking="open")
        assert inputs.process(None, guided, None, None, messages).params.thinking == \
            ("open" if want is None else None), system


def test_tokenize_takes_an_empty_prompt_as_vllm_does(bos_tokenizer):
    """vLLM's /tokenize: an empty prompt is its special tokens alone (a generation refuses it; /tokenize did too)."""
    from core.sampling import SamplingParams
    from deployments import protocol as P

    tok, inputs = bos_tokenizer, _inputs(bos_tokenizer)
    assert inputs.prompt_ids("", None, PromptOptions(), empty=True) == tok.encode("", add_special_tokens=True) != []
    assert inputs.prompt_ids("", None, PromptOptions(add_special_tokens=False), empty=True) == []
    with pytest.raises(ValueError, match="prompt must not be empty"):
        inputs.process("", SamplingParams(max_tokens=2), None, None)
    assert P.TokenizeCompletionRequest.model_validate({"prompt": ""}).prompt == ""


def test_a_request_asks_logprobs_up_to_the_engines_max_logprobs(bos_tokenizer):
    """vLLM's max_logprobs: 20 by default, another cap where the server sets one (-1: the vocabulary); above it a
    ValueError naming the field (a 400). The front checks the same cap once the engine has said it."""
    from core.sampling import SamplingParams
    from deployments import protocol as P

    tok = bos_tokenizer
    for cap, ok, bad in ((20, 20, 21), (100, 100, 101), (-1, len(tok), len(tok) + 1), (0, 0, 1)):
        inputs = InputProcessor(tok, len(tok), [0], max_model_len=64, kv_capacity_tokens=1 << 20, max_logprobs=cap)
        for name in ("logprobs", "prompt_logprobs"):
            inputs.process("hello", SamplingParams(max_tokens=2, **{name: ok}), None, None)
            with pytest.raises(ValueError, match=rf"^{name} must be at most {ok} \(the server's max_logprobs\)"):
                inputs.process("hello", SamplingParams(max_tokens=2, **{name: bad}), None, None)
    body = {"prompt": "x", "logprobs": 50}
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\]"):
        P.CompletionRequest.model_validate(body)
    assert P.CompletionRequest.model_validate(body, context={"max_logprobs": 64}).logprobs == 50
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30}
    assert P.ChatCompletionRequest.model_validate(chat, context={"max_logprobs": 30}).top_logprobs == 30
    with pytest.raises(ValueError, match=r"top_logprobs must be in \[0, 29\]"):
        P.ChatCompletionRequest.model_validate(chat, context={"max_logprobs": 29})
    # beam search asks twice its width's logprobs each step: its width is held to half the cap (it was to 10 whatever
    # the cap, a lower cap failing each step with an error naming logprobs, which the client never sent)
    beam = {"prompt": "x", "use_beam_search": True}
    for cap, most in ((20, 10), (4, 2), (100, 50), (1, 0)):
        if most:
            assert P.CompletionRequest.model_validate({**beam, "n": most}, context={"max_logprobs": cap}).n == most
        with pytest.raises(ValueError, match=rf"n: a beam search keeps at most {most} beams"):
            P.CompletionRequest.model_validate({**beam, "n": most + 1}, context={"max_logprobs": cap})
    assert P.CompletionRequest.model_validate({**beam, "n": 64}, context={"max_logprobs": -1}).n == 64  # (unknown)
    assert P.CompletionRequest.model_validate({**body, "logprobs": 10**6}, context={"max_logprobs": -1})  # (unknown)
    with pytest.raises(ValueError, match=r"logprobs must be >= 0, got -1"):
        P.CompletionRequest.model_validate({**body, "logprobs": -1}, context={"max_logprobs": -1})
