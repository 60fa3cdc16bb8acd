"""The course's toy GPT: a decoder-only transformer small enough for a laptop CPU.

Architecture follows GPT-2 (Radford et al., 2019) as written in nanoGPT (Karpathy, `model.py`): token + position
embedding, pre-LayerNorm blocks of causal multi-head attention and a GELU MLP, final LayerNorm, LM head.
Attention is written out as matmuls + softmax (no fused kernel) so every activation is visible and countable.

Checked against:
  * parameter count   N = V·d + T·d + L·(12d² + 13d) + 2d + V·d·[untied]     (with biases; `param_count`)
  * training FLOPs     per token = 6·N_matmul + 12·L·T·d                       (`train_flops_per_token`;
    N_matmul = weights of every Linear, LM head included; the 12·L·T·d term is QKᵀ and A·V, forward + 2× backward,
    as in the PaLM paper's appendix B; the test counts matmul FLOPs with torch's FlopCounterMode and finds it exact.)
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256     # byte-level tokenizer (course_lib.core.data)
    seq_len: int = 64         # context length T
    n_layer: int = 2          # L
    n_head: int = 2
    d_model: int = 32         # d (hidden size h in the Megatron papers)
    mlp_ratio: int = 4        # MLP hidden = mlp_ratio * d_model
    bias: bool = True
    tie_weights: bool = False  # share the token embedding with the LM head (GPT-2 does)
    dropout: float = 0.0       # GPT-2's four dropouts (embedding, attention, two residual); 0 = none, as before
    n_expert: int = 0          # > 0: every block's MLP is a mixture of experts (course_lib.core.moe, notebook 12)
    top_k: int = 1             # experts per token
    capacity_factor: float = 1.25   # slots per expert = ⌈factor · k · tokens / E⌉ per group
    aux_loss_coef: float = 0.01     # weight of the load-balancing loss in the training loss (Switch: 0.01)

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig: n_head={self.n_head} must divide d_model={self.d_model} "
                             f"(each head gets d_model/n_head dimensions); try n_head in "
                             f"{[h for h in range(1, self.d_model + 1) if self.d_model % h == 0][:8]}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"GPTConfig.dropout is a probability in [0, 1), got {self.dropout!r}")
        if self.n_expert:
            from .moe import check_moe
            check_moe(self.n_expert, self.top_k, self.capacity_factor)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def replace(self, **changes) -> GPTConfig:
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, GPTConfig] = {
    "nano":   GPTConfig(seq_len=64,  n_layer=2, n_head=2, d_model=32),    # ~44 K  (unit tests, multi-rank tests)
    "micro":  GPTConfig(seq_len=128, n_layer=4, n_head=4, d_model=64),    # ~241 K (notebook default)
    "mini":   GPTConfig(seq_len=128, n_layer=4, n_head=4, d_model=128),   # ~0.88 M
    "small":  GPTConfig(seq_len=256, n_layer=6, n_head=8, d_model=256),   # ~4.9 M
    "medium": GPTConfig(seq_len=256, n_layer=8, n_head=8, d_model=448),   # ~19.7 M
}


def get_config(name_or_config: str | GPTConfig, **overrides) -> GPTConfig:
    """A preset by name (optionally with fields overridden), or a config passed through."""
    if isinstance(name_or_config, GPTConfig):
        return name_or_config.replace(**overrides) if overrides else name_or_config
    try:
        base = PRESETS[name_or_config]
    except KeyError:
        raise ValueError(f"unknown preset {name_or_config!r}; choose one of {sorted(PRESETS)}") from None
    return base.replace(**overrides) if overrides else base


# ----------------------------------------------------------------------------------------------- modules
class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v projections, so tensor parallelism can split heads.

    Names used by the tensor-parallel notebook (Megatron, SC'21 §2.3): wq, wk, wv are column-parallel, wo row-parallel.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.wq = nn.Linear(d, d, bias=cfg.bias)
        self.wk = nn.Linear(d, d, bias=cfg.bias)
        self.wv = nn.Linear(d, d, bias=cfg.bias)
        self.wo = nn.Linear(d, d, bias=cfg.bias)
        self.attn_drop = nn.Dropout(cfg.dropout)     # on the attention probabilities (GPT-2's attn_dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)    # on the output projection (GPT-2's resid_dropout)
        self.register_buffer("mask", torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape                                   # (B, T, d)
        nh = self.n_head
        hs = C // nh if nh else C
        # Under tensor parallelism wq/wk/wv hold only this rank's heads; the width tells how many.
        local = self.wq.out_features
        nh_local = local // hs
        q = self.wq(x).view(B, T, nh_local, hs).transpose(1, 2)   # (B, nh, T, hs)
        k = self.wk(x).view(B, T, nh_local, hs).transpose(1, 2)   # (B, nh, T, hs)
        v = self.wv(x).view(B, T, nh_local, hs).transpose(1, 2)   # (B, nh, T, hs)
        y = self.attend(q, k, v)                                   # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, local)                 # (B, T, d_local)
        return self.resid_drop(self.wo(y))                         # (B, T, d)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core softmax(q·kᵀ/√hs + causal mask)·v; context parallelism replaces it per instance
        (`course_lib.parallel.context.apply_cp`) with ring attention over the tokens of every cp rank."""
        T = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))   # (B, nh, T, T)
        att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)                               # (B, nh, T, T)
        att = self.attn_drop(att)
        return att @ v                                             # (B, nh, T, hs)


