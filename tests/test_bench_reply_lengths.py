"""bench.reply_lengths: a served model's reply lengths against the references and the length predictor."""
from __future__ import annotations

import pytest

from bench import reply_lengths as R


def test_figures_are_ratios_of_sums_medians_and_the_replies_at_the_cap():
    rows = [{"out": 50, "ref": 50, "pred": 40.0}, {"out": 64, "ref": 30, "pred": 60.0},
            {"out": 64, "ref": 120, "pred": 100.0}]
    f = R.figures_of(rows, cap=64)
    assert f["n"] == 3 and f["at_cap"] == 2  # a reply of at least the cap reached it
    assert f["replies_over_references"] == pytest.approx(178 / 200)
    assert f["replies_over_predicted"] == pytest.approx(178 / 200.0)
    assert f["references_over_predicted"] == pytest.approx(1.0)
    assert (f["median_reply"], f["median_reference"], f["median_predicted"]) == (64, 50, 60.0)


def test_the_command_line_refuses_what_cannot_run():
    with pytest.raises(SystemExit):
        R.main(["--num-prompts", "0"])
