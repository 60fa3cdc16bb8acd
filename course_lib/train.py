"""One training loop for the whole course, and the single-process reference every technique is compared against.

    run(model, optimizer, batches, steps=…, probes=[LedgerProbe(comm), MemoryProbe(), GradProbe()])

`run` is the loop every notebook, lab check, test and benchmark uses, on one process or on every rank of a mesh:

    for each step:   for each micro-batch:  forward → backward    (`no_sync()` on all but the last, if the model has it)
                     finish_gradient_synchronization()             (if the model has it: DDP's wrappers)
                     optimizer.step() → [probes see the states] → optimizer.zero_grad()

What a technique changes is the model it wraps (an `apply_<technique>`), the optimizer, or — for a
pipeline, whose schedule runs the micro-batches itself — the `step_fn`. What a notebook measures is a probe: bytes
per phase from the traffic ledger, memory by category from the memory accountant, the gradients the optimizer was
handed, compute spans for a per-rank timeline. All phases are timed on `time.perf_counter`, the ledger's clock.

The reference (`train_reference`) is `run` on one process with the whole global batch: same model (same seed),
same batches (`ShardedBatches.global_batch`), same AdamW — so losses and parameters must agree to float rounding.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from .core.data import ByteTokenizer, ShardedBatches
from .core.model import GPT, GPTConfig, get_config
from .memory import now, untracked


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 60
    batch_size: int = 16            # global batch (sequences per optimizer step)
    lr: float = 3e-3
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    seed: int = 0                   # model init
    data_seed: int = 0              # batch sampling

    def __post_init__(self):
        if self.steps < 0 or self.batch_size <= 0 or self.lr <= 0:
            raise ValueError(f"TrainConfig needs steps >= 0, batch_size > 0 and lr > 0; got steps={self.steps}, "
                             f"batch_size={self.batch_size}, lr={self.lr}")


def optimizer_kwargs(tc: TrainConfig) -> dict:
    """The TrainConfig's optimizer hyper-parameters: `course_lib.optim.build(model, **optimizer_kwargs(tc))`."""
    return dict(lr=tc.lr, betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay)


# ============================================================================================ probes
class Probe:
    """Something a run measures. Hooks: `start` (before step 0), `enter`/`exit` around every phase ('forward',
    'backward', 'sync', 'step'), `after_step` (after optimizer.step(), before zero_grad: every state is alive),
    `finish` (returns what the probe collected; must be picklable so ranks can return it)."""
    name = "probe"

    def start(self, model, optimizer) -> None: ...

    def enter(self, step: int, phase: str) -> None: ...

    def exit(self, step: int, phase: str) -> None: ...

    def after_step(self, step: int) -> None: ...

    def finish(self):
        return None

    def close(self) -> None:
        """Called on the way out even when the run failed (release trackers, hooks)."""


class LedgerProbe(Probe):
    """Bytes this rank sent per step and phase, read from the traffic ledger; optionally also marks each phase as
    a compute span in the ledger, so `plots.plot_timeline` shows it (communication inside a phase still shows on
    the lower lane). A background thread (the overlapped DDP's) may book bytes between two phases: they count for
    the phase that follows, so the phases of a step always add up to everything the step sent."""
    name = "ledger"

    def __init__(self, comm, *, spans: bool = True, groups: tuple = ()):
        self.comm, self.spans, self.groups = comm, spans, tuple(groups)
        self.phase_bytes: list[dict] = []           # per step: {phase: bytes sent during it}
        self.group_bytes: list[dict] = []           # per step: {group: bytes sent in the whole step}
        self._last = 0                              # ledger total at the end of the previous phase
        self._t0 = 0.0

    def _sent(self, group=None) -> int:
        return self.comm.ledger.bytes_sent(group=group)

    def start(self, model, optimizer):
        self._last = self._sent()

    def enter(self, step, phase):
        if len(self.phase_bytes) <= step:
            self.phase_bytes.append({})
            self.group_bytes.append({g: -self._sent(g) for g in self.groups})
        self._t0 = now()

    def exit(self, step, phase):
        sent = self._sent()
        self.phase_bytes[step][phase] = self.phase_bytes[step].get(phase, 0) + sent - self._last
        self._last = sent
        if self.spans:
            self.comm._log("compute", phase, phase, self._t0)

    def after_step(self, step):
        for g in self.groups:
            self.group_bytes[step][g] += self._sent(g)

    def finish(self):
        return {"phase_bytes": self.phase_bytes, "group_bytes": self.group_bytes,
                "step_bytes": [sum(p.values()) for p in self.phase_bytes]}


