"""Checks for Lab 00 (warm-up): parameter count, model-state bytes per optimizer, the activation crossover.

Each check compares the learner's function with the real thing: `sum(p.numel())` of real modules, and bytes
measured by `course_lib.memory.MemoryTracker` during a real optimizer step.
"""
from __future__ import annotations

import math
import numbers

import torch

from ..core.model import GPT, activation_bytes, count_parameters, get_config
from ..memory import MemoryTracker
from . import check, exercises

# The functions the lab's exercise cells define (tested against the lab), so a check run too early names its cell.
EXERCISES = {"param_count_by_hand": "Exercise 1, parameter count",
             "model_state_bytes": "Exercise 2, model-state bytes per optimizer",
             "activation_crossover": "Exercise 3, when do activations take over?"}
exercises(EXERCISES)

CONFIGS = [get_config("nano"), get_config("micro"), get_config("nano", tie_weights=True),
           get_config("nano", bias=False), get_config("micro", mlp_ratio=2, vocab_size=100, seq_len=50),
           get_config("mini", n_layer=3)]

def _expect_int(c, got, what: str) -> None:
    """A wrong type fails here with what was returned, not later as a confusing crash inside the check."""
    c.expect(isinstance(got, numbers.Integral) and not isinstance(got, bool),
             f"{what} returned {got!r} ({type(got).__name__}); it must return an int",
             hint="`return` the count; use // or math.ceil rather than /, which gives a float")


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
}


def check_param_count(fn) -> None:
    """fn(cfg) -> int must equal sum(p.numel()) of GPT(cfg) for several configs (tied, no bias, other widths)."""
    with check("param_count") as c:
        for cfg in CONFIGS:
            got, want = fn(cfg), count_parameters(GPT(cfg))
            _expect_int(c, got, "param_count_by_hand")
            c.expect(got == want, f"for {cfg} you counted {got:,}, the module has {want:,} (off by {got - want:+,})",
                     hint="per block: 4 attention projections and 2 MLP linears with biases, 2 LayerNorms with "
                          "weight and bias; tied weights count once; bias=False removes every bias")
        c.passed(f"exact for {len(CONFIGS)} configs, e.g. micro = {fn(CONFIGS[1]):,}")


def measured_state_bytes(cfg, optimizer: str) -> int:
    """Parameters + gradients + optimizer state, measured by the MemoryTracker after one real step."""
    model = GPT(cfg)
    opt = OPTIMIZERS[optimizer](model.parameters())
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with MemoryTracker(timeline=False).watch(model, opt) as mem:
        model(x, x)[1].backward()
        opt.step()                               # keep the gradients: we want all three categories alive
        cur = mem.current
        return cur["parameters"] + cur["gradients"] + cur["optimizer"]


def check_model_state_bytes(fn) -> None:
    """fn(psi, n_tensors, optimizer) -> bytes of fp32 parameters + gradients + optimizer state, exact."""
    with check("model_state_bytes") as c:
        figures = []
        for name in OPTIMIZERS:
            for cfg in (CONFIGS[0], CONFIGS[3]):
                params = list(GPT(cfg).parameters())
                psi, n = sum(p.numel() for p in params), len(params)
                got, want = fn(psi, n, name), measured_state_bytes(cfg, name)
                _expect_int(c, got, f"model_state_bytes(psi, n_tensors, {name!r})")
                c.expect(got == want, f"{name}: you predict {got:,} bytes for Ψ={psi:,} in {n} tensors; the "
                                      f"tracker measured {want:,} (off by {got - want:+,})",
                         hint="fp32 = 4 bytes; SGD keeps no state, momentum one buffer per parameter, AdamW two "
                              "(exp_avg, exp_avg_sq) plus a 4-byte `step` tensor per parameter tensor")
            figures.append(f"{name} {got / psi:.2f} B/param")
        c.passed("matches the tracker exactly: " + ", ".join(figures))


def check_activation_crossover(fn) -> None:
    """fn(cfg, seq_len, state_bytes) -> smallest batch whose activations reach state_bytes."""
    with check("activation_crossover") as c:
        cases = [(get_config("mini"), 32), (get_config("mini"), 128), (get_config("micro"), 64),
                 (get_config("nano"), 16)]
        for cfg, T in cases:
            states = 16 * count_parameters(GPT(cfg))
            got = fn(cfg, T, states)
            want = math.ceil(states / activation_bytes(cfg, 1, T))
            _expect_int(c, got, "activation_crossover")
            c.expect(got == want,
                     f"{cfg.n_layer}×{cfg.d_model}, T={T}: you said batch {got!r}, but activations first reach "
                     f"{states:,} bytes at batch {want}",
                     hint="activation_bytes(cfg, B, T) is linear in B: solve B·per_sequence >= states for the "
                          "smallest integer B")
        c.passed(f"crossover batches {[fn(cfg, T, 16 * count_parameters(GPT(cfg))) for cfg, T in cases]} "
                 f"match the formula")