class MLP(nn.Module):
    """d -> mlp_ratio·d -> GELU -> d. fc_in is column-parallel and fc_out row-parallel under Megatron TP."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.fc_in = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.fc_out = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc_out(F.gelu(self.fc_in(x))))    # (B, T, 4d) inside, (B, T, d) out


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg) if not cfg.n_expert else _moe(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


# Which linears tensor parallelism splits, and how (Megatron 1D): the names are relative to a Block.
TP_PLAN = {"attn.wq": "column", "attn.wk": "column", "attn.wv": "column", "attn.wo": "row",
           "mlp.fc_in": "column", "mlp.fc_out": "row"}


class GPT(nn.Module):
    """Toy GPT. `forward(idx, targets)` returns (logits, loss). Pieces are exposed for pipeline stages:
    `embed(idx)`, `blocks[i]`, `head(x)`, `loss(logits, targets)`; `stage_bounds(n)` cuts the blocks into
    contiguous stages."""

    def __init__(self, cfg: GPTConfig | str = "nano", *, seed: int = 0):
        super().__init__()
        cfg = get_config(cfg)
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """GPT-2 init from a private generator, so the same seed gives the same model in every process."""
        g = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)   # GPT-2: scale residual projections
        for name, p in self.named_parameters():                 # deterministic order; tied weights appear once
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith(("attn.wo.weight", "fc_out.weight")) else 0.02   # (experts' too)
                p.copy_(torch.randn(p.shape, generator=g) * std)

    # pieces, so pipeline stages can run a slice of the model
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.seq_len:
            raise ValueError(f"sequence of length {T} is longer than the model's seq_len={self.config.seq_len}")
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))         # (B, T, d)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))                       # (B, T, V)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's own loss on its own logits (a tensor-parallel model has a vocab-parallel one)."""
        return lm_loss(logits, targets)

    def hidden_shape(self, batch_size: int, seq_len: int | None = None) -> tuple[int, int, int]:
        """The shape of what flows from one block to the next (and across a pipeline stage boundary)."""
        return (batch_size, seq_len or self.config.seq_len, self.config.d_model)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        loss = None if targets is None else self.loss(logits, targets)
        if loss is not None and self.config.n_expert:
            loss = loss + self.aux_loss()
        return logits, loss

    def stage_bounds(self, n_stages: int) -> list[tuple[int, int]]:
        return stage_bounds(self.config.n_layer, n_stages)

    def aux_loss(self):
        """aux_loss_coef × the mean over MoE layers of their load-balancing loss (0 for a dense model)."""
        return moe_aux_loss(self)

    def tp_linears(self) -> dict[str, tuple[nn.Linear, str]]:
        """Every linear tensor parallelism splits: 'blocks.{i}.attn.wq' -> (module, 'column' | 'row')."""
        return {f"blocks.{i}.{name}": (blk.get_submodule(name), kind)
                for i, blk in enumerate(self.blocks) for name, kind in TP_PLAN.items()}


