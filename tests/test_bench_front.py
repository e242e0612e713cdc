"""bench.front: the per-chunk work of the serving replica, alone and beside another checkout's code."""
import shutil
from pathlib import Path

from bench import front

ROOT = Path(__file__).resolve().parent.parent


def test_front_bench_runs_alone_and_against_a_checkout_without_text_chunks(tmp_path, capsys):
    assert front.main(["--chunks", "40", "--reps", "1", "--reply", "7", "--no-ray"]) == 0
    assert "| this " in capsys.readouterr().out
    other = tmp_path / "other" / "deployments"  # a checkout from before TextChunks: its _sse_item takes no `fast`
    shutil.copytree(ROOT / "deployments", other, ignore=shutil.ignore_patterns("__pycache__"))
    src = (other / "ingress.py").read_text()
    src = src.replace("class TextChunks:", "class _NoTextChunks:").replace(
        ", fast: TextChunks | None = None)", ")").replace("    if fast is not None and", "    if False and")
    (other / "ingress.py").write_text(src)
    assert "fast: TextChunks" not in src and "class TextChunks" not in src
    assert front.main(["--chunks", "40", "--reps", "1", "--kind", "completion", "--tokens", "3", "--no-ray",
                       "--against", str(tmp_path / "other")]) == 0
    out = capsys.readouterr().out
    assert "| against " in out and "this" in out.splitlines()[-1]
