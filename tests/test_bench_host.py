"""bench.host: the per-step host work benchmark runs, alone and beside another checkout (here: itself)."""
from pathlib import Path

from bench import host

ROOT = Path(__file__).resolve().parent.parent


def test_host_bench_runs_alone_and_against_a_checkout(capsys):
    assert host.main(["--rows", "2", "--steps", "3", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert all(f"| {part} |" in out for part in ("sample", "output", "engine", "client"))
    assert host.main(["--rows", "2", "--steps", "3", "--reps", "1", "--against", str(ROOT)]) == 0
    assert "this / against" in capsys.readouterr().out