def _moe(cfg: GPTConfig):
    from .moe import MoE
    return MoE(cfg.d_model, cfg.n_expert, top_k=cfg.top_k, capacity_factor=cfg.capacity_factor,
               mlp_ratio=cfg.mlp_ratio, bias=cfg.bias)


def moe_aux_loss(model: nn.Module):
    """aux_loss_coef × mean over the model's MoE layers of their last forward's load-balancing loss; 0 if none."""
    layers = [m for m in model.modules() if hasattr(m, "aux_loss") and hasattr(m, "router")]
    if not layers:
        return 0.0
    return model.config.aux_loss_coef * torch.stack([m.aux_loss() for m in layers]).mean()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))   # mean over B·T tokens


def stage_bounds(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) block ranges, as even as possible (earlier stages get the extra block)."""
    if not isinstance(n_stages, int) or n_stages <= 0:
        raise ValueError(f"n_stages must be a positive integer, got {n_stages!r}")
    if n_stages > n_layer:
        raise ValueError(f"cannot cut {n_layer} blocks into {n_stages} stages; use n_stages <= n_layer "
                         f"or a config with more layers")
    base, extra = divmod(n_layer, n_stages)
    bounds, start = [], 0
    for s in range(n_stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


# ----------------------------------------------------------------------------------------------- counts
def param_count(cfg: GPTConfig | str) -> int:
    """Exact parameter count from the config (unique parameters: a tied weight counts once)."""
    c = get_config(cfg)
    V, T, L, d, r = c.vocab_size, c.seq_len, c.n_layer, c.d_model, c.mlp_ratio
    b = 1 if c.bias else 0
    attn = 4 * d * d + b * 4 * d
    mlp = 2 * r * d * d + b * (r * d + d)
    if c.n_expert:
        mlp = c.n_expert * mlp + c.n_expert * d           # E experts and the router (no bias)
    lns = 2 * (d + b * d)
    per_block = attn + mlp + lns           # = 12d² + 13d for mlp_ratio 4 with biases
    head = 0 if c.tie_weights else V * d
    return V * d + T * d + L * per_block + (d + b * d) + head


def matmul_param_count(cfg: GPTConfig | str) -> int:
    """Parameters that take part in a matmul: every Linear weight, LM head included (not embeddings, biases, norms)."""
    c = get_config(cfg)
    return c.n_layer * (4 + 2 * c.mlp_ratio) * c.d_model ** 2 + c.d_model * c.vocab_size


def train_flops_per_token(cfg: GPTConfig | str, seq_len: int | None = None) -> int:
    """Matmul FLOPs per token for forward + backward: 6·N_matmul + 12·L·T·d (full T×T scores, as computed here)."""
    c = get_config(cfg)
    T = seq_len or c.seq_len
    return 6 * matmul_param_count(c) + 12 * c.n_layer * T * c.d_model


def block_activation_bytes(cfg: GPTConfig | str, batch_size: int, seq_len: int | None = None,
                           elem_bytes: int = 4) -> int:
    """Bytes one Block saves for backward, counted op by op for this implementation (fp32 by default):

        elem·B·T·((8 + 2r)·d + n_head·T)  +  4·elem·B·T  +  T²              (dropout = 0)
        └ tensors of width d: block input, ln1 out, q, k, v, attention output (reshape copy), residual, ln2 out (8d);
          MLP: fc_in out and GELU out (2·r·d); softmax output (n_head·T per token)
                                    └ LayerNorm mean and rstd, 2 per LN, in the input's dtype on CPU  └ causal mask
        + elem·B·T·(2d + 2·n_head·T)                                    (dropout > 0, in training)
        └ CPU dropout keeps its mask as a tensor of the activation's dtype (`empty_like(x).bernoulli_()`): the two
          residual dropouts keep one of width d each; attention dropout keeps its mask and its output (T per head)
    With r = 4 and no dropout this is Korthikanti et al.'s sbh(34 + 5as/h) (MLSys'23) less its dropout terms:
    16 elements of width d and one attention map per token. With dropout it is their count term by term — 18
    tensors of width d and 3 attention maps — with each mask as wide as an activation instead of 1 byte.
    """
    c = get_config(cfg)
    B, T, d, r = batch_size, seq_len or c.seq_len, c.d_model, c.mlp_ratio
    dropout = elem_bytes * B * T * (2 * d + 2 * c.n_head * T) if c.dropout > 0 else 0
    return elem_bytes * B * T * ((8 + 2 * r) * d + c.n_head * T) + 4 * elem_bytes * B * T + T * T + dropout


def embed_activation_bytes(cfg: GPTConfig | str, batch_size: int, seq_len: int | None = None,
                           elem_bytes: int = 4) -> int:
    """Bytes the embedding saves for backward: the int64 token ids and positions, and with dropout > 0 the
    embedding dropout's mask (width d, in the activation's dtype)."""
    c = get_config(cfg)
    B, T = batch_size, seq_len or c.seq_len
    return 8 * B * T + 8 * T + (elem_bytes * B * T * c.d_model if c.dropout > 0 else 0)


def head_activation_bytes(cfg: GPTConfig | str, batch_size: int, seq_len: int | None = None,
                          elem_bytes: int = 4, loss_elem_bytes: int | None = None) -> int:
    """Bytes the head and the loss save for backward: ln_f's input and output, its mean and rstd (in the input's
    dtype on CPU), the log-softmax output of width V, the int64 targets and cross-entropy's total weight (one
    element). `loss_elem_bytes`: the loss's element size where it differs (mixed precision upcasts the logits and
    computes the log-softmax in fp32: 4)."""
    c = get_config(cfg)
    B, T = batch_size, seq_len or c.seq_len
    e_loss = elem_bytes if loss_elem_bytes is None else loss_elem_bytes
    return elem_bytes * B * T * (2 * c.d_model + 2) + e_loss * B * T * c.vocab_size + 8 * B * T + e_loss


def activation_bytes(cfg: GPTConfig | str, batch_size: int, seq_len: int | None = None, elem_bytes: int = 4,
                     loss_elem_bytes: int | None = None) -> int:
    """Bytes the whole GPT saves for backward in one forward with separate input and target tensors: the
    embedding's (`embed_activation_bytes`), every block's (`block_activation_bytes`), the head's and the loss's
    (`head_activation_bytes`) — the one count that pipeline stages, recomputation plans and offload split up."""
    c = get_config(cfg)
    B, T = batch_size, seq_len or c.seq_len
    return (embed_activation_bytes(c, B, T, elem_bytes) + c.n_layer * block_activation_bytes(c, B, T, elem_bytes)
            + head_activation_bytes(c, B, T, elem_bytes, loss_elem_bytes))


def blocks_of(model: nn.Module) -> list:
    """The transformer blocks `model` runs, in order — the one answer to "which blocks does this model run": a GPT's
    or TensorParallelGPT's `blocks` (a ModuleList), a pipeline stage's (a ModuleDict keyed by the GPT's block
    index: its values, not its keys), or those of the model inside a wrapper (`.module`)."""
    while not hasattr(model, "blocks") and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    if isinstance(blocks, (nn.ModuleList, list, tuple)):
        return list(blocks)
    raise TypeError(f"{type(model).__name__} has no transformer blocks (`.blocks`): pass the course GPT, its "
                    f"tensor-parallel form, a pipeline stage, or a wrapper around one of them")


def count_parameters(model: nn.Module) -> int:
    """sum(p.numel()) over unique parameters (what `param_count` must equal)."""
    return sum(p.numel() for p in model.parameters())
