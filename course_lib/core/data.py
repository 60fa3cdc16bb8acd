"""Training data for the toy model: a shipped real-text corpus, a byte tokenizer and rank-sharded batches.

The batch sampler is what makes "parallel equals baseline" testable: for every step it draws one *global* batch of
`world_size · micro_batch_size · num_microbatches` sequences from a seeded generator, and each rank takes its own slice.
N ranks with micro-batch b therefore see exactly the N·b sequences one process sees with batch N·b, and since the
loss is a mean, averaging the ranks' gradients reproduces the single-process gradient.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

import torch

from .files import data_dir

DATA_DIR = data_dir()
CORPUS_PATH = DATA_DIR / "python_docs.txt"
CORPUS_SHA256 = "2a95af4ac93f5b719944030ce3769070ddf827d847cba42192afa8da989e5dc4"
VAL_FRACTION = 0.1


@lru_cache(maxsize=1)
def load_corpus() -> bytes:
    """The corpus as bytes (see data/README.md for provenance and licence)."""
    if not CORPUS_PATH.exists():
        raise FileNotFoundError(
            f"corpus not found at {CORPUS_PATH}. course_lib reads it from the repository's data/ folder, or from "
            f"where `pip install` of the course puts it: reinstall the course (pip install -e <course folder>).")
    return CORPUS_PATH.read_bytes()


def corpus_sha256() -> str:
    return hashlib.sha256(load_corpus()).hexdigest()


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary of 256, nothing to train, round-trips any text."""
    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        data = text.encode("utf-8")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long() if data else torch.empty(0, dtype=torch.long)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@lru_cache(maxsize=2)
def load_tokens(split: str = "train") -> torch.Tensor:
    """Token ids (int64) of the train split (first 90 %) or the val split (last 10 %)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    raw = torch.frombuffer(bytearray(load_corpus()), dtype=torch.uint8).long()
    cut = int(len(raw) * (1 - VAL_FRACTION))
    return raw[:cut] if split == "train" else raw[cut:]


@dataclass
class ShardedBatches:
    """Deterministic batches, sharded across ranks and gradient-accumulation micro-steps.

    Global batch of step s = `global_batch_size` windows at offsets drawn from Generator(seed, s). Position j in it
    belongs to micro-step j // (world_size·b), rank (j // b) % world_size.
    """
    seq_len: int
    micro_batch_size: int
    world_size: int = 1
    rank: int = 0
    num_microbatches: int = 1
    seed: int = 0
    split: str = "train"

    def __post_init__(self):
        for name in ("seq_len", "micro_batch_size", "world_size", "num_microbatches"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ShardedBatches.{name} must be positive, got {getattr(self, name)!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        self.tokens = load_tokens(self.split)
        if len(self.tokens) <= self.seq_len + 1:
            raise ValueError(f"seq_len={self.seq_len} is too long for the {self.split} split "
                             f"({len(self.tokens)} tokens)")

    @property
    def global_batch_size(self) -> int:
        return self.world_size * self.micro_batch_size * self.num_microbatches

    def _offsets(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.global_batch_size,), generator=g)

    def _windows(self, offsets: torch.Tensor):
        idx = offsets[:, None] + torch.arange(self.seq_len + 1)[None, :]   # (B, T+1)
        w = self.tokens[idx]
        # clones, not .contiguous(): with B = 1 both slices already count as contiguous and would stay views of one
        # storage, which a memory count of saved inputs would see once instead of twice
        return w[:, :-1].clone(), w[:, 1:].clone()                          # x, y: (B, T)

    def get(self, step: int, micro: int = 0):
        """This rank's (x, y) for `step` and accumulation micro-step `micro`: each (micro_batch_size, seq_len)."""
        if not 0 <= micro < self.num_microbatches:
            raise ValueError(f"micro-step {micro} is outside 0..{self.num_microbatches - 1}")
        b = self.micro_batch_size
        start = micro * self.world_size * b + self.rank * b
        return self._windows(self._offsets(step)[start:start + b])

    def global_batch(self, step: int):
        """The whole global batch of `step`, as the single-process reference sees it."""
        return self._windows(self._offsets(step))
