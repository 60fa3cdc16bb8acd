"""Mobius on the simulated accelerator (Feng et al., ASPLOS 2023): the model's parameters in host memory, each stage
brought to the device in turn with the next one prefetched, real copies booked in a transfer log, measured compute
per stage; and the single-process reference its gradients must equal."""
from __future__ import annotations

import torch
import torch.nn as nn

from ....core.costmodel import Link
from ....core.model import (
    get_config,
)
from ....memory import alloc_category, fmt_bytes, now, placed
from ...memory_fit import DEFAULT_LINK
from ..swaps import _book, transfer_log
from .model import (
    MobiusTimeline,
    _check_bounds,
    _params,
    mobius_plan,
    mobius_timeline,
    stage_sums,
    unit_bytes,
    units_of,
)


def reference_step(cfg, batches, *, seed: int = 0) -> nn.Module:
    """The single-process reference of a Mobius step: a fresh GPT(cfg, seed), each micro-batch's loss ÷ M backward
    in turn (gradients accumulated in that order, as `MobiusExecutor.step` accumulates them)."""
    from ....core.model import GPT
    ref = GPT(cfg, seed=seed)
    for x, y in batches:
        _, loss = ref(x, y)
        (loss / len(batches)).backward()
    return ref


def random_batches(cfg, num_microbatches: int, batch_size: int = 1, *, seed: int = 0) -> list:
    """num_microbatches random (idx, targets) pairs of batch_size × seq_len tokens from a private generator."""
    g = torch.Generator().manual_seed(seed)
    c = get_config(cfg)
    return [(torch.randint(0, c.vocab_size, (batch_size, c.seq_len), generator=g),
             torch.randint(0, c.vocab_size, (batch_size, c.seq_len), generator=g)) for _ in range(num_microbatches)]


