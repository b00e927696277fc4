"""textpool, packed: the same sentence embeddings with no padding computed.

TOKENS arrive as one 1-D tensor of every row's token ids, one row after the
other, and OFFSETS ([rows + 1], from 0) say where each row starts. Each row
attends over its own tokens only (SDPA over views of the packed tensor: no
copy, no mask, no padded key), and the mean over a row's tokens is a segment
sum (index_add_). The layers and weights are textpool's (seed 0), so a row's
embedding equals textpool's for the same tokens, up to float rounding.

On a GPU, the packed tensors become a torch.nested jagged tensor without a copy
(`torch.nested.nested_tensor_from_jagged(values, offsets)`), which SDPA runs as
one variable-length kernel; on the CPU a loop over the rows is faster. A GPU's
index_add_ sums with atomic adds, in no fixed order: there the same request's
embedding can differ in its last bits from one call to the next.
"""

import torch
import torch.nn.functional as F

VOCAB, WIDTH, DIM = 8192, 128, 64


class TextPoolPacked(torch.nn.Module):
    def __init__(self, jagged: bool = False) -> None:
        super().__init__()
        self.jagged = jagged  # attention over jagged nested tensors (the GPU's way)
        torch.manual_seed(0)  # textpool's weights: the same layers, made in the same order
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.out = torch.nn.Linear(WIDTH, DIM)

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens.remainder(VOCAB))  # [total, width]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        lengths = offsets.diff()  # [rows]
        if self.jagged:  # [rows, 1 head, j, width] jagged views, one varlen kernel
            q, k, v = (
                torch.nested.nested_tensor_from_jagged(t.contiguous(), offsets)
                .unflatten(-1, (1, WIDTH))
                .transpose(1, 2)
                for t in (q, k, v)
            )
            attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).values()
            attended = attended.flatten(-2)
        else:  # each row over its own tokens: views of the packed tensor
            spans = lengths.tolist()
            per_row = zip(q.split(spans), k.split(spans), v.split(spans), strict=True)
            attended = torch.cat(
                [
                    F.scaled_dot_product_attention(qi[None], ki[None], vi[None])[0]
                    for qi, ki, vi in per_row
                ]
            )
        x = x + attended
        rows = torch.arange(len(lengths), device=x.device).repeat_interleave(lengths)
        sums = torch.zeros(len(lengths), WIDTH, device=x.device, dtype=x.dtype)
        pooled = sums.index_add_(0, rows, x) / lengths[:, None].to(x.dtype)
        return F.normalize(self.out(pooled), dim=-1)


def load(device: torch.device) -> torch.nn.Module:
    return TextPoolPacked(jagged=device.type == "cuda").to(device).eval()
