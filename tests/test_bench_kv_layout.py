"""bench.kv_layout: the churn through both allocators and the timing of the three layouts."""
from bench import kv_layout
from core.kv import BlockManager


def test_the_churn_leaves_the_same_requests_in_both_allocators_the_lowest_first_in_fewer_blocks():
    lowest = kv_layout.churn(BlockManager(4096, 16), rows=8, ctx=100, arrivals=400, seed=0)
    freed = kv_layout.churn(kv_layout.FreedOrderBlocks(4096, 16), rows=8, ctx=100, arrivals=400, seed=0)
    assert [n for _, n in lowest] == [n for _, n in freed] and len(lowest) == 8
    assert all(len(t) == -(-n // 16) for t, n in lowest + freed)  # each holds slots for its tokens, no more
    span = lambda lay: max(max(t) for t, _ in lay) + 1  # noqa: E731
    assert 4 * span(lowest) < span(freed)  # the freed order strews them over the cache
    blocks = [b for t, _ in kv_layout.compact(lowest) for b in t]
    assert blocks == list(range(len(blocks)))


def test_the_bench_runs(capsys):
    assert kv_layout.main(["--rows", "2", "--ctx", "20", "--arrivals", "20", "--steps", "1", "--reps", "1"]) == 0
    assert "freed / lowest" in capsys.readouterr().out
