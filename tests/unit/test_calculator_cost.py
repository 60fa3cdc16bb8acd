"""Rent or own, and energy: GPU-hours from the calculator, costs from `Prices` (each with its source and date),
the break-even utilisation, and refusals of non-positive prices and wattages."""
import pytest

from course_lib.calculator import CalculatorError, Prices, break_even_utilisation, job_cost
from course_lib.calculator.cost import HOURS_PER_YEAR


def test_published_prices_carry_sources_and_dates():
    p = Prices.published()
    assert p.watts == 700 and p.pue == 1.58
    assert all(p.sources.get(k) for k in ("H100 rent per GPU-hour", "H100 purchase per GPU", "electricity", "PUE",
                                          "watts"))


def test_job_cost_and_break_even():
    p = Prices(2.0, 25000, 5, 700, 1.5, 0.10)
    c = job_cost(10.0, 1024, 3600, p, utilisation=0.8, checkpoint_bytes=5e12)
    assert c["gpu_hours"] == pytest.approx(10.0 * 1024)                     # 3600 steps × 10 s × 1024 / 3600
    assert c["energy_kwh"] == pytest.approx(10240 * 0.7 * 1.5)
    assert c["rent"] == pytest.approx(20480)
    power = 0.7 * 1.5 * 0.10
    assert c["own"] == pytest.approx(10240 * (25000 / (5 * HOURS_PER_YEAR * 0.8) + power))
    u = break_even_utilisation(p)
    at = job_cost(10.0, 1024, 3600, p, utilisation=u)
    assert at["own"] == pytest.approx(at["rent"], rel=1e-12)                # owning costs the same at u*
    assert job_cost(10.0, 1024, 3600, p, utilisation=min(1, 1.2 * u))["own"] < at["rent"]
    assert c["checkpoint_storage_bytes"] == 1e13


@pytest.mark.parametrize("field", ["rent_per_gpu_hour", "purchase_per_gpu", "watts", "electricity_per_kwh"])
def test_a_price_or_wattage_at_or_below_zero_is_refused(field):
    kw = dict(rent_per_gpu_hour=2.0, purchase_per_gpu=25000, lifetime_years=5, watts=700, pue=1.5,
              electricity_per_kwh=0.1)
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(CalculatorError, match=f"Prices.{field} must be a finite number > 0"):
            Prices(**dict(kw, **{field: bad}))


def test_the_whole_systems_capital_and_power_move_the_break_even():
    """Issue 34: renting vs owning priced on the GPU alone leaves out the server, the network and the storage, and
    the server's power. Each is a sourced figure (data/published/hardware_and_prices.json)."""
    gpu, system = Prices.published(), Prices.published(system=True)
    p = __import__("course_lib.calculator.published", fromlist=["load"]).load("hardware_and_prices")["prices"]
    assert system.capital_per_gpu == (p["H100 8-GPU server"]["value"] / 8 + p["InfiniBand fabric per GPU"]["value"]
                                      + p["storage per GPU"]["value"])       # the server's price includes its GPUs
    assert system.watts == p["H100 8-GPU system power"]["value"] / 8
    for prices in (gpu, system):
        margin = prices.rent_per_gpu_hour - prices.watts / 1000 * prices.pue * prices.electricity_per_kwh
        assert break_even_utilisation(prices) == pytest.approx(
            prices.capital_per_gpu / (prices.lifetime_years * HOURS_PER_YEAR * margin), rel=1e-12)
    assert break_even_utilisation(system) > 1.5 * break_even_utilisation(gpu)     # measured 0.24 → 0.43
    assert all(system.sources[k] for k in ("H100 8-GPU server", "InfiniBand fabric per GPU", "storage per GPU",
                                           "H100 8-GPU system power"))
    with pytest.raises(CalculatorError, match="storage_per_gpu must be a finite number ≥ 0"):
        Prices(2.0, 25000, 5, 700, 1.5, 0.1, storage_per_gpu=float("inf"))
