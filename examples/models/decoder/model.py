"""A step-wise model: a tiny decoder-only transformer that generates token ids greedily.

Weights come from seed 0 (vocab 256, width 64, 2 layers, 4 heads, sinusoidal positions up to
512); everything runs in float64. `start` prefills the joining prompts together, and `step`
runs ONE batched forward for every active sequence, whatever their lengths.

The KV cache is one buffer stacked across sequences, [LAYERS, 2 (K, V), slots, HEADS, 512,
WIDTH/HEADS]: a sequence owns a slot, and its first `length` rows hold its tokens so far.
Live sequences occupy slots 0..n-1: when one is released the last slot's rows move into its
hole (one copy per sequence that leaves, none per step), and the buffer doubles when more
sequences are live than it has slots. So when `step` gets every live sequence (as the worker's
loop gives it) the stack is a view, `kv[..., :n, :, :longest + 1, :]`, with no copy: the
forward writes each sequence's new K and V into its row `length` in place, and each token
attends to rows 0..length of its own slot, its cache and itself. The rows beyond are masked
with -inf, so their softmax weight is exactly 0 and they add exactly 0 (0 x a finite value).
A step given only some of the live sequences gathers their slots and writes the new rows back.
A sequence therefore yields the same tokens alone as in any mix of prompt lengths, joining
and leaving between steps.

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
from collections import deque
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from batchd.worker import InputRefused

VOCAB, WIDTH, LAYERS, HEADS, MAX_LEN = 256, 64, 2, 4, 512
HEAD = WIDTH // HEADS
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


def heads(x: torch.Tensor) -> torch.Tensor:  # [B, S, WIDTH] -> [B, HEADS, S, HEAD]
    return x.unflatten(-1, (HEADS, HEAD)).transpose(1, 2)


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
        """tokens, positions: [B, S]. cache: [LAYERS, 2, B, HEADS, T, HEAD], the stacked
        caches (a view is fine); this writes the new tokens' K and V into it at `positions`.
        allowed: bool [B, S, T], the keys each query may see. Returns the hidden states
        [B, S, WIDTH]."""
        x = self.embed(tokens) + self.pos[positions]
        rows = torch.arange(len(tokens), device=tokens.device)[:, None]
        for layer, block in enumerate(self.blocks):
            q, k, v = block.qkv(block.ln1(x)).chunk(3, dim=-1)
            keys, values = cache[layer, 0], cache[layer, 1]  # [B, HEADS, T, HEAD]
            keys[rows, :, positions] = k.unflatten(-1, (HEADS, HEAD))
            values[rows, :, positions] = v.unflatten(-1, (HEADS, HEAD))
            scores = heads(q) @ keys.transpose(-1, -2) / math.sqrt(HEAD)
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
            attended = torch.softmax(scores, dim=-1) @ values  # [B, HEADS, S, HEAD]
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
    slot: int | None  # its slot in the stacked cache; None once released
    length: int  # rows of the cache in use: the tokens fed so far
    generated: int = 0


class Decoder:
    def __init__(self, device: torch.device) -> None:
        with torch.random.fork_rng(devices=[]):  # seeded weights, the caller's RNG untouched
            torch.manual_seed(0)
            self.net = Net().to(device=device, dtype=DTYPE).eval().requires_grad_(False)
        self.device = device
        self.ids = itertools.count()
        with torch.inference_mode():  # so start, step and release may write it in place
            self.kv = self._zeros(8, MAX_LEN)  # grows as more sequences are live
        self.live: list[Sequence] = []  # by slot
        self.released: deque[int] = deque(maxlen=64)  # the last released ids (a list of
        # every one grew by one each sequence, for as long as the worker ran)

    def _zeros(self, batch: int, length: int) -> torch.Tensor:
        return torch.zeros(LAYERS, 2, batch, HEADS, length, HEAD, dtype=DTYPE, device=self.device)

    def cache(self, state: Sequence) -> torch.Tensor:
        """A live sequence's K and V so far: [LAYERS, 2, HEADS, length, HEAD] (a view)."""
        assert state.slot is not None, "released"
        return self.kv[:, :, state.slot, :, : state.length]

    def _prompt(self, request: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        # The caller's inputs, refused as such (INVALID_ARGUMENT, not INTERNAL)
        if "PROMPT" not in request or "MAX_NEW_TOKENS" not in request:
            got = list(request)
            raise InputRefused(f"inputs PROMPT and MAX_NEW_TOKENS are required, got {got}")
        prompt, max_new = request["PROMPT"].reshape(-1), request["MAX_NEW_TOKENS"].reshape(-1)
        if prompt.numel() == 0:
            raise InputRefused("PROMPT is empty: send at least one token id")
        if prompt.is_floating_point() or int(prompt.min()) < 1 or int(prompt.max()) >= VOCAB:
            got = f"{prompt.min().item()}..{prompt.max().item()}"
            raise InputRefused(f"PROMPT token ids are integers in 1..{VOCAB - 1}, got {got}")
        if max_new.numel() != 1 or max_new.is_floating_point() or int(max_new[0]) < 1:
            got = max_new.tolist()[:4]
            raise InputRefused(f"MAX_NEW_TOKENS must be one integer >= 1, got {got}")
        if prompt.numel() + int(max_new[0]) > MAX_LEN:
            raise InputRefused(
                f"PROMPT length + MAX_NEW_TOKENS must be at most {MAX_LEN}, got "
                f"{prompt.numel()} + {int(max_new[0])}"
            )
        return prompt.to(self.device, torch.int64), int(max_new[0])

    @torch.inference_mode()
    def start(self, requests: list[dict[str, torch.Tensor]]) -> list[Sequence]:
        prompts = [self._prompt(r) for r in requests]  # validate all before any work
        needed = len(self.live) + len(prompts)
        if needed > self.kv.shape[2]:  # double the stack, moving the live caches over
            grown = self._zeros(max(needed, 2 * self.kv.shape[2]), MAX_LEN)
            grown[:, :, : len(self.live)] = self.kv[:, :, : len(self.live)]
            self.kv = grown
        states = []
        for p, n in prompts:
            states.append(Sequence(next(self.ids), n, int(p[-1]), len(self.live), len(p) - 1))
            self.live.append(states[-1])
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
            self.kv[:, :, s.slot, :, : s.length] = cache[:, :, row, :, : s.length]
        return states

    @torch.inference_mode()
    def step(self, states: list[Sequence]) -> list[tuple[dict[str, torch.Tensor] | None, bool]]:
        if any(s.slot is None or s.generated >= s.max_new for s in states):
            raise RuntimeError("step() on a sequence that has already finished")
        order = sorted(range(len(states)), key=lambda i: states[i].slot)  # by slot
        ordered = [states[i] for i in order]
        slots = [s.slot for s in ordered]
        lengths = torch.tensor([s.length for s in ordered], device=self.device)
        tokens = torch.tensor([[s.last] for s in ordered], device=self.device)  # [B, 1]
        longest = max(s.length for s in ordered) + 1
        contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        if contiguous:  # the usual case, every live sequence: a view of the stack
            cache = self.kv[:, :, slots[0] : slots[0] + len(slots), :, :longest]
        else:
            cache = self.kv[:, :, slots, :, :longest]  # a copy; the new rows go back below
        allowed = (torch.arange(longest, device=self.device) <= lengths[:, None])[:, None]
        hidden = self.net(tokens, lengths[:, None], cache, allowed)
        if not contiguous:
            rows = torch.arange(len(slots), device=self.device)
            self.kv[:, :, slots, :, lengths] = cache[:, :, rows, :, lengths]
        chosen = self.net.logits(hidden[:, -1]).argmax(dim=-1).tolist()
        results: list[tuple[dict[str, torch.Tensor] | None, bool]] = [(None, False)] * len(states)
        for i, s, token in zip(order, ordered, chosen, strict=True):
            s.length, s.last, s.generated = s.length + 1, token, s.generated + 1
            done = token == END or s.generated >= s.max_new
            results[i] = ({"TOKEN": torch.tensor([token], dtype=torch.int64)}, done)
        return results

    @torch.inference_mode()
    def release(self, state: Sequence) -> None:
        """Free its slot: the last live sequence moves into it, so live slots stay 0..n-1."""
        if state.slot is None:
            return  # released already
        hole, last = state.slot, self.live.pop()
        if last is not state:
            self.kv[:, :, hole, :, : last.length] = self.kv[:, :, last.slot, :, : last.length]
            last.slot, self.live[hole] = hole, last
        state.slot = None
        self.released.append(state.id)


def load(device: torch.device) -> Decoder:
    return Decoder(device)
