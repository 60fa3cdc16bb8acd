"""Rent or own, and energy (formulas §15.8; the SNIA Q&A's first question): for a job whose step time and size come
from the calculator, GPU-hours, its cost rented per GPU-hour vs owned (the capital per GPU — the GPU, and with
`Prices.published(system=True)` its share of the server, the network and the storage — spread over a lifetime at
some utilisation, plus power at watts × PUE × electricity price, the system's watts per GPU where the whole system
is priced), the break-even utilisation, energy in kWh, and the checkpoint storage it needs. Every price and wattage
is a `Prices` field with its source and date (defaults from data/published/hardware_and_prices.json); nothing is a
hidden constant.

    GPU-hours       G = steps × step seconds × devices / 3600
    energy          E = G × watts / 1000 × PUE                               kWh
    rent            G × r                                                   r per GPU-hour
    own             G × (P / (H·u) + watts/1000 × PUE × c)                   P capital per GPU, H lifetime hours,
                                                                            u utilisation
    break-even      u* = P / (H · (r − watts/1000 × PUE × c))                owning is cheaper above u*
    capital         P = GPU + server share + network + storage per GPU       (0 for the parts not priced)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import CalculatorError

HOURS_PER_YEAR = 365.25 * 24


@dataclass(frozen=True)
class Prices:
    rent_per_gpu_hour: float
    purchase_per_gpu: float
    lifetime_years: float
    watts: float
    pue: float
    electricity_per_kwh: float
    sources: dict = field(default_factory=dict)
    server_per_gpu: float = 0.0      # the rest of the server (CPUs, memory, NICs, chassis) per GPU
    network_per_gpu: float = 0.0     # switches and cables per GPU
    storage_per_gpu: float = 0.0

    def __post_init__(self):
        for name in ("rent_per_gpu_hour", "purchase_per_gpu", "lifetime_years", "watts", "pue",
                     "electricity_per_kwh"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not v > 0:
                raise CalculatorError(f"Prices.{name} must be a finite number > 0, got {v!r}; give the figure with "
                                      f"its source and date")
        for name in ("server_per_gpu", "network_per_gpu", "storage_per_gpu"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise CalculatorError(f"Prices.{name} must be a finite number ≥ 0 (0: not priced), got {v!r}")
        if self.pue < 1:
            raise CalculatorError(f"Prices.pue = total facility power / IT power is ≥ 1, got {self.pue}")

    @property
    def capital_per_gpu(self) -> float:
        return self.purchase_per_gpu + self.server_per_gpu + self.network_per_gpu + self.storage_per_gpu

    @property
    def power_cost_per_hour(self) -> float:
        return self.watts / 1000 * self.pue * self.electricity_per_kwh

    @classmethod
    def published(cls, gpu: str = "H100 80GB", lifetime_years: float = 5.0, system: bool = False) -> Prices:
        """The figures of data/published/hardware_and_prices.json (H100 only has rent and purchase prices there);
        `lifetime_years` is a choice (5 is a common depreciation period), not a published figure. `system`: price
        the whole system — the 8-GPU server's price ÷ 8 less the GPU's, the InfiniBand fabric and the storage per
        GPU — and its power (the server's maximum ÷ 8) instead of the GPU's alone."""
        from .published import load
        d = load("hardware_and_prices")
        if gpu != "H100 80GB":
            raise CalculatorError(f"published prices exist for 'H100 80GB' only, not {gpu!r}; pass Prices(...)")
        p, g = d["prices"], d["gpus"][gpu]
        gpu_price = p["H100 purchase per GPU"]["value"]
        extra = {}
        watts = g["watts"]
        if system:
            extra = dict(server_per_gpu=max(0.0, p["H100 8-GPU server"]["value"] / 8 - gpu_price),
                         network_per_gpu=p["InfiniBand fabric per GPU"]["value"],
                         storage_per_gpu=p["storage per GPU"]["value"])
            watts = p["H100 8-GPU system power"]["value"] / 8
        return cls(p["H100 rent per GPU-hour"]["value"], gpu_price, lifetime_years, watts, p["PUE"]["value"],
                   p["electricity"]["value"],
                   {k: f"{v['source']} ({v['date']})" for k, v in p.items()} | {
                       "watts": p["H100 8-GPU system power"]["source"] if system else g["source"],
                       "lifetime_years": "assumed"}, **extra)


def break_even_utilisation(prices: Prices) -> float:
    """The utilisation above which owning costs less per used GPU-hour than renting (> 1: renting always wins)."""
    margin = prices.rent_per_gpu_hour - prices.power_cost_per_hour
    if margin <= 0:
        return float("inf")
    return prices.capital_per_gpu / (prices.lifetime_years * HOURS_PER_YEAR * margin)


def job_cost(step_seconds: float, devices: int, steps: int, prices: Prices, *, utilisation: float = 0.5,
             checkpoint_bytes: float = 0.0, checkpoints_kept: int = 2) -> dict:
    """GPU-hours, energy, rented and owned cost of `steps` steps on `devices` devices (module docstring)."""
    for name, v in (("step_seconds", step_seconds), ("devices", devices), ("steps", steps),
                    ("utilisation", utilisation)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not v > 0:
            raise CalculatorError(f"job_cost: {name} must be a finite number > 0, got {v!r}")
    if utilisation > 1:
        raise CalculatorError(f"job_cost: utilisation is a fraction of the lifetime, ≤ 1, got {utilisation}")
    gpu_hours = steps * step_seconds * devices / 3600
    kwh = gpu_hours * prices.watts / 1000 * prices.pue
    hourly_own = prices.capital_per_gpu / (prices.lifetime_years * HOURS_PER_YEAR * utilisation) \
        + prices.power_cost_per_hour
    return {"gpu_hours": gpu_hours, "wall_hours": steps * step_seconds / 3600, "energy_kwh": kwh,
            "rent": gpu_hours * prices.rent_per_gpu_hour, "own": gpu_hours * hourly_own,
            "own_energy": kwh * prices.electricity_per_kwh, "break_even_utilisation": break_even_utilisation(prices),
            "checkpoint_storage_bytes": checkpoint_bytes * checkpoints_kept}


__all__ = ["Prices", "break_even_utilisation", "job_cost", "HOURS_PER_YEAR"]
