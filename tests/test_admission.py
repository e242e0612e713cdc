"""Pending-queue admission: the seeds' FIFO/pack semantics plus the per-candidate accept gate."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest

from scheduling.admission import Verdict, take_for_prefill


@dataclass
class R:
    rid: int
    prompt_token_ids: list[int]


def _queue(*sizes: int) -> deque[R]:
    return deque(R(i, [1] * n) for i, n in enumerate(sizes))


def _ids(reqs) -> list[int]:
    return [r.rid for r in reqs]


def _take(waiting, *, max_context=1024, max_reqs=8, max_tokens=4, policy="pack", lookahead=16,
          force_fifo=False, accept=None):
    return take_for_prefill(waiting, cost=lambda r: min(len(r.prompt_token_ids), max_context),
                            max_reqs=max_reqs, max_tokens=max_tokens, policy=policy, lookahead=lookahead,
                            force_fifo=force_fifo, accept=accept)


def _script(verdicts: dict[int, Verdict], calls: list[int] | None = None):
    """An accept gate answering per request id (ADMIT by default), optionally logging its calls."""
    def accept(r: R) -> Verdict:
        if calls is not None:
            calls.append(r.rid)
        return verdicts.get(r.rid, Verdict.ADMIT)
    return accept


# --- the seeds' cases ---

def test_pack_skips_oversize_head() -> None:
    q = _queue(100, 2, 2)
    assert _ids(_take(q)) == [1, 2]
    assert _ids(q) == [0]


def test_pack_progresses_when_all_oversize() -> None:
    q = _queue(100, 100)
    assert _ids(_take(q)) == [0]
    assert _ids(q) == [1]


def test_fifo_respects_budget() -> None:
    q = _queue(2, 2, 2)
    assert _ids(_take(q, policy="fifo")) == [0, 1]
    assert _ids(q) == [2]


def test_fifo_admits_single_oversize_head_alone() -> None:
    q = _queue(100, 1)
    assert _ids(_take(q, policy="fifo")) == [0]
    assert _ids(q) == [1]


@pytest.mark.parametrize("policy", ["fifo", "pack"])
def test_cost_is_capped_by_max_context(policy) -> None:
    q = _queue(100, 100)
    assert _ids(_take(q, policy=policy, max_tokens=16, max_context=8)) == [0, 1]
    assert not q


@pytest.mark.parametrize(("kwargs", "msg"), [
    ({"max_reqs": 0}, "max_reqs must be positive"),
    ({"max_tokens": 0}, "max_tokens must be positive"),
    ({"lookahead": 0}, "lookahead must be positive"),
    ({"policy": "lifo"}, "policy must be fifo|pack"),
])
def test_validates_args(kwargs, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        _take(_queue(1), **kwargs)


# --- mode selection, ordering, caps ---

def test_force_fifo_overrides_pack() -> None:
    q = _queue(100, 2, 2)
    assert _ids(_take(q, force_fifo=True)) == [0]
    assert _ids(q) == [1, 2]


def test_no_budget_means_fifo_up_to_max_reqs() -> None:
    q = _queue(100, 2, 300, 5)
    assert _ids(_take(q, max_tokens=None, max_reqs=3)) == [0, 1, 2]
    assert _ids(q) == [3]


def test_pack_output_in_queue_order_and_leftovers_keep_order() -> None:
    q = _queue(5, 1, 4, 2, 9, 1)
    # window of 5: greedy by cost picks 1 (id 1), 2 (id 3), 4 (id 2) = 7 tokens; id 5 is outside the window.
    assert _ids(_take(q, max_tokens=7, lookahead=5)) == [1, 2, 3]
    assert _ids(q) == [0, 4, 5]


@pytest.mark.parametrize("policy", ["fifo", "pack"])
def test_max_reqs_caps_the_round(policy) -> None:
    q = _queue(1, 1, 1, 1)
    assert _ids(_take(q, policy=policy, max_reqs=2, max_tokens=100)) == [0, 1]
    assert _ids(q) == [2, 3]


def test_empty_queue() -> None:
    for policy in ("fifo", "pack"):
        assert _take(deque(), policy=policy) == []


# --- the accept gate ---

@pytest.mark.parametrize("policy", ["fifo", "pack"])
def test_accept_sees_only_fitting_candidates(policy) -> None:
    calls: list[int] = []
    _take(_queue(2, 2, 2), policy=policy, accept=_script({}, calls))
    assert calls == [0, 1]


def test_pack_accept_called_in_greedy_order() -> None:
    calls: list[int] = []
    _take(_queue(100, 2, 1), accept=_script({}, calls))
    assert calls == [2, 1]


def test_fifo_keep_does_not_block_others() -> None:
    q = _queue(1, 1, 1)
    assert _ids(_take(q, policy="fifo", accept=_script({1: Verdict.KEEP}))) == [0, 2]
    assert _ids(q) == [1]


def test_fifo_keep_consumes_no_budget_and_stays_in_place() -> None:
    q = _queue(2, 2, 2, 2)
    assert _ids(_take(q, policy="fifo", accept=_script({0: Verdict.KEEP}))) == [1, 2]
    assert _ids(q) == [0, 3]


def test_fifo_drop_removes_without_consuming_budget() -> None:
    q = _queue(2, 2, 2)
    assert _ids(_take(q, policy="fifo", accept=_script({0: Verdict.DROP}))) == [1, 2]
    assert not q


def test_fifo_stop_ends_round_and_keeps_order() -> None:
    q = _queue(1, 1, 1)
    assert _ids(_take(q, policy="fifo", accept=_script({1: Verdict.STOP}))) == [0]
    assert _ids(q) == [1, 2]


def test_fifo_oversize_head_goes_through_accept() -> None:
    q = _queue(100, 1, 1)
    assert _ids(_take(q, policy="fifo", accept=_script({0: Verdict.KEEP}))) == [1, 2]
    assert _ids(q) == [0]
    q = _queue(100, 1)
    assert _ids(_take(q, policy="fifo", accept=_script({0: Verdict.DROP}))) == [1]
    assert not q


def test_pack_keep_consumes_no_budget() -> None:
    q = _queue(3, 1, 2)
    # id 1 (cost 1) is held; id 2 (cost 2) is admitted; id 0 (cost 3) no longer fits.
    assert _ids(_take(q, max_tokens=3, accept=_script({1: Verdict.KEEP}))) == [2]
    assert _ids(q) == [0, 1]


def test_pack_drop_removes_from_queue() -> None:
    q = _queue(3, 1, 2)
    assert _ids(_take(q, max_tokens=3, accept=_script({1: Verdict.DROP}))) == [2]
    assert _ids(q) == [0]


def test_pack_stop_admits_nothing_more_and_skips_fallback() -> None:
    q = _queue(100, 2, 1)
    assert _ids(_take(q, accept=_script({2: Verdict.STOP}))) == []
    assert _ids(q) == [0, 1, 2]
    q = _queue(1, 2, 1)
    assert _ids(_take(q, accept=_script({2: Verdict.STOP}))) == [0]
    assert _ids(q) == [1, 2]


def test_pack_oversize_fallback_goes_through_accept() -> None:
    q = _queue(100, 100, 100)
    assert _ids(_take(q, accept=_script({0: Verdict.DROP}))) == [1]
    assert _ids(q) == [2]
    q = _queue(100, 100)
    assert _ids(_take(q, accept=_script({0: Verdict.KEEP, 1: Verdict.KEEP}))) == []
    assert _ids(q) == [0, 1]