class MemoryProbe(Probe):
    """The memory accountant over the run: `watch(model, optimizer)`, a mark at each phase ('fwd 0', 'bwd 0',
    'opt 0', …), every category right after each optimizer step. `capacity` makes it a simulated accelerator."""
    name = "memory"
    _SHORT = {"forward": "fwd", "backward": "bwd", "sync": "sync", "step": "opt"}

    def __init__(self, *, capacity=None, timeline: bool = True, name: str = "simulated accelerator"):
        from .memory import MemoryTracker
        self.tracker = MemoryTracker(capacity=capacity, timeline=timeline, name=name)
        self.after: list[dict] = []
        self._entered = False

    def start(self, model, optimizer):
        self.tracker.__enter__()
        self._entered = True
        self.tracker.watch(model, optimizer if isinstance(optimizer, torch.optim.Optimizer) or
                           hasattr(optimizer, "state") else None)

    def enter(self, step, phase):
        self.tracker.mark(f"{self._SHORT.get(phase, phase)} {step}")

    def after_step(self, step):
        self.after.append(dict(self.tracker.current))

    def close(self):
        if self._entered:
            self._entered = False
            self.tracker.__exit__(None, None, None)

    def finish(self):
        self.close()
        return {"report": self.tracker.report(), "after_step": self.after}


class GradProbe(Probe):
    """The gradients the optimizer is handed at step `at_step` (after any synchronization): {name: tensor}."""
    name = "grads"

    def __init__(self, at_step: int = 0):
        self.at_step, self.grads, self._hook, self._step = at_step, {}, None, 0

    def start(self, model, optimizer):
        named = list(model.named_parameters())

        def hook(opt, args, kwargs):
            if self._step == self.at_step and not self.grads:
                with untracked():             # the probe's copies are not part of what a memory probe measures
                    self.grads.update({k: p.grad.detach().clone() for k, p in named if p.grad is not None})
        self._hook = optimizer.register_step_pre_hook(hook)

    def after_step(self, step):
        self._step = step + 1

    def close(self):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def finish(self):
        self.close()
        return self.grads


# ============================================================================================ the loop
@dataclass
class Run:
    """What `run` returns (picklable, so ranks can hand it back through `launch`)."""
    losses: list                                  # this process's loss per step (mean over its micro-batches)
    windows: list = field(repr=False)             # (t0, t1) of each step, perf_counter
    phases: list = field(repr=False)              # per step: {phase: (t0, t1)} (the last span if one repeats)
    probes: dict = field(repr=False, default_factory=dict)   # probe name -> what it collected
    params: dict = field(repr=False, default_factory=dict)   # name -> final value of this rank's parameters
                                                             # (keep_params=True; FSDP: its local shards)
    tokens: int = 0                               # tokens this process trained on

    @property
    def step_seconds(self) -> list:
        return [t1 - t0 for t0, t1 in self.windows]

    @property
    def seconds(self) -> float:
        return sum(self.step_seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    def __getitem__(self, probe: str):
        return self.probes[probe]


def forward_backward(model, batches, step: int, phase, *, sync=None) -> float:
    """The default step: every micro-batch of `step` forward and backward (gradients summed, each loss scaled by
    1/K so the sum is the mean over the K micro-batches), then the gradient synchronization of `sync` — what reduces
    the gradients: the model itself if it is a data-parallel wrapper (the default), or a ZeRO optimizer — whose
    `no_sync()` holds the reduction back until the last micro-batch."""
    K = getattr(batches, "accum_steps", 1)
    sync = model if sync is None else sync
    total = 0.0
    for micro in range(K):
        x, y = batches.get(step, micro)
        last = micro == K - 1
        with (sync.no_sync() if not last and hasattr(sync, "no_sync") else contextlib.nullcontext()):
            with phase("forward"):
                _, loss = model(x, y)
            with phase("backward"):
                (loss / K if K > 1 else loss).backward()
        total += loss.item()
    finish = getattr(sync, "finish_gradient_synchronization", None)
    if finish is not None:
        with phase("sync"):
            finish()
    return total / K


def run(model, optimizer, batches, *, steps: int, probes=(), step_fn=forward_backward, progress: bool = False,
        desc: str = "train", keep_params: bool = False) -> Run:
    """Train `steps` optimizer steps; see the module docstring. `batches` has `get(step, micro)` and `accum_steps`
    (a `ShardedBatches`; `mesh.batches(...)` gives each dp rank its share)."""
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
    probes = list(probes)
    names = [p.name for p in probes]
    if len(set(names)) != len(names):
        raise ValueError(f"two probes share a name: {names}; give each its own (set .name)")
    losses, windows, phases = [], [], []
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=steps, desc=desc, unit="step", leave=False)

    step = 0

    @contextlib.contextmanager
    def phase(name: str):
        for p in probes:
            p.enter(step, name)
        t0 = now()
        try:
            yield
        finally:
            phases[-1][name] = (t0, now())
            for p in reversed(probes):
                p.exit(step, name)

    try:
        for p in probes:
            p.start(model, optimizer)
        for step in range(steps):
            phases.append({})
            t0 = now()
            loss = step_fn(model, batches, step, phase)
            with phase("step"):
                optimizer.step()
            for p in probes:
                p.after_step(step)
            optimizer.zero_grad(set_to_none=True)
            windows.append((t0, now()))
            losses.append(float(loss))
            if bar is not None:
                # drawn with tqdm's next paced redraw: in a kernel a redraw is a widget message, and one per step
                # cost 30% of a nano step
                bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
                bar.update(1)
        results = {p.name: p.finish() for p in probes}
    finally:
        for p in probes:
            p.close()
        if bar is not None:
            bar.close()
    inner = getattr(model, "module", model)        # a wrapper's names are the wrapped model's (no 'module.' prefix)
    params = {k: v.detach().clone() for k, v in inner.named_parameters()} if keep_params else {}
    tokens = steps * getattr(batches, "accum_steps", 1) * getattr(batches, "micro_batch_size", 0) \
        * getattr(batches, "seq_len", 0)
    return Run(losses, windows, phases, results, params, tokens)


