"""The single-process reference training loop. Every parallel technique in the course is compared against it:
same model (same seed), same global batches (`ShardedBatches.global_batch`), same AdamW — so losses and
parameters must agree to float rounding.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from .data import ByteTokenizer, ShardedBatches
from .model import GPT, GPTConfig, get_config


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


def make_optimizer(params, tc: TrainConfig = TrainConfig(), optimizer_cls=torch.optim.AdamW) -> torch.optim.Optimizer:
    """The course's optimizer: AdamW with the TrainConfig's hyper-parameters (one place, so every variant matches)."""
    return optimizer_cls(params, lr=tc.lr, betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay)


def train_step(model, optimizer, x, y) -> float:
    """forward → backward → step → zero_grad; returns the loss."""
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


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


def train_reference(cfg: "GPTConfig | str" = "micro", tc: TrainConfig = TrainConfig(), *, progress: bool = True,
                    model: GPT | None = None, desc: str = "reference") -> TrainResult:
    """Train on one process with the global batch; return the loss history (and the model and optimizer)."""
    cfg = get_config(cfg)
    model = model or GPT(cfg, seed=tc.seed)
    opt = make_optimizer(model.parameters(), tc)
    batches = ShardedBatches(cfg.seq_len, tc.batch_size, seed=tc.data_seed)
    losses = []
    steps = range(tc.steps)
    if progress:
        from tqdm.auto import tqdm
        steps = tqdm(steps, desc=desc, unit="step", leave=False)
    t0 = time.perf_counter()
    for step in steps:
        x, y = batches.global_batch(step)
        losses.append(train_step(model, opt, x, y))
        if progress:
            steps.set_postfix(loss=f"{losses[-1]:.3f}")
    seconds = time.perf_counter() - t0
    return TrainResult(losses, model, opt, seconds, tc.steps * tc.batch_size * cfg.seq_len)


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


def profile_training_memory(cfg: "GPTConfig | str", batch_size: int, seq_len: int | None = None, *, steps: int = 2,
                            tc: TrainConfig = TrainConfig(), capacity=None, timeline: bool = True):
    """Run `steps` training steps of a fresh model under a MemoryTracker; return (report, psi, n_param_tensors).

    Two steps by default: AdamW creates its state in the first step, so the second is the steady state.
    `capacity` (bytes or '8 MiB') turns the tracker into a simulated accelerator that raises on overflow.
    """
    from .memory import MemoryTracker

    cfg = get_config(cfg)
    if seq_len is not None:
        cfg = cfg.replace(seq_len=seq_len)
    model = GPT(cfg, seed=tc.seed)
    opt = make_optimizer(model.parameters(), tc)
    batches = ShardedBatches(cfg.seq_len, batch_size, seed=tc.data_seed)
    kwargs = {"capacity": capacity, "name": f"simulated accelerator"} if capacity is not None else {}
    with MemoryTracker(timeline=timeline, **kwargs).watch(model, opt) as mem:
        for step in range(steps):
            x, y = batches.global_batch(step)
            mem.mark(f"fwd {step}")
            _, loss = model(x, y)
            mem.mark(f"bwd {step}")
            loss.backward()
            mem.mark(f"opt {step}")
            opt.step()
            opt.zero_grad(set_to_none=True)
    params = list(model.parameters())
    return mem.report(), sum(p.numel() for p in params), len(params)