# ---------------------------------------------------------------------------------------------- the real run
class MobiusExecutor:
    """Mobius on the simulated accelerator: `model`'s parameters move to host memory (`placed('host')`); a step
    brings each stage in turn to the device, the next one copied in (prefetched) before the current one computes,
    so the device holds the stage in use and the one arriving. Forward runs without a graph; each stage's output
    (a boundary) goes to the host. Backward walks the stages in reverse, recomputes each from its boundary, runs its
    backward, and copies its gradients to the host (`host_grads`, accumulated over micro-batches in the reference's
    order). Every copy is real and booked in `log` (group 'pcie'); compute spans are measured.

    Use inside a `SimulatedAccelerator(budget).track()`: its capacity is the device budget. A budget that cannot hold
    one stage's parameters and gradients is refused before anything moves."""

    def __init__(self, model: nn.Module, bounds, *, device_bytes: int | None = None, log=None):
        self.model = model
        self.units = units_of(model)
        self.bounds = _check_bounds(bounds, len(self.units))
        self.stage_bytes = stage_sums(unit_bytes(model), self.bounds)
        if device_bytes is not None:
            one = max(2 * p for p in self.stage_bytes)
            if one > device_bytes:
                s = max(range(len(self.stage_bytes)), key=lambda i: self.stage_bytes[i])
                raise ValueError(f"device budget {fmt_bytes(device_bytes)} is smaller than one stage: stage {s} "
                                 f"(units {self.bounds[s][0]}…{self.bounds[s][1] - 1}) needs {fmt_bytes(one)} for "
                                 f"its parameters and gradients; cut it into more stages or raise the budget")
        self.log = transfer_log() if log is None else log
        self.params = [_params(sum((self.units[u] for u in range(a, b)), [])) for a, b in self.bounds]
        with placed("host"), alloc_category("parameters"):
            self.host = [[p.detach().clone() for p in ps] for ps in self.params]
        self.host_grads = [[None] * len(ps) for ps in self.params]
        for ps in self.params:
            for p in ps:
                p.data = torch.empty(0, dtype=p.dtype)
        self.forward_s = [0.0] * len(self.bounds)
        self.backward_s = [0.0] * len(self.bounds)

    @property
    def n_stages(self) -> int:
        return len(self.bounds)

    def _load(self, s: int) -> None:
        t0 = now()
        with placed("device"), alloc_category("parameters"):
            for p, h in zip(self.params[s], self.host[s]):
                p.data = torch.empty_like(h).copy_(h)
        _book(self.log, "recv", "h2d", f"stage {s}", t0, self.stage_bytes[s])

    def _drop(self, s: int) -> None:
        for p in self.params[s]:
            p.data = torch.empty(0, dtype=p.dtype)

    def _run(self, s: int, x, idx=None, targets=None, num_microbatches: int = 1):
        a, b = self.bounds[s]
        for u in range(a, b):
            if u == 0:
                x = self.model.embed(idx)
            elif u == len(self.units) - 1:
                x = self.model.loss(self.model.head(x), targets) / num_microbatches
            else:
                x = self.model.blocks[u - 1](x)
        return x

    def _to(self, t: torch.Tensor, where: str, tag: str) -> torch.Tensor:
        t0 = now()
        with placed(where), alloc_category("activations"):
            out = torch.empty_like(t).copy_(t)
        _book(self.log, "send" if where == "host" else "recv", "d2h" if where == "host" else "h2d", tag, t0,
              t.numel() * t.element_size())
        return out

    def step(self, batches, plan=None) -> float:
        """Forward and backward of every (idx, targets) micro-batch, in the order of `plan` (`mobius_plan` by
        default: see there); the gradients (mean over micro-batches) land in `host_grads`. Returns the mean loss.
        A plan that computes a stage not on the device, or stages out of order, is refused with the reason."""
        S, M = self.n_stages, len(batches)
        last = S - 1
        plan = mobius_plan(S) if plan is None else list(plan)
        self.host_grads = [[None] * len(ps) for ps in self.params]
        saved: dict = {}                                 # (stage, micro-batch) -> its input, on the host
        inputs: dict = {}                                # micro-batch -> the next stage's input, on the device
        loaded = set()
        todo = [("fwd", s) for s in range(S)] + [("bwd", s) for s in reversed(range(S))]
        leaving = None
        losses = []
        grads_in = {}                                    # micro-batch -> the gradient of the next stage's input
        for kind, s in plan:
            if not (isinstance(s, int) and 0 <= s < S) or kind not in ("load", "drop", "fwd", "bwd"):
                raise ValueError(f"plan step {(kind, s)!r}: expected ('load' | 'fwd' | 'bwd' | 'drop', stage 0…{last})")
            if kind == "load":
                self._load(s)                            # allocated now: before the compute that follows
                loaded.add(s)
                continue
            if kind == "drop":
                self._drop(s)
                loaded.discard(s)
                continue
            if s not in loaded:
                raise RuntimeError(f"the plan runs {kind} {s} but stage {s} is not on the device (load it first)")
            if not todo or todo[0] != (kind, s):
                raise RuntimeError(f"the plan runs {kind} {s} where "
                                   f"{' '.join(map(str, todo[0])) if todo else 'nothing'}"
                                   f" is due (forwards 0…S−1, then backwards S−1…0)")
            todo.pop(0)
            t0 = now()
            if kind == "fwd":                            # no graph; each output stays for the next stage and a
                with torch.no_grad():                    # copy goes to the host for the backward
                    for m, (idx, y) in enumerate(batches):
                        out = self._run(s, inputs.pop(m, None), idx, y, M)
                        if s < last:
                            saved[(s + 1, m)] = self._to(out, "host", f"boundary {s}")
                            inputs[m] = out
                        del out
                self.forward_s[s] = now() - t0
                _book(self.log, "compute", "forward", f"stage {s}", t0, group="compute")
                continue
            for m, (idx, y) in enumerate(batches):     # backward: recompute from the boundary, gradients out
                x = None if s == 0 else self._to(saved.pop((s, m)), "device", f"boundary {s - 1}").requires_grad_()
                out = self._run(s, x, idx, y, M)
                if s == last:
                    losses.append(out.detach().item() * M)
                    out.backward()
                else:
                    out.backward(grads_in.pop(m))
                if x is not None:
                    grads_in[m] = x.grad
                del x, out
            self.backward_s[s] = now() - t0
            _book(self.log, "compute", "backward", f"stage {s}", t0, group="compute")
            leaving = None                               # stage s + 1's gradients have left while s computed
            t1 = now()
            with placed("host"), alloc_category("gradients"):
                self.host_grads[s] = [p.grad.detach().clone() for p in self.params[s]]
            _book(self.log, "send", "d2h", f"grads {s}", t1, self.stage_bytes[s])
            leaving = [p.grad for p in self.params[s]]   # held until the next stage has computed (in flight)
            for p in self.params[s]:
                p.grad = None
        del leaving
        if todo:
            raise RuntimeError(f"the plan ended before {' '.join(map(str, todo[0]))}: every stage runs forward, "
                               f"then backward")
        for s in list(loaded):
            self._drop(s)
        return sum(losses) / M

    def restore(self) -> None:
        """Put the host copies back into the model (and the host gradients into `.grad`)."""
        for ps, hs, gs in zip(self.params, self.host, self.host_grads):
            for p, h, g in zip(ps, hs, gs):
                p.data = h
                p.grad = g

    def timeline(self, link: Link | str = DEFAULT_LINK, *, num_microbatches: int = 1, boundary_bytes: int = 0,
                 plan=None) -> MobiusTimeline:
        """The last step's measured compute on the modeled link."""
        return mobius_timeline(self.stage_bytes, self.forward_s, self.backward_s, boundary_bytes=boundary_bytes,
                               num_microbatches=num_microbatches, link=link, plan=plan)
