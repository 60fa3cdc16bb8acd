"""The calculator against published tables (data/published/, each value with its paper, table and where it was
read): ZeRO SC'20 Table 1, Korthikanti MLSys'23 Tables 2, 4 and 5, Narayanan SC'21 Tables 1 and 2, Llama 3 Table 4.
Memory is exact (or within the paper's printing); step times use at most three constants, each fitted on one
named row and never on a row it predicts."""
from dataclasses import replace

import pytest

from course_lib.calculator import published as P
from course_lib.calculator import step_time as S


def test_zero_table1_all_54_cells_within_one_unit_of_the_last_printed_digit():
    rows = P.zero_table1()
    assert len(rows) == 54
    # the paper prints 3–4 significant digits, truncating or rounding: |calculated − printed| < one unit of the last
    # printed digit (e.g. 2218.75 printed 2218, 21.5625 printed 21.6, 0.1171875 printed 0.12)
    bad = [r for r in rows if not abs(r["error"]) < r["unit"]]
    assert not bad, bad


def test_korthikanti_table2_transcription_check_six_rows_for_the_four_table3_models():
    """A check of the transcription, not a prediction (the terms are the paper's own coefficients): the predictive
    check of the same activation and recomputation model is Table 4's measured overheads, below."""
    rows = P.activation_table2()
    assert len(rows) == 24
    # integers and power-of-two divisions only (t = 8): the calculator's term-by-term sum equals the published
    # formula bit for bit
    assert all(r["calculated"] == r["published"] for r in rows), [r for r in rows if r["calculated"] != r["published"]]


def test_korthikanti_table4_recompute_overheads_from_operation_counts_within_six_points():
    rows = {r["experiment"]: r for r in P.recompute_overheads()}
    assert rows["baseline with recompute"]["predicted"] == pytest.approx(1 / 3, abs=1e-15)   # one forward of three
    # FLOP counts miss what the measured times include: memory-bound softmax/dropout reruns (selective), the
    # backward overlap full recomputation breaks, and SP's faster LayerNorm/dropout forward; stated bound 6 points
    assert all(abs(r["error"]) < 0.06 for r in rows.values()), rows
    assert rows["baseline with recompute"]["predicted"] > rows["selective recompute"]["predicted"]
    assert rows["baseline with recompute"]["published"] > rows["selective recompute"]["published"] \
        > rows["selective + sequence"]["published"]
    # the published percentages are the published milliseconds' ratios, to the printed digit
    assert all(abs(r["from_ms"] - r["published"]) < 0.005 for r in rows.values())


@pytest.fixture(scope="module")
def fitted():
    eff = P.fitted_efficiency()
    rows = P.predict(P.throughput_rows(), eff)
    return eff, rows


def test_at_most_three_constants_each_fitted_on_one_stated_row_never_on_a_predicted_one(fitted):
    eff, rows = fitted
    assert len(P.FIT_SPEC) <= 3 and len({f for f, _, _ in P.FIT_SPEC}) == len(P.FIT_SPEC)
    predicted = {(r["source"], r["key"]) for r in rows if not r["fitted"]}
    assert P.fitted_keys().isdisjoint(predicted)
    every = {(r["source"], r["key"]) for r in P.throughput_rows() + P.narayanan_table2()}
    assert P.fitted_keys() <= every
    fit_rows = P.predict([r for r in P.throughput_rows() + P.narayanan_table2()
                          if (r["source"], r["key"]) in P.fitted_keys()], eff)
    assert all(abs(r["error"]) < 1e-6 for r in fit_rows)          # each constant reproduces its own row


@pytest.fixture(scope="module")
def headline():
    return P.headline()


