"""The decision picture with Mobius, vDNN and FlashNeuron beside notebook 07's techniques: `fits.fit_options`
extended by three rows, on the same `fits.Machine`, the same shapes and the same activation count — every number modeled
(docs/formulas.md §14.6).

    Mobius        device: one layer-stage in use + its gradients + the next arriving (3 · 2Ψ/L, bf16) and one layer's
                  activations (recomputed from its boundary); host 16Ψ + the boundaries; h2d 4Ψ (every stage in
                  forward and in backward), d2h 2Ψ per step; T = max(4/3 · compute, t_pcie(4Ψ)) + the CPU Adam step
    vDNN          device: 16Ψ (model states stay) + the activations kept; only what does not fit, X =
                  min(16Ψ + L·A − device, (L − 2)·A), goes to host memory over PCIe and back every micro-batch
                  (at least two layers stay in flight): T = compute + what the link does not hide,
                  max(0, t_pcie(X) − t_fwd) + max(0, t_pcie(X) − t_bwd) per micro-batch; host X
    FlashNeuron   the same X to the SSD instead: max(0, X/W − t_fwd) + max(0, X/R − t_bwd) per micro-batch; disk X,
                  host 0 (the point of the design: the host's memory and CPU stay free)
"""
from __future__ import annotations

from ...core.costmodel import get_link
from ...parallel.tensor.sequence import paper_activation_bytes
from ..memory_fit import Machine, fit_options, gpt_shape

_MACHINE = Machine()                # the default machine (one instance, shared by the defaults below)


def decision_options(psi: float, m: Machine = _MACHINE) -> dict:
    """`fit_options(psi, m)` plus 'Mobius', 'vDNN' and 'FlashNeuron' (the module docstring's model), each
    {'fits', 'device', 'host', 'disk', 'seconds'}."""
    out = fit_options(psi, m)
    shape = gpt_shape(psi)
    L, h, a = shape["n_layer"], shape["d_model"], shape["n_head"]
    s, b = m.seq_len, m.micro_batch_size
    layer = paper_activation_bytes(s, b, h, a)
    tokens = s * m.sequences_per_step
    compute = tokens * (6 * psi + 12 * L * s * h) / m.device_flops
    adam = psi / (m.adam_per_core * m.host_cores)
    pcie = get_link(m.pcie)
    boundaries = L * 2 * s * h * m.sequences_per_step
    dev = 3 * 2 * psi / L + layer + 2 * s * b * h
    out["Mobius"] = {"fits": dev <= m.device_bytes and 16 * psi + boundaries <= m.host_bytes, "recompute": True,
                     "device": dev, "host": 16 * psi + boundaries, "disk": 0,
                     "seconds": max(compute * 4 / 3, pcie.time(4 * psi)) + adam}
    n_micro = max(1, m.sequences_per_step // b)
    t_f, t_b = compute / 3 / n_micro, 2 * compute / 3 / n_micro
    moved = min(max(0.0, 16 * psi + L * layer - m.device_bytes), max(0, L - 2) * layer)   # only what must leave
    dev = 16 * psi + L * layer - moved
    fits = dev <= m.device_bytes
    link = max(0.0, pcie.time(moved) - t_f) + max(0.0, pcie.time(moved) - t_b) if moved else 0.0
    out["vDNN"] = {"fits": fits and moved <= m.host_bytes, "recompute": False, "device": dev, "host": moved,
                   "disk": 0, "seconds": compute + n_micro * link}
    disk = max(0.0, moved / m.disk_write - t_f) + max(0.0, moved / m.disk_read - t_b)
    out["FlashNeuron"] = {"fits": fits and moved <= m.disk_bytes, "recompute": False, "device": dev, "host": 0,
                          "disk": moved, "seconds": compute + n_micro * disk}
    return out


def best_option(psi: float, m: Machine = _MACHINE, *, exclude=()) -> str | None:
    """The fastest option that fits (None if none does), leaving out the names that start with any of `exclude`
    (e.g. 'ZeRO-3' on one device)."""
    fits = {k: v for k, v in decision_options(psi, m).items() if v["fits"] and not k.startswith(tuple(exclude))}
    return min(fits, key=lambda k: fits[k]["seconds"]) if fits else None


__all__ = ["decision_options", "best_option"]
