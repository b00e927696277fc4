"""A small sentence embedder: hashed character trigrams -> EmbeddingBag -> Linear -> L2 norm.

Shows a model that takes text (BYTES arrives as a numpy array of `bytes`),
does its own tokenising on the worker, and returns several outputs by name.
Deterministic: weights from seed 0, hashing with crc32.
"""

import zlib

import numpy as np
import torch

BUCKETS, DIM = 4096, 64


def trigram_ids(text: bytes) -> list[int]:
    padded = b"  " + text.lower() + b"  "
    return [zlib.crc32(padded[i : i + 3]) % BUCKETS for i in range(len(padded) - 2)]


class Embedder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = torch.nn.EmbeddingBag(BUCKETS, 128, mode="mean")
        self.proj = torch.nn.Linear(128, DIM)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(self.proj(self.bag(ids, offsets)), dim=-1)


def load(device: torch.device):
    model = Embedder().to(device).eval()

    def run(text: np.ndarray) -> dict[str, torch.Tensor]:
        grams = [trigram_ids(t) for t in text[:, 0]]
        offsets = torch.tensor(np.cumsum([0] + [len(g) for g in grams[:-1]]), device=device)
        ids = torch.tensor([i for g in grams for i in g], device=device)
        lengths = torch.tensor([[len(t)] for t in text[:, 0]], dtype=torch.int64)
        return {"EMBEDDING": model(ids, offsets), "LENGTH": lengths}

    return run
