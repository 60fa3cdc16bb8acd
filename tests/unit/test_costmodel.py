import math

import numpy as np
import pytest

from course_lib.core.costmodel import (
    PRESETS,
    Link,
    Stage,
    bus_bandwidth,
    fit_alpha_beta,
    get_link,
    naive_all_reduce_time,
    pipelined_time,
    rhd_all_reduce_time,
    ring_all_gather_time,
    ring_all_reduce_time,
)


def test_fit_recovers_known_alpha_and_beta():
    sizes = np.logspace(1, 8, 15)
    alpha, bw = 12e-6, 3e9
    times = alpha + sizes / bw
    link = fit_alpha_beta(sizes, times)
    assert math.isclose(link.alpha, alpha, rel_tol=1e-6) and math.isclose(link.bandwidth, bw, rel_tol=1e-6)
    assert link.kind == "fitted"


def test_fit_tolerates_noise_with_relative_weights():
    rng = np.random.default_rng(0)
    sizes = np.logspace(1, 8, 30)
    times = (5e-6 + sizes / 2e9) * rng.uniform(0.95, 1.05, sizes.size)
    link = fit_alpha_beta(sizes, times)
    assert 4e-6 < link.alpha < 6e-6 and 1.8e9 < link.bandwidth < 2.2e9


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError):
        fit_alpha_beta([1], [1.0])
    with pytest.raises(ValueError):
        fit_alpha_beta([1, 2], [1.0, -1.0])


def test_presets_have_sources_and_are_labelled_modeled():
    for name in ("PCIe Gen4 x16", "PCIe Gen5 x16", "NVLink 4", "InfiniBand NDR", "RoCEv2 200G", "TCP 100GbE"):
        link = PRESETS[name]
        assert link.source and link.kind == "modeled" and "modeled" in link.label()
    assert PRESETS["InfiniBand NDR"].bandwidth == 50e9 and PRESETS["PCIe Gen5 x16"].bandwidth == 63e9
    with pytest.raises(ValueError, match="presets"):
        get_link("carrier pigeon")


def test_collective_time_formulas():
    L = Link("x", 1e-5, 1e9)
    S, p = 1e8, 4
    assert math.isclose(ring_all_reduce_time(L, S, p), 2 * 3 * 1e-5 + 2 * 3 / 4 * S / 1e9)
    assert math.isclose(ring_all_gather_time(L, S, p), 3 * 1e-5 + 3 / 4 * S / 1e9)
    assert math.isclose(rhd_all_reduce_time(L, S, p), 2 * 2 * 1e-5 + 2 * 3 / 4 * S / 1e9)
    assert math.isclose(naive_all_reduce_time(L, S, p), 6 * (1e-5 + S / 1e9))
    assert ring_all_reduce_time(L, S, 1) == 0


def test_at_n_half_a_message_gets_half_the_bandwidth():
    L = Link("x", 1e-5, 1e9)
    n_half = L.half_bandwidth_size()
    assert math.isclose(n_half / L.time(n_half), L.bandwidth / 2)          # Hockney's definition of n½
    assert n_half / 10 / L.time(n_half / 10) < L.bandwidth / 10            # below it, latency-bound


def test_bus_bandwidth_factors_follow_nccl_tests():
    alg, bus = bus_bandwidth("all_reduce", 1e9, 1.0, 4)
    assert alg == 1e9 and bus == 1.5e9
    assert bus_bandwidth("all_gather", 1e9, 1.0, 4)[1] == 0.75e9
    assert bus_bandwidth("broadcast", 1e9, 2.0, 8) == (0.5e9, 0.5e9)


def test_halving_doubling_on_a_non_power_of_two_pays_the_fold():
    L = Link("x", 1e-5, 1e9)
    S = 1e6
    assert math.isclose(rhd_all_reduce_time(L, S, 6), rhd_all_reduce_time(L, S, 4) + 2 * (1e-5 + S / 1e9))


# ---------------------------------------------------------------------------- pipelines of stages
S = 1e9
PCIE, WIRE = Link("PCIe Gen5 x16", 1e-6, 63e9), Link("InfiniBand NDR", 1e-6, 50e9)


def test_one_chunk_is_store_and_forward():
    stages = [Stage("staging", PCIE), Stage("wire", WIRE)]
    assert math.isclose(pipelined_time(stages, S, 1), 1e-6 + 1 / 63 + 1e-6 + 1 / 50, rel_tol=1e-12)


def test_two_latency_free_stages_follow_the_closed_form_speedup():
    # staging at r·B, wire at B, α = 0: serial / pipelined = k(1 + 1/r) / (k + 1/r), derived on paper (lab 01)
    r, k = 63 / 50, 16
    stages = [Stage("staging", Link("copy engine", 0.0, r * 1e9)), Stage("wire", Link("wire", 0.0, 1e9))]
    speedup = pipelined_time(stages, S, 1) / pipelined_time(stages, S, k)
    assert math.isclose(speedup, k * (1 + 1 / r) / (k + 1 / r), rel_tol=1e-12)


def test_more_chunks_approach_but_never_beat_the_slowest_stage():
    stages = [Stage("staging", PCIE), Stage("wire", WIRE), Stage("staging", PCIE)]
    times = [pipelined_time(stages, S, k) for k in (1, 4, 16, 64, 256)]
    assert all(a > b for a, b in zip(times, times[1:])) and all(t >= S / 50e9 for t in times)
    assert times[-1] - S / 50e9 < 0.02 * S / 50e9


def test_chunks_cost_alpha_each_so_a_single_stage_only_gets_slower():
    k = 100
    assert math.isclose(pipelined_time([Stage("wire", WIRE)], S, k) - pipelined_time([Stage("wire", WIRE)], S, 1),
                        (k - 1) * 1e-6, rel_tol=1e-6)


def test_zero_chunks_is_refused():
    with pytest.raises(ValueError):
        pipelined_time([Stage("wire", WIRE)], S, 0)
