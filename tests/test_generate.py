"""worker/generate.py: the continuous-batching loop, on a fake step-wise model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchd.protos import wire
from batchd.protos.model_config import GenerateConfig, ModelConfig, TensorSpec
from batchd.worker.generate import StepLoop

CPU = torch.device("cpu")


def config(max_active: int = 2, max_steps: int = 10, admission: str = "continuous") -> ModelConfig:
    return ModelConfig(
        name="fake",
        directory=Path("."),
        artifact=Path("model.py"),
        platform="python",
        max_batch_size=0,
        inputs=(TensorSpec("N", "INT64", (1,)),),
        outputs=(TensorSpec("OUT", "INT64", (1,)),),
        generate=GenerateConfig(max_active, max_steps, admission),
    )


class Counter:
    """Sequence n yields n*100 + k at step k and ends at step n; n == -1 raises in
    start, n == -2 raises in step. Records every call."""

    def __init__(self) -> None:
        self.starts: list[list[int]] = []
        self.steps: list[list[int]] = []
        self.released: list[int] = []

    def start(self, requests: list[dict[str, torch.Tensor]]) -> list[dict[str, int]]:
        ns = [int(r["N"][0]) for r in requests]
        self.starts.append(ns)
        if -1 in ns:
            raise ValueError("n = -1 will not start")
        return [{"n": n, "k": 0} for n in ns]

    def step(self, states: list[dict[str, int]]) -> list[tuple[dict[str, Any] | None, bool]]:
        self.steps.append([s["n"] for s in states])
        if any(s["n"] == -2 for s in states):
            raise RuntimeError("n = -2 breaks the step")
        out: list[tuple[dict[str, Any] | None, bool]] = []
        for s in states:
            s["k"] += 1
            out.append(({"OUT": torch.tensor([s["n"] * 100 + s["k"]])}, s["k"] >= s["n"]))
        return out

    def release(self, state: dict[str, int]) -> None:
        self.released.append(state["n"])


def add(loop: StepLoop, seq: int, n: int) -> list[Any]:
    header = wire.Header(kind=wire.Header.START, batch_id=seq, model="fake")
    header.tensors.add(name="N", datatype="INT64", shape=[1])
    return loop.add(0, header, [np.array([n], np.int64).tobytes()], CPU)


def replies(loop: StepLoop) -> list[tuple[int, list[int], bool, str]]:
    """One round: (sequence, values, final, error) per message."""
    out = []
    for _, parts, final in loop.round():
        header, frames = wire.unpack(parts)
        values = [int(v) for f in frames for v in np.frombuffer(bytes(f), np.int64)]
        assert header.final == final
        out.append((header.batch_id, values, final, header.error))
    return out


def test_sequences_join_and_leave_between_steps() -> None:
    model = Counter()
    loop = StepLoop(config(max_active=2), model)
    add(loop, 1, 3)
    add(loop, 2, 1)
    add(loop, 3, 2)  # waits: two slots
    assert replies(loop) == [(1, [301], False, ""), (2, [101], True, "")]
    assert model.released == [1]  # sequence 2 (n = 1) left after its one step
    assert replies(loop) == [(1, [302], False, ""), (3, [201], False, "")]  # 3 joined
    assert replies(loop) == [(1, [303], True, ""), (3, [202], True, "")]
    assert model.starts == [[3, 1], [2]] and not loop.busy
    assert model.released == [1, 3, 2]


def test_static_admission_waits_for_the_whole_batch() -> None:
    model = Counter()
    loop = StepLoop(config(max_active=2, admission="static"), model)
    for seq, n in ((1, 3), (2, 1), (3, 1)):
        add(loop, seq, n)
    replies(loop)  # 1 (n = 3) and 2 (n = 1) start; 2 ends
    replies(loop)  # 1 alone: 3 may not join a batch that has not ended
    assert model.steps == [[3, 1], [3]]
    replies(loop)
    replies(loop)  # now 3
    assert model.steps == [[3, 1], [3], [3], [1]]


def test_a_cancelled_sequence_is_released_and_never_stepped_again() -> None:
    model = Counter()
    loop = StepLoop(config(), model)
    add(loop, 1, 9)
    add(loop, 2, 8)
    replies(loop)
    loop.cancel(0, 1)
    assert model.released == [9]  # sequence 1's state
    assert [seq for seq, *_ in replies(loop)] == [2]
    assert model.steps[-1] == [8]
    loop.cancel(1, 2)  # another frontend's sequence 2: not this one
    assert [seq for seq, *_ in replies(loop)] == [2]


def test_start_raising_fails_only_the_joining_sequences() -> None:
    model = Counter()
    loop = StepLoop(config(max_active=3), model)
    add(loop, 1, 5)
    replies(loop)
    add(loop, 2, -1)
    out = replies(loop)
    assert (2, [], True, "start() raised: ValueError: n = -1 will not start") in out
    assert [seq for seq, *_ in out if seq == 1] == [1]  # 1 stepped on


def test_step_raising_fails_the_sequences_of_that_step_and_the_loop_goes_on() -> None:
    model = Counter()
    loop = StepLoop(config(max_active=3), model)
    add(loop, 1, 5)
    add(loop, 2, -2)
    out = replies(loop)
    assert {(seq, final, error) for seq, _, final, error in out} == {
        (1, True, "step() raised: RuntimeError: n = -2 breaks the step"),
        (2, True, "step() raised: RuntimeError: n = -2 breaks the step"),
    }
    assert sorted(model.released) == [-2, 5] and not loop.busy
    add(loop, 3, 1)
    assert replies(loop) == [(3, [101], True, "")]


def test_max_steps_ends_a_sequence_the_model_would_not() -> None:
    loop = StepLoop(config(max_steps=2), Counter())
    add(loop, 1, 9)
    assert replies(loop)[0][2] is False
    assert replies(loop) == [(1, [902], True, "")]


def test_an_output_that_is_not_what_the_model_declares_fails_its_sequence() -> None:
    class Wrong(Counter):
        def step(self, states: list[dict[str, int]]) -> list[tuple[dict[str, Any] | None, bool]]:
            return [({"OUT": torch.tensor([1.5])}, False) for _ in states]

    loop = StepLoop(config(), Wrong())
    add(loop, 1, 3)
    ((seq, _, final, error),) = replies(loop)
    assert seq == 1 and final and "declared INT64" in error
