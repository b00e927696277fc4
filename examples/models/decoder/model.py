"""A step-wise model: a tiny decoder-only transformer that generates token ids greedily.

Weights come from seed 0 (vocab 256, width 64, 2 layers, 4 heads, sinusoidal positions up to
512); everything runs in float64. `start` prefills the joining prompts together, and `step`
runs ONE batched forward for every active sequence, whatever their lengths.

The KV cache. Each state owns its cache, one buffer [capacity, LAYERS, 2 (K, V), 64] with
capacity = prompt length - 1 + MAX_NEW_TOKENS, zeros at first; its first `length` rows hold
its tokens so far. A step stacks the states' first `length + 1` rows, zero-padded to the
longest, into [batch, longest + 1, LAYERS, 2, 64] (one copy), and feeds each sequence's last
token at its own position, `length`: the forward writes that token's K and V into row
`length` of the stack, and the token attends to rows 0..length, its cache and itself. The
padding is masked with -inf, so its softmax weight is exactly 0 and it adds exactly 0 (0 x a
zero value). Row `length` is then copied back into the state's own buffer. A sequence
therefore yields the same tokens alone as in any mix of prompt lengths, joining and leaving
between steps.

The prefill runs the prompt without its last token (right-padded, causal and padding masks);
the first step feeds that last token and emits the first generated token, so `start` returns
no outputs and every step has the same shape. A sequence ends when it emits END (id 0, sent as
its last TOKEN) or after MAX_NEW_TOKENS tokens. END's logit is lowered by END_BIAS so that
sequences run to MAX_NEW_TOKENS and a benchmark sets lengths with it: unbiased, END was never
the argmax in 65,536 steps of 512 random prompts (closest: 0.05 below the top logit); the bias
widens that to over 2, far beyond any device's rounding. `net.end_bias` changes it per model.

Values are not bit-identical across batches: BLAS picks kernels and summation order by shape
(batch size, padded length), so they may differ in the last bits (~1e-15 in float64), which
is far below the gaps between the top logits; the tokens stay the same.
"""

import itertools
import math
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

VOCAB, WIDTH, LAYERS, HEADS, MAX_LEN = 256, 64, 2, 4, 512
END = 0
END_BIAS = 2.0  # subtracted from END's logit (see the module docstring)
DTYPE = torch.float64


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.qkv, self.proj = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH)
        )


