"""ZeRO-Offload (Ren et al., USENIX ATC'21, arXiv 2101.06840): a mixed-precision AdamW whose fp32 state and step live
on the CPU (or, with ZeRO-Infinity's tier, on an SSD), and the one-step delayed parameter update (DPU, §5.2).

    device            2Ψ: the low-precision parameters; each gradient leaves for the host as autograd accumulates it
    link per step     2Ψ down (bf16 gradients) + 2Ψ up (bf16 parameters)  (docs/formulas.md §6.1)
    host              2Ψ gradients (4Ψ with DPU) + 12Ψ fp32 master, m, v  (tier 'host'; 'disk': in files, `disk`)

The update rule is `optim.adamw_`, the course's one AdamW step, so every tier equals the others bit for bit. Inside
ZeRO-1/2 it is `ShardedOptimizer`'s inner optimizer and sees only this rank's shards (`apply.apply_offload`).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from ...distributed.comm import Ledger
from ...memory import active_trackers, alloc_category, carry_tracking, now, placed
from ...optim import adamw_
from .disk import DiskTier
from .swaps import _book, transfer_log

TIERS = ("device", "host", "disk")


class OffloadAdam(torch.optim.Optimizer):
    """Mixed-precision AdamW whose fp32 state lives on `tier` (ZeRO-Offload: 'host'; ZeRO-Infinity: 'disk';
    'device' is the same recipe without offload, the baseline it must equal bit for bit).

        device (2Ψ)       parameters in their low precision (bf16); each gradient leaves for the host as autograd
                          accumulates it (a hook), so no full set of gradients ever sits on the device
        link (per step)   2Ψ down: the bf16 gradients · 2Ψ up: the updated parameters, cast to bf16 on the host
        host              bf16 gradients 2Ψ (4Ψ with DPU: two buffers) · fp32 master, m, v 12Ψ (tier 'host')
        disk              fp32 master, m, v 12Ψ in files, 12Ψ read and 12Ψ written per step (tier 'disk')

    The step is `adamw_` on the CPU. With `dpu=True` (after `dpu_warmup` ordinary steps) `step()` waits for the
    previous CPU step, uploads its parameters and starts this step's on a background thread, so the next forward and
    backward run on parameters one update old while the CPU works (Ren et al. 2021 §5.2). `flush()` finishes the last
    one. The master weights start from the low-precision parameters (as in mixed-precision recipes that cast the
    model first). Use as any optimizer with `train.run`; inside ZeRO-2 it is the inner optimizer of
    `ShardedOptimizer` and sees only this rank's shards (`apply_offload(model, mesh)`).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 *, tier: str = "host", master_dtype: torch.dtype = torch.float32, dpu: bool = False,
                 dpu_warmup: int = 1, grads_in_backward: bool = True, log: Ledger | None = None,
                 offload_dir: str | None = None, chunk_bytes: int = 1 << 20, durable: bool = True,
                 disk_quota: int | None = None, fault=None):
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS} (where the fp32 optimizer state lives), got {tier!r}")
        if dpu and tier == "device":
            raise ValueError("dpu=True overlaps the CPU step with the next forward and backward: it needs "
                             "tier='host' or 'disk'")
        if not isinstance(dpu_warmup, int) or dpu_warmup < 1:
            raise ValueError(f"dpu_warmup must be an integer >= 1 (ordinary steps before the delayed ones), "
                             f"got {dpu_warmup!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.tier, self.master_dtype, self.dpu, self.dpu_warmup = tier, master_dtype, dpu, dpu_warmup
        self.log = transfer_log() if log is None else log
        self.steps_done = 0                      # CPU steps completed
        self.timings: list[dict] = []            # per step: seconds of the CPU step, of the upload, waited
        self._disk_options = dict(directory=offload_dir, chunk_bytes=chunk_bytes, durable=durable,
                                  quota=disk_quota, fault=fault)
        self.disk: DiskTier | None = None
        self._host_grads: dict = {}              # param -> [bf16 host buffer] (two with DPU)
        self._fresh: set = set()                 # params whose host gradient this step has not written yet
        self._slot = 0                           # which buffer backward writes (DPU alternates)
        self._pending = None                     # the background CPU step (DPU)
        self._pool: ThreadPoolExecutor | None = None
        self._hooks = []
        self._calls = 0
        params = self._params()
        self._fresh = set(params)
        if grads_in_backward and tier != "device":
            self._hooks = [p.register_post_accumulate_grad_hook(self.grad_down) for p in params if p.requires_grad]

    def _params(self) -> list:
        return [p for g in self.param_groups for p in g["params"]]

    # ---------------------------------------------------------------- gradients go down
    def _host_grad(self, p: torch.Tensor) -> torch.Tensor:
        bufs = self._host_grads.get(p)
        if bufs is None:
            with placed("host"), alloc_category("gradients"):
                bufs = self._host_grads[p] = [torch.empty_like(p) for _ in range(2 if self.dpu else 1)]
        return bufs[self._slot]

    def grad_down(self, p: torch.Tensor) -> None:   # a hook: must return None
        g = p.grad
        for tracker in active_trackers():            # autograd allocated it as a temporary: it is a gradient
            tracker.track(g, "gradients")
        buf = self._host_grad(p)
        t0 = now()
        if p in self._fresh:
            buf.copy_(g)
            self._fresh.discard(p)
        else:                                        # gradient accumulation: the host sums the micro-batches
            buf.add_(g)
        _book(self.log, "send", "d2h", "gradients", t0, g.numel() * g.element_size())
        p.grad = None

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("OffloadAdam.step does not take a closure")
        if self.tier != "device":
            for p in self._params():                 # gradients still on the device (no hook, or a ZeRO shard)
                if p.grad is not None:
                    self.grad_down(p)
        self._calls += 1
        slot = self._slot
        stepped = [p for p in self._params() if (p.grad is not None if self.tier == "device" else
                                                  p not in self._fresh)]      # torch skips a parameter without grad
        self._fresh = set(self._params())
        if not self.dpu or self._calls <= self.dpu_warmup:
            waited = self.flush()
            timing = self.update(slot, stepped)
            timing["upload"] = self._upload(slot, stepped)
            timing["waited"] = waited
            self.timings.append(timing)
        else:
            waited = self.flush()                    # the previous step's parameters come up now
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="offload-adam")
            self._pending = (self._pool.submit(carry_tracking(self.update), slot, stepped), slot, stepped, waited)
            self._slot = 1 - slot                    # the next backward writes the other gradient buffer

    def flush(self) -> float:
        """Wait for a delayed CPU step and bring its parameters up (DPU); returns seconds waited."""
        if self._pending is None:
            return 0.0
        fut, slot, stepped, before = self._pending
        self._pending = None
        t0 = now()
        timing = fut.result()
        waited = now() - t0
        timing["upload"] = self._upload(slot, stepped)
        timing["waited"] = before + waited
        self.timings.append(timing)
        return waited

    def update(self, slot: int, stepped: list) -> dict:
        """The CPU step (any thread): Adam on the fp32 state, then the new parameters cast to the low precision,
        written into the gradient buffer the step has just consumed (no other host buffer needed)."""
        t0 = now()
        with torch.no_grad(), placed("device" if self.tier == "device" else "host"):
            if self.tier == "disk":
                self._disk_step(slot, stepped)
            else:
                todo = set(stepped)
                for group in self.param_groups:
                    for p in group["params"]:
                        if p not in todo:
                            continue
                        st = self._state(p)
                        grad = p.grad if self.tier == "device" else self._host_grads[p][slot]
                        st["step"] += 1
                        self._adam(group, st["master"], grad, st["exp_avg"], st["exp_avg_sq"], st["step"])
                        if self.tier == "device":
                            p.copy_(st["master"])
                        else:
                            grad.copy_(st["master"])         # the bf16 parameters to upload
        self.steps_done += 1
        return {"update": now() - t0}

    def _adam(self, group, master, grad, exp_avg, exp_avg_sq, step: int) -> None:
        beta1, beta2 = group["betas"]
        adamw_(master, grad.to(self.master_dtype), exp_avg, exp_avg_sq, step, lr=group["lr"],
               beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])

    def _state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:       # created at the first step, at its tier, so the memory accountant counts it there
            with placed("device" if self.tier == "device" else "host"), alloc_category("optimizer"):
                st["master"] = p.detach().to(self.master_dtype, copy=True)
                st["exp_avg"] = torch.zeros_like(st["master"])
                st["exp_avg_sq"] = torch.zeros_like(st["master"])
            st["step"] = 0                # a Python int: AdamW's counter, not 4 more bytes of state per tensor
        return st

    @torch.no_grad()
    def _upload(self, slot: int, stepped: list) -> float:
        if self.tier == "device":
            return 0.0
        start = now()
        for p in stepped:
            t0 = now()
            p.copy_(self._host_grads[p][slot])
            _book(self.log, "recv", "h2d", "parameters", t0, p.numel() * p.element_size())
        return now() - start

    def _disk_step(self, slot: int, stepped: list) -> None:
        params = self._params()
        if len(stepped) != len(params):
            raise ValueError("tier='disk' steps every parameter every step: a parameter received no gradient")
        if self.disk is None:
            self.disk = DiskTier([p.numel() for p in params], log=self.log, dtype=self.master_dtype,
                                 **self._disk_options)
            self._disk_params = params
            self.disk.initialize([p.detach() for p in params])
        group = self.param_groups[0]
        if any(g is not group and {k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} !=
               {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in self.param_groups):
            raise ValueError("tier='disk' supports one set of hyper-parameters for all parameter groups")

        def update(i, master, exp_avg, exp_avg_sq):
            p = self._disk_params[i]
            grad = self._host_grads[p][slot]
            self._adam(group, master, grad.view(-1), exp_avg, exp_avg_sq, self.steps_done + 1)
            grad.view(-1).copy_(master)
        self.disk.step(update)

    # ---------------------------------------------------------------- the rest of the optimizer interface
    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            p.grad = None

    def host_bytes(self) -> dict:
        """Bytes this optimizer keeps off the device, by what they are: {'gradients', 'optimizer'} (host) and
        'disk' (files)."""
        grads = sum(b.numel() * b.element_size() for bufs in self._host_grads.values() for b in bufs)
        opt = sum(v.numel() * v.element_size() for st in self.state.values() for v in st.values()
                  if torch.is_tensor(v)) if self.tier == "host" else 0
        return {"gradients": grads, "optimizer": opt, "disk": self.disk.file_bytes if self.disk else 0}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Finish a delayed step, stop the thread, remove the SSD tier's files. Idempotent."""
        try:
            self.flush()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self.disk is not None:
                self.disk.close()
            for h in self._hooks:
                h.remove()
            self._hooks.clear()



__all__ = ["TIERS", "OffloadAdam"]
