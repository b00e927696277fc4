"""The step-wise example model examples/models/decoder, on its own (no server, no worker).

The worker's loop is simulated here: admit into free slots (`start`), `step` every active
sequence once, drop the finished ones (`release`), again.
"""

import importlib.util
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from batchd.worker import InputRefused

DECODER = Path(__file__).resolve().parent.parent / "examples" / "models" / "decoder"
CPU = torch.device("cpu")
# With net.end_bias = -0.3 this prompt emits END as its 4th token (found by search).
ENDING_PROMPT, ENDING_BIAS, ENDS_AT = [44, 18, 106], -0.3, 4


def import_decoder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("decoder_model", DECODER / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def decoder() -> ModuleType:
    return import_decoder()


@pytest.fixture
def model(decoder: ModuleType) -> Any:
    return decoder.load(CPU)


def request(prompt: list[int], max_new: int) -> dict[str, torch.Tensor]:
    return {"PROMPT": torch.tensor(prompt), "MAX_NEW_TOKENS": torch.tensor([max_new])}


def run_alone(model: Any, prompt: list[int], max_new: int) -> list[int]:
    (state,) = model.start([request(prompt, max_new)])
    tokens, done = [], False
    while not done:
        ((out, done),) = model.step([state])
        tokens.append(int(out["TOKEN"][0]))
    model.release(state)
    return tokens


def run_continuous(model: Any, jobs: list[tuple[list[int], int]], max_active: int) -> tuple:
    """The worker's loop: up to `max_active` stepping together, two joining at most per step
    (so sequences join between steps). Returns each job's tokens and every step's batch size."""
    queue, active, tokens = list(range(len(jobs))), {}, {i: [] for i in range(len(jobs))}
    sizes = []
    while queue or active:
        joining = queue[: min(2, max_active - len(active))]
        del queue[: len(joining)]
        if joining:
            states = model.start([request(*jobs[i]) for i in joining])
            active.update(zip(joining, states, strict=True))
        order = list(active)
        results = model.step([active[i] for i in order])
        sizes.append(len(order))
        for i, (out, done) in zip(order, results, strict=True):
            assert out["TOKEN"].dtype == torch.int64 and out["TOKEN"].shape == (1,)
            tokens[i].append(int(out["TOKEN"][0]))
            if done:
                model.release(active.pop(i))
    return tokens, sizes


def jobs_of(seed: int, count: int) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 40, 3, 17, 1, 90, 5, 9, 25, 60, 4]
    news = [30, 1, 5, 12, 2, 40, 7, 3, 25, 9, 1, 18]
    return [
        (torch.randint(1, 256, (lengths[i % 12],), generator=g).tolist(), news[i % 12])
        for i in range(count)
    ]


@pytest.mark.parametrize("end_bias", [None, ENDING_BIAS])
def test_a_sequence_yields_the_same_tokens_alone_and_in_a_changing_batch(
    model: Any, end_bias: float | None
) -> None:
    if end_bias is not None:  # some sequences then leave by END, not by MAX_NEW_TOKENS
        model.net.end_bias = end_bias
    jobs = [*jobs_of(1, 14), (ENDING_PROMPT, 50)]
    alone = [run_alone(model, *job) for job in jobs]
    together, sizes = run_continuous(model, jobs, max_active=5)
    assert [together[i] for i in range(len(jobs))] == alone
    assert max(sizes) == 5 and len(set(sizes)) > 2  # batches really mixed, joined and shrank
    ended_by_end = [t for t, (_, n) in zip(alone, jobs, strict=True) if len(t) < n]
    assert bool(ended_by_end) == (end_bias is not None)
    assert all(t[-1] == 0 and 0 not in t[:-1] for t in ended_by_end)


def test_padding_changes_nothing_and_the_cache_matches_a_full_recompute(
    decoder: ModuleType, model: Any
) -> None:
    prompt = list(range(1, 30))
    a, b = model.start([request(prompt, 8), request(prompt, 8)])
    short, long = model.start([request([7, 8], 8), request(list(range(100, 199)), 8)])
    for _ in range(8):  # a is never padded, b always is (to its partner's 98 and more)
        ((out_a, done_a), _), ((out_b, done_b), _) = model.step([a, short]), model.step([b, long])
        assert torch.equal(out_a["TOKEN"], out_b["TOKEN"]) and done_a == done_b
    # Padded keys add exactly 0; only BLAS's summation order by shape moves the last bits.
    assert a.length == b.length == len(prompt) - 1 + 8
    torch.testing.assert_close(model.cache(a), model.cache(b), rtol=0, atol=1e-12)

    # Without any cache: the whole sequence through the net again for every new token.
    net, sequence = model.net, list(prompt)
    with torch.inference_mode():
        for _ in range(8):
            tokens = torch.tensor([sequence])
            n = tokens.shape[1]
            cache = torch.zeros(decoder.LAYERS, 2, 1, decoder.HEADS, n, decoder.HEAD).double()
            causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
            hidden = net(tokens, torch.arange(n)[None], cache, causal)
            sequence.append(int(net.logits(hidden[:, -1]).argmax()))
    assert a.last == sequence[-1]
    assert run_alone(model, prompt, 8) == sequence[len(prompt) :]


