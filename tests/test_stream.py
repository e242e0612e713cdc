"""engine.stream.RequestStream: token items (`put_token`) read as the RequestOutputs they stand for, one at a time or
merged when the reader is behind, in order with the last item, from a thread or an event loop."""
import asyncio
import threading

import pytest

from core.messages import RequestOutput
from core.request import FinishReason
from engine.stream import RequestStream


def test_a_reader_keeping_up_gets_each_token_as_its_item():
    st = RequestStream("r")
    for i, text in enumerate(["He", "llo"]):
        st.put_token("r", text, 10 + i, 4, i + 1)
        out = st.get(timeout=1)
        assert out == RequestOutput("r", text, [10 + i], num_prompt_tokens=4, num_output_tokens=i + 1)
    st.put(RequestOutput("r", "", [], finished=True, finish_reason=FinishReason.LENGTH, num_prompt_tokens=4,
                         num_output_tokens=2))
    last = st.get(timeout=1)
    assert last.finished and last.finish_reason is FinishReason.LENGTH and st.closed


def test_a_reader_behind_gets_what_came_as_one_item_and_the_end_with_it():
    st = RequestStream("r")
    st.put_token("r", "a", 1, 3, 1)
    st.put_token("r", "b", 2, 3, 2)
    out = st.get(timeout=1)  # tokens only: one item with the last one's counts
    assert (out.text, out.token_ids, out.num_output_tokens, out.finished) == ("ab", [1, 2], 2, False)
    st.put_token("r", "c", 3, 3, 3)
    st.put(RequestOutput("r", "d", [4], num_prompt_tokens=3, num_output_tokens=4))  # an item put whole
    st.put_token("r", "e", 5, 3, 5)
    st.put(RequestOutput("r", "!", [], finished=True, finish_reason=FinishReason.STOP, stop_reason="x",
                         num_prompt_tokens=3, num_output_tokens=5))
    st.put_token("r", "late", 6, 3, 6)  # after the end: dropped
    out = st.get(timeout=1)
    assert (out.text, out.token_ids, out.num_output_tokens) == ("cde!", [3, 4, 5], 5)
    assert out.finished and out.finish_reason is FinishReason.STOP and out.stop_reason == "x"
    with pytest.raises(TimeoutError):  # nothing after the end
        st.get(timeout=0.05)


def test_an_awaiting_reader_wakes_on_a_token_put_from_another_thread():
    st = RequestStream("r")

    async def read():
        return [o async for o in st]

    def produce():
        for i in range(20):
            st.put_token("r", str(i % 10), i, 2, i + 1)
        st.put(RequestOutput("r", "", [], finished=True, finish_reason=FinishReason.LENGTH, num_prompt_tokens=2,
                             num_output_tokens=20))

    async def main():
        task = asyncio.ensure_future(read())
        await asyncio.sleep(0)
        t = threading.Thread(target=produce)
        t.start()
        outs = await asyncio.wait_for(task, 10)
        t.join()
        return outs

    outs = asyncio.run(main())
    assert [t for o in outs for t in o.token_ids] == list(range(20))
    assert "".join(o.text for o in outs) == "0123456789" * 2 and outs[-1].finished
    assert all(o.num_output_tokens == sum(len(p.token_ids) for p in outs[:k + 1]) for k, o in enumerate(outs))


def test_a_reader_that_gave_up_and_closed_its_loop_does_not_fail_the_producer():
    """A reader cancelled mid-await (a client's timeout) leaves no waiter; one whose loop closed before the producer
    woke it (the race) is skipped: the producer's put, on the engine's thread for every request, never raises."""
    st = RequestStream("r")

    async def give_up() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(st.aget(), timeout=0.01)

    asyncio.run(give_up())
    assert st._waiter is None
    loop = asyncio.new_event_loop()
    fut = loop.create_future()
    loop.close()
    st._waiter = (loop, fut, -1)  # registered on a loop that closed before the put (another thread's)
    st.put_token("r", "a", 1, 3, 1)
    st.put(RequestOutput("r", "", [], finished=True, finish_reason=FinishReason.LENGTH, num_prompt_tokens=3,
                         num_output_tokens=1))
    assert st.get(timeout=1).finished


def test_a_reply_ended_by_a_models_other_eos_names_it_as_its_stop_reason():
    """vLLM's: the tokenizer's EOS ends a reply with stop_reason None; the model's other EOS ids (its generation
    config's, here <|im_end|>) are stop tokens there, named by their id."""
    from core.request import Request
    from core.sampling import SamplingParams
    from engine.outputs import OutputProcessor
    from engine.testing import TINY_VOCAB, build_tokenizer

    tok = build_tokenizer(TINY_VOCAB)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    outputs = OutputProcessor(tok, [tok.eos_token_id, im_end])
    for i, (ended_by, named) in enumerate(((tok.eos_token_id, None), (im_end, im_end))):
        req, stream = Request(f"r{i}", [5, 6], SamplingParams(max_tokens=4)), RequestStream(f"r{i}")
        outputs.add(req, stream)
        req.finish_reason = FinishReason.STOP
        outputs.on_token(req, ended_by, FinishReason.STOP)
        outputs.finish(req, last_token=ended_by)
        assert stream.get(1).stop_reason == named


def test_a_cancel_during_wait_closed_is_never_swallowed_by_the_final_item():
    """A pacing hold (`wait_closed`) cancelled in the same loop turn as the final item is put raises CancelledError
    (with asyncio.wait_for, Python 3.11 returned instead and dropped the cancel: a client gone counted as served);
    the timeout and the final item each end the wait."""
    async def run() -> None:
        s = RequestStream("x")
        waiting = asyncio.ensure_future(s.wait_closed(5.0))
        await asyncio.sleep(0.01)
        s.put(RequestOutput("x", finished=True, finish_reason=FinishReason.LENGTH))
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert await RequestStream("y").wait_closed(0.01) is False
        t = RequestStream("z")
        later = asyncio.ensure_future(t.wait_closed(5.0))
        await asyncio.sleep(0.01)
        t.put(RequestOutput("z", finished=True, finish_reason=FinishReason.LENGTH))
        assert await asyncio.wait_for(later, 1.0) is True

    asyncio.run(run())


def test_where_one_token_completes_two_stop_strings_the_one_listed_first_ends_the_reply():
    """As vLLM's check_stop_strings: the stop strings are tried in the request's order (the earliest-starting one
    ended the reply here, at another place than vLLM's)."""
    from engine.outputs import _find_stop

    assert _find_stop("xab", ("b", "ab"), 1) == (2, "b")  # vLLM: "xa", stop_reason "b"
    assert _find_stop("xab", ("ab", "b"), 1) == (1, "ab")
    assert _find_stop("xab", ("q",), 1) is None
    assert _find_stop("abxy", ("ab",), 2) is None  # (ended before the new text: seen already)
