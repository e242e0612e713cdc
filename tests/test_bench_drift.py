"""bench.drift's estimates, on step times of known drift and jitter."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bench import drift
from bench.sim import Drift


def test_the_fit_recovers_a_drift_and_a_jitter_it_is_given():
    rng = np.random.default_rng(0)
    d = Drift(0.15, 1.0, seed=1)
    t = np.arange(0.0, 400.0, 0.002)  # a step every 2 ms for 400 s
    ms = np.array([2.0 * d.at(x) for x in t]) * np.exp(rng.normal(0.0, 0.1, len(t)))
    f = drift.fit(t, ms, window_s=0.25)
    assert f["drift"] == pytest.approx(0.15, rel=0.2)
    assert f["drift_s"] == pytest.approx(1.0, rel=0.3)
    assert f["jitter"] == pytest.approx(0.1, rel=0.25)
    assert f["median_ms"] == pytest.approx(2.0, rel=0.05)
    assert f["windows"][1]["rho"] < f["windows"][0]["rho"]


@pytest.mark.parametrize("sigma,tau,window", [(0.1, 0.5, 0.25), (0.2, 2.0, 0.25), (0.1, 1.0, 2.0)])
def test_window_averages_of_a_known_process_give_back_its_sigma_and_time_constant(sigma, tau, window):
    x = window / tau
    sd = sigma * math.sqrt(2.0 * (x - 1.0 + math.exp(-x)) / (x * x))
    rho = (1.0 - math.exp(-x)) ** 2 / (2.0 * (x - 1.0 + math.exp(-x)))
    assert drift.ou_from_windows(sd, rho, window) == pytest.approx((sigma, tau), rel=1e-6)
    assert all(math.isnan(v) for v in drift.ou_from_windows(sd, 0.0, window))


@pytest.mark.parametrize("seed", range(10))
def test_a_steady_box_has_no_drift_only_jitter(seed):
    """Window medians carry some of the steps' own scatter, and noise alone gives their correlation a small value
    either way: neither reads as drift."""
    rng = np.random.default_rng(seed)
    t = np.arange(0.0, 60.0, 0.002)
    f = drift.fit(t, np.exp(rng.normal(0.0, 0.2, len(t))), window_s=0.25)
    assert f["drift"] == 0.0 and math.isnan(f["drift_s"]) and f["jitter"] == pytest.approx(0.2, rel=0.05)


def test_nothing_timed_is_an_error_and_a_correlation_too_small_to_resolve_is_no_process():
    with pytest.raises(ValueError):
        drift.fit(np.array([]), np.array([]), window_s=0.25)
    assert all(math.isnan(v) for v in drift.ou_from_windows(0.1, 0.01, 0.25))  # tau under a twentieth of a window