def test_max_new_tokens_bounds_the_length(model: Any) -> None:
    for n in (1, 2, 17, 64):
        (state,) = model.start([request([5, 6, 7], n)])
        dones = [model.step([state])[0][1] for _ in range(n)]
        assert dones == [False] * (n - 1) + [True]
    with pytest.raises(RuntimeError, match="already finished"):
        model.step([state])
    assert [len(t) for t in run_continuous(model, jobs_of(2, 12), 8)[0].values()] == [
        n for _, n in jobs_of(2, 12)
    ]


def test_the_end_token_ends_a_sequence(model: Any) -> None:
    # As seeded, END never wins: the prompt runs to MAX_NEW_TOKENS.
    assert 0 not in run_alone(model, ENDING_PROMPT, 50)
    model.net.end_bias = ENDING_BIAS
    tokens = run_alone(model, ENDING_PROMPT, 50)
    assert len(tokens) == ENDS_AT and tokens[-1] == 0 and 0 not in tokens[:-1]
    # The bias is what keeps END out: its logit, and only its, is lowered by end_bias.
    hidden = torch.randn(3, 64, dtype=torch.float64)
    with torch.inference_mode():
        raw = model.net.head(model.net.ln(hidden))
        for bias in (2.0, -1.5):
            model.net.end_bias = bias
            biased = model.net.logits(hidden)
            assert torch.equal(biased[:, 1:], raw[:, 1:])
            assert torch.allclose(biased[:, 0], raw[:, 0] - bias, rtol=0, atol=1e-12)


def test_one_forward_per_step_and_per_start(model: Any) -> None:
    calls: list[tuple[int, ...]] = []
    forward = model.net.forward

    def counted(*args: Any) -> Any:
        calls.append(tuple(args[0].shape))
        return forward(*args)

    model.net.forward = counted
    states = model.start([request(p, 20) for p, _ in jobs_of(3, 7)])
    # One prefill: the 5 prompts longer than one token, padded to the longest less its last.
    assert calls == [(5, 89)]
    for _ in range(3):
        calls.clear()
        model.step(states)
        assert calls == [(7, 1)]  # one forward for all 7 sequences
    calls.clear()
    model.start([request([9], 3)])  # a one-token prompt has nothing to prefill
    assert calls == []


def test_release_frees_the_slot_and_the_last_live_sequence_moves_into_it(model: Any) -> None:
    first, second, third = model.start([request([1, 2, 3], 5), request([4], 5), request([9, 8], 5)])
    model.step([first, second, third])
    third_cache = model.cache(third).clone()
    model.release(first)
    assert first.slot is None and list(model.released) == [first.id]
    assert (second.slot, third.slot) == (1, 0) and torch.equal(model.cache(third), third_cache)
    model.step([second, third])  # the others step on, a view of slots 0..1 again
    model.release(first)  # twice is once
    model.release(second)
    model.release(third)
    assert list(model.released) == [first.id, second.id, third.id] and model.live == []


def test_the_stack_grows_past_its_first_slots(model: Any) -> None:
    jobs = jobs_of(4, 20)
    alone = [run_alone(model, *job) for job in jobs]
    states = model.start([request(*job) for job in jobs])  # 20 live: more than 8 slots
    assert model.kv.shape[2] >= 20 and [s.slot for s in states] == list(range(20))
    tokens: list[list[int]] = [[] for _ in jobs]
    live = list(range(20))
    while live:
        results = model.step([states[i] for i in live])
        for i, (out, done) in zip(list(live), results, strict=True):
            tokens[i].append(int(out["TOKEN"][0]))
            if done:
                model.release(states[i])
                live.remove(i)
    assert tokens == alone


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (request([], 4), "PROMPT is empty"),
        (request([0, 5], 4), r"in 1\.\.255, got 0\.\.5"),
        (request([5, 256], 4), "in 1..255"),
        ({"PROMPT": torch.tensor([1.5]), "MAX_NEW_TOKENS": torch.tensor([4])}, "in 1..255"),
        (request([5], 0), "MAX_NEW_TOKENS must be one integer >= 1"),
        ({"PROMPT": torch.tensor([5]), "MAX_NEW_TOKENS": torch.tensor([1, 2])}, "one integer"),
        (request([5] * 500, 13), "at most 512"),
        ({"PROMPT": torch.tensor([5])}, "PROMPT and MAX_NEW_TOKENS are required"),
    ],
)
def test_bad_inputs_are_refused_with_a_clear_message(
    model: Any, inputs: dict[str, torch.Tensor], message: str
) -> None:
    with pytest.raises(InputRefused, match=message):  # INVALID_ARGUMENT for its caller
        model.start([request([3, 4], 2), inputs])


def test_model_toml_declares_a_step_wise_model() -> None:
    config = tomllib.loads((DECODER / "model.toml").read_text())
    assert config.get("max_batch_size", 0) == 0
    assert [(i["name"], i["datatype"], i["shape"]) for i in config["input"]] == [
        ("PROMPT", "INT64", [-1]),
        ("MAX_NEW_TOKENS", "INT64", [1]),
    ]
    assert [(o["name"], o["datatype"], o["shape"]) for o in config["output"]] == [
        ("TOKEN", "INT64", [1])
    ]
    assert config["generate"] == {"max_active": 8, "max_steps": 256, "admission": "continuous"}
