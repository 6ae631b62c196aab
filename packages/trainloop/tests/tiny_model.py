"""A tiny language model and a resumable batch stream for the tests (trainloop never imports lmcore)."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

VOCAB = 32


class TinyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = 16, tied: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.drop = nn.Dropout(dropout)  # draws from torch's CPU RNG at every training forward when > 0
        self.o_proj = nn.Linear(d, d)
        self.norm_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            # Like GPT-2: one matrix under two state_dict names; plus buffers of both kinds a real model carries.
            self.head.weight = self.embed.weight
            self.register_buffer("position_ids", torch.arange(8), persistent=True)
            self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(inputs)  # (B, T, d)
        mixed = torch.tanh(self.o_proj(h))
        h = h + (self.drop(mixed) if self.drop.p > 0 else mixed)
        logits = self.head(self.norm_f(h))  # (B, T, V)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.o_proj = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.o_proj(self.norm(h)))  # (B, T, d)


class BlocksLM(nn.Module):
    """TinyLM with a stack of blocks in an nn.ModuleList (what a sharded engine shards one by one), tied embeddings.
    ``checkpointing`` recomputes each block's activations in the backward."""

    def __init__(self, vocab: int = VOCAB, d: int = 16, n_blocks: int = 3, checkpointing: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n_blocks)])
        self.norm_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.checkpointing = checkpointing

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(inputs)  # (B, T, d)
        for block in self.blocks:
            if self.checkpointing and self.training and torch.is_grad_enabled():
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        logits = self.head(self.norm_f(h))  # (B, T, V)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


class SeqData:
    """Deterministic (inputs, targets) batches with a learnable rule; resumable via state_dict.

    ``rank``/``world_size`` pick rows of a global batch, so world_size ranks with micro_batch b see exactly the rows
    one process sees with micro_batch b * world_size.
    """

    def __init__(self, batch: int, seq: int = 8, seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        self.batch, self.seq, self.seed, self.rank, self.world = batch, seq, seed, rank, world_size
        self.pos = 0

    def __iter__(self):
        return self

    def _global(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        start = torch.randint(0, VOCAB, (self.batch * self.world, 1), generator=g)
        steps = torch.arange(self.seq + 1)
        return (start * 5 + steps * 3) % VOCAB  # (B*W, T+1)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._global(self.pos)[self.rank * self.batch : (self.rank + 1) * self.batch]
        self.pos += 1
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


def eval_batches(n: int = 2, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = SeqData(batch, seed=99)
    return [next(data) for _ in range(n)]