def heads(x: torch.Tensor) -> torch.Tensor:  # [B, T, WIDTH] -> [B, HEADS, T, WIDTH/HEADS]
    return x.unflatten(-1, (HEADS, WIDTH // HEADS)).transpose(1, 2)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln, self.head = torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, VOCAB)
        pos = torch.arange(MAX_LEN, dtype=DTYPE)[:, None]
        freq = torch.exp(torch.arange(0, WIDTH, 2, dtype=DTYPE) * (-math.log(10000.0) / WIDTH))
        table = torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=-1)
        self.register_buffer("pos", table, persistent=False)
        self.end_bias = END_BIAS

    def forward(self, tokens, positions, cache, allowed):
        """tokens, positions: [B, S]. cache: [B, T, LAYERS, 2, WIDTH], the stacked caches; this
        writes the new tokens' K and V into it at `positions`. allowed: bool [B, S, T], the keys
        each query may see. Returns the hidden states [B, S, WIDTH]."""
        x = self.embed(tokens) + self.pos[positions]
        rows = torch.arange(len(tokens), device=tokens.device)[:, None]
        for layer, block in enumerate(self.blocks):
            q, k, v = block.qkv(block.ln1(x)).chunk(3, dim=-1)
            cache[rows, positions, layer] = torch.stack([k, v], dim=2)
            k_all, v_all = cache[:, :, layer, 0], cache[:, :, layer, 1]
            scores = heads(q) @ heads(k_all).transpose(-1, -2) / math.sqrt(WIDTH // HEADS)
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
            attended = torch.softmax(scores, dim=-1) @ heads(v_all)  # [B, HEADS, S, WIDTH/HEADS]
            x = x + block.proj(attended.transpose(1, 2).flatten(2))
            x = x + block.mlp(block.ln2(x))
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.head(self.ln(hidden))
        out[..., END] -= self.end_bias
        return out


@dataclass
class Sequence:
    id: int
    max_new: int
    last: int  # the token the next step feeds
    cache: torch.Tensor | None  # [capacity, LAYERS, 2, WIDTH]; None once released
    length: int  # rows of the cache in use: the tokens fed so far
    generated: int = 0


class Decoder:
    def __init__(self, device: torch.device) -> None:
        with torch.random.fork_rng(devices=[]):  # seeded weights, the caller's RNG untouched
            torch.manual_seed(0)
            self.net = Net().to(device=device, dtype=DTYPE).eval().requires_grad_(False)
        self.device = device
        self.ids = itertools.count()
        self.released: list[int] = []  # ids of released sequences

    def _prompt(self, request: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        if "PROMPT" not in request or "MAX_NEW_TOKENS" not in request:
            raise ValueError(f"inputs PROMPT and MAX_NEW_TOKENS are required, got {list(request)}")
        prompt, max_new = request["PROMPT"].reshape(-1), request["MAX_NEW_TOKENS"].reshape(-1)
        if prompt.numel() == 0:
            raise ValueError("PROMPT is empty: send at least one token id")
        if prompt.is_floating_point() or int(prompt.min()) < 1 or int(prompt.max()) >= VOCAB:
            raise ValueError(f"PROMPT token ids must be integers in 1..{VOCAB - 1}")
        if max_new.numel() != 1 or max_new.is_floating_point() or int(max_new[0]) < 1:
            raise ValueError("MAX_NEW_TOKENS must be one integer >= 1")
        if prompt.numel() + int(max_new[0]) > MAX_LEN:
            raise ValueError(f"PROMPT length + MAX_NEW_TOKENS must be at most {MAX_LEN}")
        return prompt.to(self.device, torch.int64), int(max_new[0])

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, LAYERS, 2, WIDTH, dtype=DTYPE, device=self.device)

    @torch.inference_mode()
    def start(self, requests: list[dict[str, torch.Tensor]]) -> list[Sequence]:
        prompts = [self._prompt(r) for r in requests]  # validate all before any work
        states = [
            Sequence(next(self.ids), n, int(p[-1]), self._zeros(len(p) - 1 + n), len(p) - 1)
            for p, n in prompts
        ]
        joining = [s for s in states if s.length]  # a one-token prompt has nothing to prefill
        if not joining:
            return states
        # The prompts less their last token, right-padded; causal, and blind to the padding.
        context = [p[:-1] for p, _ in prompts if len(p) > 1]
        tokens = pad_sequence(context, batch_first=True, padding_value=END)  # [B, S]
        lengths = torch.tensor([s.length for s in joining], device=self.device)
        ar = torch.arange(tokens.shape[1], device=self.device)
        allowed = (ar[None, :] <= ar[:, None])[None] & (ar < lengths[:, None])[:, None, :]
        cache = self._zeros(*tokens.shape)
        self.net(tokens, ar.expand_as(tokens), cache, allowed)
        for row, s in enumerate(joining):
            s.cache[: s.length] = cache[row, : s.length]
        return states

    @torch.inference_mode()
    def step(self, states: list[Sequence]) -> list[tuple[dict[str, torch.Tensor] | None, bool]]:
        if any(s.generated >= s.max_new for s in states):
            raise RuntimeError("step() on a sequence that has already finished")
        lengths = torch.tensor([s.length for s in states], device=self.device)
        tokens = torch.tensor([[s.last] for s in states], device=self.device)  # [B, 1]
        # Each cache and the row its next token fills, zero-padded: [B, T, LAYERS, 2, WIDTH].
        cache = pad_sequence([s.cache[: s.length + 1] for s in states], batch_first=True)
        allowed = (torch.arange(cache.shape[1], device=self.device) <= lengths[:, None])[:, None]
        hidden = self.net(tokens, lengths[:, None], cache, allowed)
        chosen = self.net.logits(hidden[:, -1]).argmax(dim=-1).tolist()
        results: list[tuple[dict[str, torch.Tensor] | None, bool]] = []
        for row, (s, token) in enumerate(zip(states, chosen, strict=True)):
            s.cache[s.length] = cache[row, s.length]
            s.length, s.last, s.generated = s.length + 1, token, s.generated + 1
            done = token == END or s.generated >= s.max_new
            results.append(({"TOKEN": torch.tensor([token], dtype=torch.int64)}, done))
        return results

    def release(self, state: Sequence) -> None:
        state.cache = None
        self.released.append(state.id)


def load(device: torch.device) -> Decoder:
    return Decoder(device)
