"""bench.conformance's comparison of two servers' answers (pure: no server)."""
from bench.conformance import Answer, Case, compare, shape, shape_diff


def test_shapes_ignore_volatile_fields_and_nulls_one_side_leaves_out():
    k = {"id": "a", "system_fingerprint": "fp", "choices": [{"text": "x", "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 1}}  # (a volatile field one side has)
    v = {"id": "b", "choices": [{"text": "y", "finish_reason": "stop", "routed_experts": None}],
         "usage": {"prompt_tokens": 2, "extra": 3}}
    assert shape_diff(shape(k), shape(v)) == [".usage.extra: vLLM only (\"num\")"]


def test_compare_reports_status_param_finish_and_greedy_text():
    case = Case("c", "/v1/completions", {}, greedy=True)
    ok = Answer(200, {"choices": [{"text": "hi", "finish_reason": "stop"}]})
    assert compare(case, ok, ok) == []
    other = Answer(200, {"choices": [{"text": "ho", "finish_reason": "length"}]})
    got = compare(case, ok, other)
    assert any(d.startswith("finish reasons") for d in got) and any(d.startswith("text") for d in got)
    bad = Answer(400, {"error": {"message": "m", "param": "n"}})
    assert compare(case, ok, bad)[0].startswith("status: Kairos 200")
    assert compare(case, bad, Answer(400, {"error": {"message": "m", "param": None}})) == [
        "error param: Kairos 'n', vLLM None (vLLM: 'm')"]


def test_streams_compare_their_chunks_and_text():
    def stream(texts: list[str], finish: str) -> Answer:
        items = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in texts]
        items[-1]["choices"][0]["finish_reason"] = finish
        return Answer(200, items + ["[DONE]"], stream=True)
    case = Case("s", "/v1/completions", {}, greedy=True)
    assert compare(case, stream(["a", "b"], "stop"), stream(["", "ab"], "stop")) == []
    assert compare(case, stream(["a"], "stop"), stream(["b"], "length")) == [
        "finish reasons: Kairos ['stop'], vLLM ['length']", "text: Kairos ['a'], vLLM ['b']"]
