"""How often to checkpoint: Young's and Daly's intervals against the worked examples of Daly's paper, the exact
expected goodput against a seeded simulation of exponential failures, and the optimum against both formulas."""
from __future__ import annotations

import math

import numpy as np
import pytest

from course_lib.resilience.failures import (
    best_interval,
    daly_interval,
    expected_goodput,
    expected_time,
    simulate_goodput,
    young_interval,
)


def test_young_is_the_root_of_the_first_order_waste():
    delta, mtbf = 30.0, 3600.0

    def waste(tau):                                             # formulas §8.3, R does not move the optimum
        return delta / tau + tau / (2 * mtbf)

    tau = young_interval(delta, mtbf)
    assert tau == math.sqrt(2 * delta * mtbf)
    assert waste(tau) < min(waste(tau * 0.99), waste(tau * 1.01))


@pytest.mark.parametrize("mtbf_min, want_min", [(24 * 60, 117), (6 * 60, 57), (15, 9.1)])
def test_daly_reproduces_the_papers_worked_examples(mtbf_min, want_min):
    """Daly (FGCS 2006), δ = 5 min: 117, 57 and 9.1 minutes for M = 24 h, 6 h and 15 min (docs/formulas.md §8.3)."""
    got = daly_interval(5 * 60, mtbf_min * 60) / 60
    assert round(got, 1 if want_min < 10 else 0) == want_min


def test_daly_caps_at_the_mtbf_when_a_checkpoint_takes_longer_than_two_mtbfs():
    assert daly_interval(10.0, 4.0) == 4.0


def test_one_segment_without_failures_costs_tau_plus_delta():
    # M → ∞: (M + R)(e^(s/M) − 1) → s
    assert expected_time(100.0, 10.0, 1.0, 1e12, 5.0) == pytest.approx(110.0, rel=1e-6)


@pytest.mark.parametrize("delta, mtbf, restart, work", [(0.05, 30.0, 2.0, 300.0), (60.0, 3600.0 * 51, 600.0,
                                                                                  86400.0 * 10)])
def test_the_simulation_agrees_with_the_exact_expectation(delta, mtbf, restart, work):
    tau0 = best_interval(work, delta, mtbf, restart)
    for tau in (tau0 / 4, tau0, tau0 * 4):
        mean, se = simulate_goodput(tau, delta, mtbf, restart, work, runs=400, seed=3)
        assert abs(mean - expected_goodput(work, tau, delta, mtbf, restart)) < 5 * se


def test_the_optimum_sits_where_young_and_daly_put_it_when_delta_is_small():
    delta, mtbf, restart, work = 1.0, 3600.0, 60.0, 3600.0 * 100
    best = best_interval(work, delta, mtbf, restart)
    assert abs(daly_interval(delta, mtbf) / best - 1) < 0.01 and abs(young_interval(delta, mtbf) / best - 1) < 0.03

    def g(tau):
        return expected_goodput(work, tau, delta, mtbf, restart)

    assert g(best) >= max(g(best * 0.9), g(best * 1.1))


@pytest.mark.parametrize("work, delta, mtbf, restart", [
    (600.0, 0.068157, 30.0, 2.0),      # a golden-section search over τ stopped on the tooth at 600/320 here: 5 % off
    (600.0, 0.27160, 30.0, 2.0), (300.0, 0.05, 30.0, 2.0), (86400.0 * 10, 56.0, 180.0, 600.0), (10.0, 0.1, 30.0, 2.0),
    (100.0, 50.0, 10.0, 1.0)])
def test_the_optimum_is_the_best_whole_number_of_segments(work, delta, mtbf, restart):
    def g(tau):
        return expected_goodput(work, tau, delta, mtbf, restart)

    best = best_interval(work, delta, mtbf, restart)
    n = round(work / best)
    assert best == work / n
    young = young_interval(delta, mtbf)
    lo, hi = max(1, int(work / (5 * young))), int(5 * work / young) + 1  # every whole n with τ in √(2δM)·[⅕, 5]
    assert g(best) >= max(g(work / k) for k in range(lo, hi + 1))
    assert all(g(best) >= g(best * f) for f in np.linspace(0.5, 2, 61))                 # and no τ in between beats it


def test_daly_is_within_5_percent_of_the_optimum_whenever_delta_is_under_one_percent_of_m():
    # what notebook 10 asserts of every row, for whatever δ its machine measures: a job of 20 M, δ/M from 10⁻⁷ to 10⁻²
    mtbf, restart = 30.0, 2.0
    for delta in np.geomspace(3e-6, 0.3, 3000):
        best = best_interval(20 * mtbf, float(delta), mtbf, restart)
        assert abs(daly_interval(float(delta), mtbf) / best - 1) < 0.05, delta


def test_the_simulated_optimum_is_the_best_point_of_a_grid_within_noise():
    delta, mtbf, restart, work = 0.05, 30.0, 2.0, 300.0
    grid = np.geomspace(0.2, 10, 13)
    sims = [simulate_goodput(t, delta, mtbf, restart, work, runs=300, seed=0) for t in grid]
    i = int(np.argmax([m for m, _ in sims]))
    exact = [expected_goodput(work, t, delta, mtbf, restart) for t in grid]
    assert exact[i] > max(exact) - 4 * max(se for _, se in sims)


@pytest.mark.parametrize("bad", [0, -1.0, "1", None])
def test_bad_inputs_name_the_argument(bad):
    with pytest.raises(ValueError, match="mtbf must be a positive number of seconds"):
        young_interval(1.0, bad)
    with pytest.raises(ValueError, match="tau must be a positive number"):
        simulate_goodput(bad, 1.0, 10.0, 1.0, 100.0)
