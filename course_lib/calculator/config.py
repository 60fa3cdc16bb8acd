"""What the calculator is asked about: a decoder shape, a cluster, and one way to run the model on it.

    Decoder   layers, width, heads (and key/value heads), vocabulary, sequence, MLP width and kind, dense or MoE
    Cluster   device memory and peak FLOP/s, devices per node, the intra- and inter-node links (`costmodel.Link`)
    Job       global batch and micro-batch, precision recipe, ZeRO stage, dp/tp/pp/cp/ep, schedule, recomputation,
              offload — the same names as `ParallelPlan`, which the course's real runs use

Every field is checked when the object is made (`__post_init__`), and a job is checked against a model and a
cluster by `check_job`: a bad input raises `CalculatorError` with one line naming what to change (formulas §15.6).
Nothing here computes a cost; `memory`, `step_time`, `planner` and `cost` do.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..core.costmodel import Link, get_link

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1")
RECOMPUTE = (None, "selective", "full")
OFFLOAD = (None, "optimizer", "optimizer+params")
PRECISIONS = {                  # bytes per parameter: (compute weights, gradients, optimizer state incl. fp32 master)
    "bf16": (2, 2, 12),         # Micikevicius et al. 2018 recipe with Adam: 2 + 2 + (4 master + 4 m + 4 v)
    "fp16": (2, 2, 12),
    "fp32": (4, 4, 8),          # fp32 Adam: the weights are their own master copy
}


class CalculatorError(ValueError):
    """An input the calculator cannot use; the message names the field and what to change."""


def _positive(obj, *names, integer=True):
    for n in names:
        v = getattr(obj, n)
        bad = (not isinstance(v, int) or isinstance(v, bool)) if integer else not isinstance(v, (int, float))
        if bad or v <= 0:
            kind = "a positive integer" if integer else "a positive number"
            raise CalculatorError(f"{type(obj).__name__}.{n} must be {kind}, got {v!r}")


@dataclass(frozen=True)
class Decoder:
    """A decoder-only transformer. Defaults are GPT's: d_ff = 4·d_model, a GELU MLP (2 matrices), learned positions,
    biases, untied embeddings, n_kv_head = n_head. `gated_mlp` is SwiGLU (3 matrices); `n_expert` > 0 makes every
    MLP a mixture of `n_expert` experts of which `top_k` run per token."""
    name: str
    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    seq_len: int
    n_kv_head: int | None = None
    d_ff: int | None = None
    gated_mlp: bool = False
    n_expert: int = 0
    top_k: int = 1
    learned_positions: bool = True
    tied_embeddings: bool = False
    dropout: bool = True               # Korthikanti's tables keep 1-byte dropout masks; Llama-style models have none

    def __post_init__(self):
        _positive(self, "n_layer", "d_model", "n_head", "vocab", "seq_len", "top_k")
        if self.d_model % self.n_head:
            raise CalculatorError(f"Decoder {self.name}: d_model={self.d_model} is not a multiple of "
                                  f"n_head={self.n_head}; choose heads that divide the width")
        if self.n_head % self.kv_heads:
            raise CalculatorError(f"Decoder {self.name}: n_kv_head={self.kv_heads} must divide n_head={self.n_head}")
        if self.n_expert and self.top_k > self.n_expert:
            raise CalculatorError(f"Decoder {self.name}: top_k={self.top_k} > n_expert={self.n_expert}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def ffn(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def replace(self, **changes) -> "Decoder":
        return replace(self, **changes)


@dataclass(frozen=True)
class Cluster:
    """Devices of one kind: memory and peak FLOP/s per device, `devices_per_node` joined by `intra`, nodes joined by
    `inter` (one NIC's worth per device, as on Selene and Meta's H100 clusters). Links are `costmodel.Link` objects
    or names of `costmodel.PRESETS`; everything computed from them is *modeled*."""
    name: str
    device_memory: float
    peak_flops: float
    devices_per_node: int
    intra: "Link | str"
    inter: "Link | str"
    num_devices: int = 1 << 30         # how many there are (the planner stays within it)
    watts: float | None = None
    memory_bandwidth: float | None = None   # device memory (HBM) bytes/s; None: memory-bound ops not modelled

    def __post_init__(self):
        _positive(self, "devices_per_node", "num_devices")
        _positive(self, "device_memory", "peak_flops", integer=False)
        if self.watts is not None and not (isinstance(self.watts, (int, float)) and self.watts > 0):
            raise CalculatorError(f"Cluster {self.name}: watts must be > 0 (the device's stated power), got "
                                  f"{self.watts!r}")
        if self.memory_bandwidth is not None and not (isinstance(self.memory_bandwidth, (int, float))
                                                      and self.memory_bandwidth > 0):
            raise CalculatorError(f"Cluster {self.name}: memory_bandwidth must be > 0 bytes/s, got "
                                  f"{self.memory_bandwidth!r}")
        object.__setattr__(self, "intra", get_link(self.intra))
        object.__setattr__(self, "inter", get_link(self.inter))


@dataclass(frozen=True)
class Job:
    """One way to run a step: `batch` sequences per optimizer step over dp × cp data-parallel replicas, each split into
    micro-batches of `micro_batch` sequences; tp/pp/cp/ep as in `ParallelPlan` (ep inside dp). `chunks` is the
    interleaved schedule's virtual stages per rank. `offload`: 'optimizer' moves the fp32 master and Adam state to
    the host (ZeRO-Offload), 'optimizer+params' also the parameters between uses (ZeRO-Infinity style)."""
    batch: int
    micro_batch: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    sequence_parallel: bool = False
    recompute: str | None = None
    precision: str = "bf16"
    offload: str | None = None
    flash_attention: bool = False      # True: the s×s score maps are never stored (recomputed in backward)
    overlap_dp: bool = True            # False: gradients are reduced after the backward pass (Megatron-LM of 2021)

    def __post_init__(self):
        _positive(self, "batch", "micro_batch", "dp", "tp", "pp", "cp", "ep", "chunks")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise CalculatorError(f"Job.zero is the ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        for name, allowed in (("schedule", SCHEDULES), ("recompute", RECOMPUTE), ("offload", OFFLOAD),
                              ("precision", tuple(PRECISIONS))):
            if getattr(self, name) not in allowed:
                raise CalculatorError(f"Job.{name}={getattr(self, name)!r}: use one of {allowed}")
        if self.chunks > 1 and self.schedule != "interleaved":
            raise CalculatorError(f"Job.chunks={self.chunks} needs schedule='interleaved'; or use chunks=1")
        if self.dp % self.ep:
            raise CalculatorError(f"Job: ep={self.ep} must divide dp={self.dp} (experts spread over dp ranks)")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def microbatches(self) -> int:
        """Micro-batches each data-parallel replica runs per step."""
        return self.batch // (self.dp * self.micro_batch)

    def describe(self) -> str:
        d = Job(batch=self.batch)
        parts = [f"dp{self.dp}·tp{self.tp}·pp{self.pp}" + (f"·cp{self.cp}" if self.cp > 1 else "")
                 + (f"·ep{self.ep}" if self.ep > 1 else ""), f"mb{self.micro_batch}"]
        parts += [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                  if f.name in ("zero", "schedule", "chunks", "sequence_parallel", "recompute", "offload", "precision")
                  and getattr(self, f.name) != getattr(d, f.name)]
        return " ".join(parts)

    def replace(self, **changes) -> "Job":
        return replace(self, **changes)


def check_job(model: Decoder, cluster: Cluster, job: Job, world: int | None = None) -> Job:
    """Raise CalculatorError (one line: what to change) unless `job` can run `model` on `cluster` with `world`
    devices (default: job.world, which must fit in the cluster). Returns the job."""
    world = job.world if world is None else world
    if job.world != world:
        raise CalculatorError(f"dp × tp × pp × cp = {job.dp} × {job.tp} × {job.pp} × {job.cp} = {job.world}, but the "
                              f"world has {world} devices; choose sizes whose product is {world}")
    if world > cluster.num_devices:
        raise CalculatorError(f"the job needs {world} devices but {cluster.name} has {cluster.num_devices}; use "
                              f"fewer, or a larger cluster")
    if model.n_head % job.tp or model.kv_heads % job.tp and job.tp % model.kv_heads:
        raise CalculatorError(f"tp={job.tp} does not divide the {model.n_head} heads (and {model.kv_heads} key/value "
                              f"heads) of {model.name}; use a tp that divides the heads")
    if model.ffn % job.tp or model.vocab % job.tp:
        raise CalculatorError(f"tp={job.tp} must divide d_ff={model.ffn} and vocab={model.vocab} of {model.name}")
    if model.n_layer % (job.pp * job.chunks):
        raise CalculatorError(f"pp × chunks = {job.pp} × {job.chunks} does not divide the {model.n_layer} layers of "
                              f"{model.name}; choose a pipeline depth that splits the layers evenly")
    if model.seq_len % (job.cp * (2 if job.cp > 1 else 1)):
        raise CalculatorError(f"cp={job.cp}: the sequence of {model.seq_len} tokens must split into 2·cp zig-zag "
                              f"chunks; use a cp with seq_len % (2·cp) == 0")
    if job.ep > 1 and (not model.n_expert or model.n_expert % job.ep):
        raise CalculatorError(f"ep={job.ep} needs a MoE model whose n_expert ({model.n_expert}) it divides")
    if job.sequence_parallel and job.tp == 1:
        raise CalculatorError("sequence_parallel splits the LayerNorm regions over tp, but tp=1; use tp ≥ 2")
    if job.batch % (job.dp * job.micro_batch):
        raise CalculatorError(f"the batch of {job.batch} sequences does not split into dp × micro_batch = "
                              f"{job.dp} × {job.micro_batch}; use a batch that is a multiple of "
                              f"{job.dp * job.micro_batch}")
    if job.pp > 1 and job.schedule == "interleaved" and job.microbatches % job.pp:
        raise CalculatorError(f"interleaved 1F1B runs micro-batches in rounds of pp={job.pp}: {job.microbatches} "
                              f"micro-batches per replica is not a multiple; change batch or micro_batch")
    if job.zero == 3 and job.pp > 1:
        raise CalculatorError("zero=3 inside a pipeline gathers every stage's parameters once per micro-batch; use "
                              "zero ≤ 2 with pp > 1 (as Megatron-LM and DeepSpeed do)")
    if job.offload and job.zero == 0 and job.dp > 1:
        raise CalculatorError("offload moves each rank's optimizer shard: use zero ≥ 1 with dp > 1")
    return job


__all__ = ["Decoder", "Cluster", "Job", "CalculatorError", "check_job", "PRECISIONS", "SCHEDULES", "RECOMPUTE",
           "OFFLOAD"]