def test_the_headline_holds_every_published_row_once_each_marked(headline):
    rows = headline["rows"]
    keys = [(r["source"], r["key"]) for r in rows]
    assert len(keys) == len(set(keys)) == 10 + 6 + 4 + 4 + 3 + 1      # N T1, N T2, K T5 ×2, Llama 3, DeepSeek-V3
    status = {k: r["status"] for k, r in zip(keys, rows)}
    assert {k for k, v in status.items() if v == "fitted"} == P.fitted_keys()
    assert {k for k, v in status.items() if v == "equal by construction"} == set(P.BY_CONSTRUCTION)
    assert {k for k, v in status.items() if v == "post-hoc"} == set(P.POST_HOC)
    pred = [r for r in rows if r["status"] == "predicted"]
    assert headline["predicted"] == len(pred) == 28 - 3 - 1 - 2
    assert headline["average"] == pytest.approx(sum(abs(r["error"]) for r in pred) / len(pred), rel=1e-15)
    for r in rows:
        assert r["error"] == pytest.approx(r["predicted_s"] / r["published_s"] - 1, rel=1e-12)


def test_equal_by_construction_and_post_hoc_rows_are_what_their_labels_say(headline):
    by = {(r["source"], r["key"]): r for r in headline["rows"]}
    z768, z1536 = by["Narayanan SC'21 Table 2", "ZeRO-3 768"], by["Narayanan SC'21 Table 2", "ZeRO-3 1536"]
    assert z768["published_s"] == z1536["published_s"]                 # the same printed 44 TFLOP/s-derived step
    assert z768["predicted_s"] == pytest.approx(z1536["predicted_s"], rel=0.002)
    assert z768["parts"]["dp"] > z768["parts"]["compute"] and z1536["parts"]["dp"] > z1536["parts"]["compute"]
    for key in P.POST_HOC:                  # the rows missed by more than the goal before the term was added
        r = by[key]
        blind = P.step_time(r["model"], r["job"], replace(r["cluster"], memory_bandwidth=None),
                            headline["efficiency"])["total"]
        assert blind / r["published_s"] - 1 < -0.10 and f"{blind / r['published_s'] - 1:+.1%}" in r["why"]


def test_the_rows_beyond_ten_percent_are_exactly_those_with_a_stated_reason(headline):
    """The goal (issue 34) is ≤ 5 % on average and every predicted row ≤ 10 %; measured 6.8 % over 22 rows, 18
    within 10 % — not met, and the rows that miss stay with their reason. This fails both ways: a new miss without a
    reason, or a stated miss that no longer misses."""
    misses = {(r["source"], r["key"]) for r in headline["rows"] if r["status"] == "predicted"
              and abs(r["error"]) > 0.10}
    assert misses == set(P.MISS_REASONS)
    assert all(r["why"] for r in headline["rows"] if (r["source"], r["key"]) in misses)
    assert headline["within_10"] == headline["predicted"] - len(misses)
    r = next(r for r in headline["rows"] if r["key"] == "1T" and "full" not in r["source"])
    t = r["stage_times"]                    # the reason's numbers are the row's own
    assert f"{t[-1] / t[0] - 1:.0%} slower" in r["why"] and f"all {r['job'].microbatches} micro-batches" in r["why"]


def test_the_score_maps_memory_traffic_is_what_the_small_models_missed(fitted):
    """The memory-bound term has a physical size, not a fitted one (bytes counted, the device's stated bandwidth):
    a fifth of the 1.7B step, under 2 % of the 529.6B one, nothing with flash attention; with the same constants
    and no memory bandwidth stated, the 1.7B step comes out more than 15 % faster."""
    from dataclasses import replace as dc_replace
    eff, rows = fitted
    by_key = {r["key"]: r for r in rows if r["source"] == "Narayanan SC'21 Table 1"}
    small = by_key["1.7B"]
    share = S.score_map_seconds(small["model"], small["job"], small["cluster"]) / small["predicted_s"]
    assert 0.10 < share < 0.30                                    # measured ≈ 0.19 of the 1.7B step
    big = by_key["529.6B"]
    assert S.score_map_seconds(big["model"], big["job"], big["cluster"]) / big["predicted_s"] < 0.02
    flash = dc_replace(small["job"], flash_attention=True)
    assert S.score_map_bytes(small["model"], flash) == 0
    blind = dict(small, cluster=dc_replace(small["cluster"], memory_bandwidth=None))
    assert S.step_time(blind["model"], blind["job"], blind["cluster"], eff)["total"] < small["predicted_s"] * 0.85


