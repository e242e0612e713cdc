"""bench.host: the per-step host work benchmark runs, alone and beside another checkout's code."""
import shutil
from pathlib import Path

from bench import host

ROOT = Path(__file__).resolve().parent.parent


def test_host_bench_runs_alone_and_against_a_checkout(capsys):
    assert host.main(["--rows", "2", "--steps", "3", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert all(f"| {part} |" in out for part in ("sample", "output", "engine", "client"))
    assert host.main(["--rows", "2", "--steps", "3", "--reps", "1", "--against", str(ROOT)]) == 0
    assert "this / against" in capsys.readouterr().out


def _rows(out: str) -> dict[str, list[str]]:
    """The table's 2-row lines, by part: their cells."""
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in out.splitlines()]
    return {c[1]: c for c in cells if len(c) > 2 and c[0] == "2"}


def _copy_engine(to: Path) -> Path:
    shutil.copytree(ROOT / "engine", to / "engine", ignore=shutil.ignore_patterns("__pycache__", "assets"))
    return to


def test_against_loads_the_other_checkouts_files(tmp_path, capsys):
    other = _copy_engine(tmp_path / "other")
    code = host.Code("against", other)
    for mod in (code.sampler, code.outputs, code.stream, code.core_proc):
        assert Path(mod.__file__).is_relative_to(other)
    assert code.outputs.OutputSink is code.stream.OutputSink  # its own stream module, not this checkout's
    assert host.main(["--rows", "2", "--steps", "3", "--reps", "1", "--against", str(other)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == {"sample", "output", "engine", "client"} and all(c[3] != "-" for c in rows.values())


def test_a_checkout_older_than_token_columns_gets_no_engine_or_client_rows(tmp_path, capsys):
    other = _copy_engine(tmp_path / "old")
    (other / "engine" / "core_messages.py").unlink()
    assert host.Code("against", other).core_proc is None
    assert host.main(["--rows", "2", "--steps", "3", "--reps", "1", "--against", str(other)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == {"sample", "output", "engine", "client"}
    assert rows["engine"][3] == rows["client"][3] == "-" and rows["sample"][3] != "-"
