"""Sentence embeddings from token ids: embedding -> one masked self-attention
layer -> masked mean pooling -> Linear -> L2 norm. Weights from seed 0.

TOKENS arrive padded to the batch's longest row; MASK marks the real tokens.
Padded keys get no attention weight and padded positions are left out of the
mean, so a request's embedding is the same alone or in any batch.
"""

import math

import torch

VOCAB, WIDTH, DIM = 8192, 128, 64


class TextPool(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.out = torch.nn.Linear(WIDTH, DIM)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens.remainder(VOCAB))  # [batch, length, width]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(WIDTH)  # [batch, length, length]
        scores = scores.masked_fill(mask[:, None, :] == 0, float("-inf"))
        x = x + torch.softmax(scores, dim=-1) @ v
        keep = mask[..., None].to(x.dtype)
        pooled = (x * keep).sum(dim=1) / keep.sum(dim=1)
        return torch.nn.functional.normalize(self.out(pooled), dim=-1)


def load(device: torch.device) -> torch.nn.Module:
    return TextPool().to(device).eval()