def closing(obj):
    """The one protocol for what owns a thread, hooks or files (the overlapped DDP, FSDP, activation offload, …):
    it is a context manager, and `with closing(obj):` closes it; anything else has nothing to close."""
    return obj if isinstance(obj, contextlib.AbstractContextManager) else contextlib.nullcontext()


# ============================================================================================ the reference
@dataclass
class TrainResult:
    losses: list
    model: GPT = field(repr=False)
    optimizer: torch.optim.Optimizer = field(repr=False)
    seconds: float = 0.0
    tokens: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")


def train_reference(cfg: GPTConfig | str = "micro", tc: TrainConfig = TrainConfig(), *, progress: bool = True,
                    model: GPT | None = None, desc: str = "reference") -> TrainResult:
    """Train on one process with the global batch; return the loss history (and the model and optimizer)."""
    cfg = get_config(cfg)
    model = model or GPT(cfg, seed=tc.seed)
    opt = torch.optim.AdamW(model.parameters(), **optimizer_kwargs(tc))   # torch's own: the reference
    batches = ShardedBatches(cfg.seq_len, tc.batch_size, seed=tc.data_seed)
    r = run(model, opt, batches, steps=tc.steps, progress=progress, desc=desc)
    return TrainResult(r.losses, model, opt, r.seconds, r.tokens)


@torch.no_grad()
def evaluate(model: GPT, batches: int = 4, batch_size: int = 16, seed: int = 1234) -> float:
    """Mean loss on the held-out split."""
    data = ShardedBatches(model.config.seq_len, batch_size, seed=seed, split="val")
    model.eval()
    try:
        return sum(model(*data.global_batch(i))[1].item() for i in range(batches)) / batches
    finally:
        model.train()


@torch.no_grad()
def sample(model: GPT, prompt: str = "The ", n: int = 120, temperature: float = 0.8, seed: int = 0) -> str:
    """Generate n bytes after `prompt` (to *see* that the model learned something)."""
    tok = ByteTokenizer()
    idx = tok.encode(prompt)[None, :]
    g = torch.Generator().manual_seed(seed)
    model.eval()
    try:
        for _ in range(n):
            logits, _ = model(idx[:, -model.config.seq_len:])
            probs = torch.softmax(logits[0, -1] / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=g)[None, :]], dim=1)
    finally:
        model.train()
    return tok.decode(idx[0])


def uniform_loss(vocab_size: int = 256) -> float:
    """The loss of a model that knows nothing: ln(V)."""
    return math.log(vocab_size)


def profile_training_memory(cfg: GPTConfig | str, batch_size: int, seq_len: int | None = None, *, steps: int = 2,
                            tc: TrainConfig = TrainConfig(), capacity=None, timeline: bool = True):
    """Run `steps` training steps of a fresh model under the memory accountant; return (report, psi, n_tensors).

    Two steps by default: AdamW creates its state in the first step, so the second is the steady state.
    `capacity` (bytes or '8 MiB') turns the accountant into a simulated accelerator that raises on overflow.
    """
    cfg = get_config(cfg)
    if seq_len is not None:
        cfg = cfg.replace(seq_len=seq_len)
    model = GPT(cfg, seed=tc.seed)
    # what the probe measures: AdamW, 8 B/param of state
    opt = torch.optim.AdamW(model.parameters(), **optimizer_kwargs(tc))
    batches = ShardedBatches(cfg.seq_len, batch_size, seed=tc.data_seed)
    r = run(model, opt, batches, steps=steps, probes=[MemoryProbe(capacity=capacity, timeline=timeline)])
    params = list(model.parameters())
    return r["memory"]["report"], sum(p.numel() for p in params), len(params)