def test_korthikanti_table5_full_recompute_rows_and_their_ratio_to_the_present_work(fitted):
    """The baseline column of Table 5 (full recomputation, no SP), predicted with the same three constants: each row
    within 10 %, and the ratio full ÷ present — where the fitted constants cancel — within 2 % of the published
    one. 2 % is what Table 4 leaves unexplained per layer: published (1 + 39 %)/(1 + 4 %) = 1.337 against the
    operation counts' (1 + 33.3 %)/(1 + 1.8 %) = 1.310 (`recompute_overheads`), 2.0 % apart."""
    eff, _ = fitted
    present = {r["key"]: r for r in P.predict(P.korthikanti_table5(), eff)}
    full = {r["key"]: r for r in P.predict(P.korthikanti_table5("full"), eff)}
    assert set(full) == set(present) == {"22B", "175B", "530B", "1T"}
    for key, r in full.items():
        assert r["job"].recompute == "full" and not r["job"].sequence_parallel
        assert abs(r["error"]) < 0.10, (key, r["error"])                  # measured: −7.8 … +8.2 %
        published = r["published_s"] / present[key]["published_s"]        # 1.29 … 1.32
        predicted = r["predicted_s"] / present[key]["predicted_s"]
        assert predicted == pytest.approx(published, rel=0.02), (key, published, predicted)   # measured ≤ 1.6 %
    with pytest.raises(ValueError, match="'present' or 'full'"):
        P.korthikanti_table5("none")


def test_narayanan_table2_zero3_falls_as_gpus_grow_while_ptdp_stays_flat():
    eff = P.fitted_efficiency()
    rows = {r["key"]: r for r in P.predict(P.narayanan_table2(), eff)}
    gpus = (384, 768, 1536)

    def tflops(key, which):
        r = rows[key]
        seconds = r["published_s"] if which == "published" else r["predicted_s"]
        return P.narayanan_flops(r["model"], r["job"].batch) / (r["job"].world * seconds) / 1e12

    for which in ("published", "predicted"):
        z = [tflops(f"ZeRO-3 {g}", which) for g in gpus]
        p = [tflops(f"PTD-P {g}", which) for g in gpus]
        assert z[0] > z[1] > z[2]                                 # ZeRO-3 falls …
        assert max(p) / min(p) < 1.10                             # … PTD-P stays within 10 %
    # the ratio PTD-P / ZeRO-3 at 1536 GPUs (published 141/44 = 3.2): within 10 %; ZeRO-3's own fall from 384 to
    # 1536 GPUs (published 144/44 = 3.3): within 25 % (the model's max(compute, comm) hides all of the 384-GPU
    # gather behind compute; the run exposed part of it)

    def ratio(which, a, b):
        return tflops(a, which) / tflops(b, which)

    assert ratio("predicted", "PTD-P 1536", "ZeRO-3 1536") == pytest.approx(
        ratio("published", "PTD-P 1536", "ZeRO-3 1536"), rel=0.10)
    assert ratio("predicted", "ZeRO-3 384", "ZeRO-3 1536") == pytest.approx(
        ratio("published", "ZeRO-3 384", "ZeRO-3 1536"), rel=0.25)


def test_every_published_value_carries_its_source():
    for name in ("zero_table1", "korthikanti", "narayanan", "llama3", "hardware_and_prices"):
        d = P.load(name)
        assert d.get("source") or name == "hardware_and_prices"
        for key, section in d.items():
            if isinstance(section, dict) and ("rows" in section or "cells" in section):
                assert section.get("read_from"), (name, key)
    for section in P.load("hardware_and_prices").values():
        assert all("source" in v for v in section.values())
