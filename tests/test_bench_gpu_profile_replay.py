"""bench.gpu_profile_replay: the GPU profile's fit, replayed against a synthetic 8B card, predicts its steps."""
from __future__ import annotations

import json

import pytest

from bench.gpu_profile_replay import main


def test_the_gpu_profile_fits_a_synthetic_cards_chunks_hybrid_steps_and_padding(tmp_path) -> None:
    assert main(["--seeds", "0", "--json", str(tmp_path / "r.json")]) == 0
    (row,) = json.loads((tmp_path / "r.json").read_text())["seeds"]
    assert row["mixed"] == "shared" and row["n_chunk"] > 0 and not row["budget_exhausted"]
    for key in ("chunk_2048_at_30k", "prompt_32k", "hybrid_median"):
        assert row[key] == pytest.approx(1.0, abs=0.1), key
    assert 0.85 <= row["hybrid_min"] and row["hybrid_max"] <= 1.2
    assert all(0.85 <= r <= 1.15 for r in row["off_ladder"].values())
