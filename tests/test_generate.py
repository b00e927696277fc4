"""worker/generate.py: the continuous-batching loop, on a fake step-wise model."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchd.protos import wire
from batchd.protos.model_config import ModelConfig, TensorSpec, load_model_config
from batchd.worker import InputRefused
from batchd.worker.check import check_model
from batchd.worker.generate import EVERY, StepLoop
from batchd.worker.loader import load_model
from tests.conftest import stepwise_model

CPU = torch.device("cpu")


def config(max_active: int = 2, max_steps: int = 10, admission: str = "continuous") -> ModelConfig:
    return stepwise_model("fake", max_active, max_steps, admission)


class Counter:
    """Sequence n yields n*100 + k at step k and ends at step n; n == -1 raises in
    start, n == -2 raises in step, start refuses n == -3. Records every call."""

    def __init__(self) -> None:
        self.starts: list[list[int]] = []
        self.steps: list[list[int]] = []
        self.released: list[int] = []

    def start(self, requests: list[dict[str, torch.Tensor]]) -> list[dict[str, int]]:
        ns = [int(r["N"][0]) for r in requests]
        self.starts.append(ns)
        if -1 in ns:
            raise ValueError("n = -1 will not start")
        if -3 in ns:
            raise InputRefused("N must be >= 1, got -3")
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


def add(loop: StepLoop, seq: int, n: int, frontend: int = 0, credit: int = 0) -> list[Any]:
    header = wire.Header(kind=wire.Header.START, batch_id=seq, model="fake", credit=credit)
    header.tensors.add(name="N", datatype="INT64", shape=[1])
    return loop.add(frontend, header, [np.array([n], np.int64).tobytes()], CPU)


def replies(loop: StepLoop) -> list[tuple[int, list[int], bool, str]]:
    """One round: (sequence, values, final, error) per sequence, from its one message
    per frontend."""
    out = []
    for _, parts, ends in loop.round():
        header, frames = wire.unpack(parts)
        assert header.kind == wire.Header.STEP and ends == sum(s.final for s in header.steps)
        at = 0
        for step in header.steps:
            mine, at = frames[at : at + step.tensors], at + step.tensors
            values = [int(v) for f in mine for v in np.frombuffer(bytes(f), np.int64)]
            out.append((step.id, values, step.final, step.error))
        assert at == len(frames)
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


def test_a_round_is_one_message_per_frontend() -> None:
    loop = StepLoop(config(max_active=3), Counter())
    add(loop, 1, 2)
    add(loop, 2, 1)
    add(loop, 1, 3, frontend=1)  # ids are per frontend: another frontend's sequence 1
    messages = loop.round()
    assert [(to, ends) for to, _, ends in messages] == [(0, 1), (1, 0)]
    first, _ = wire.unpack(messages[0][1])
    assert [(s.id, s.final) for s in first.steps] == [(1, False), (2, True)]
    assert (first.active, first.round) == (3, 1) and first.compute_ns > 0
    other, frames = wire.unpack(messages[1][1])
    assert [(s.id, s.tensors) for s in other.steps] == [(1, 1)]
    assert np.frombuffer(bytes(frames[0]), np.int64).tolist() == [301]


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


def test_drop_all_ends_every_sequence_with_a_final_step_to_its_frontend() -> None:
    model = Counter()
    loop = StepLoop(config(max_active=1), model)
    add(loop, 1, 9)
    add(loop, 1, 8, frontend=1)  # waits for the slot
    replies(loop)
    messages = loop.drop_all("gone")
    assert [(to, ends) for to, _, ends in messages] == [(0, 1), (1, 1)]
    for _, parts, _ in messages:
        header, _ = wire.unpack(parts)
        assert [(s.id, s.final, s.error) for s in header.steps] == [(1, True, "gone")]
    assert model.released == [9] and not loop.busy  # the waiting one had no state


def test_cancel_every_drops_all_of_one_frontend_s_sequences_and_no_other_s() -> None:
    model = Counter()
    loop = StepLoop(config(max_active=2), model)
    add(loop, 1, 9)
    add(loop, 2, 8, frontend=1)
    add(loop, 3, 7)  # waits
    replies(loop)
    assert loop.cancel(0, EVERY) == 2  # a frontend given up on (frontend_link.py)
    assert model.released == [9] and [seq for seq, *_ in replies(loop)] == [2]


def test_start_raising_fails_only_the_joining_sequences() -> None:
    model = Counter()
    loop = StepLoop(config(max_active=3), model)
    add(loop, 1, 5)
    replies(loop)
    add(loop, 2, -1)
    out = replies(loop)
    assert (2, [], True, "start() raised: ValueError: n = -1 will not start") in out
    assert [seq for seq, *_ in out if seq == 1] == [1]  # 1 stepped on


def test_start_returning_too_few_states_is_named_so_not_as_a_raise() -> None:
    model = Counter()
    model.start = lambda requests: []  # type: ignore[method-assign]
    loop = StepLoop(config(), model)
    add(loop, 1, 5)
    assert replies(loop) == [(1, [], True, "start() returned 0 states for 1 request(s)")]


def test_start_or_step_returning_none_is_named_so_not_as_a_raise() -> None:
    """A model that forgot `return` was said to have raised: "start() raised: TypeError:
    object of type 'NoneType' has no len()" (review 57f)."""
    for call, said in (
        ("start", "start() returned NoneType, not a list of states, for 1 request(s)"),
        ("step", "step() returned NoneType, not a list of results, for 1 sequences"),
    ):
        model = Counter()
        setattr(model, call, lambda _: None)
        loop = StepLoop(config(), model)
        add(loop, 1, 5)
        assert replies(loop) == [(1, [], True, said)], call


def test_start_refusing_inputs_marks_the_failure_the_caller_s_and_only_the_refused_one_s() -> None:
    """InputRefused from a start of several: each starts alone again, and only the
    refused sequence ends, with the model's message alone and `invalid` set."""
    model = Counter()
    loop = StepLoop(config(max_active=3), model)
    add(loop, 1, 2)
    add(loop, 2, -3)
    loop.round()
    assert model.starts == [[2, -3], [2], [-3]]
    header, _ = wire.unpack(add(loop, 3, -3) or loop.round()[0][1])
    (step,) = [s for s in header.steps if s.id == 3]
    assert (step.final, step.invalid, step.error) == (True, True, "N must be >= 1, got -3")
    assert not any(s.invalid for s in header.steps if s.id != 3)


def test_a_start_of_several_that_raised_starts_each_alone_on_its_inputs_as_they_came() -> None:
    """start() changed the inputs it got (in place, or a key popped), then raised: each
    sequence then started alone on what was left, the innocent answering from inputs
    shifted twice, the poison not failing at all, or every one failing a KeyError
    (review 57f)."""

    class Shifting(Counter):
        def start(self, requests: list[dict[str, torch.Tensor]]) -> list[dict[str, int]]:
            for r in requests:
                r["N"] += 1  # in place, before it finds the one it will not start
            ns = [int(r.pop("N")[0]) for r in requests]
            self.starts.append(ns)
            if 0 in ns:
                raise ValueError("a shifted 0 will not start")
            return [{"n": n, "k": 0} for n in ns]

    model = Shifting()
    loop = StepLoop(config(max_active=3), model)
    add(loop, 1, 2)
    add(loop, 2, -1)
    out = replies(loop)
    assert model.starts == [[3, 0], [3], [0]]  # each alone shifted once, as it came
    assert (1, [301], False, "") in out
    assert (2, [], True, "start() raised: ValueError: a shifted 0 will not start") in out


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


def test_the_model_runs_under_inference_mode() -> None:
    modes: list[bool] = []

    class Watched(Counter):
        def start(self, requests: list[dict[str, torch.Tensor]]) -> list[dict[str, int]]:
            modes.append(torch.is_inference_mode_enabled())
            return super().start(requests)

        def step(self, states: list[dict[str, int]]) -> list[tuple[dict[str, Any] | None, bool]]:
            modes.append(torch.is_inference_mode_enabled())
            return super().step(states)

        def release(self, state: dict[str, int]) -> None:
            modes.append(torch.is_inference_mode_enabled())

    loop = StepLoop(config(), Watched())
    add(loop, 1, 1)
    replies(loop)
    assert modes == [True, True, True]


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


def test_a_step_output_past_what_a_response_carries_fails_before_it_is_made() -> None:
    """START's max_response_bytes (the stream's cap): a step whose output is more (a
    view of 4 TiB here, which made was a RuntimeError, or the worker's memory) fails its
    sequence with `too_large` before it is made, as do outputs more together; a step
    within it is sent; the rest go on."""
    widths = {1: (2, 2), 2: (1 << 40, 1), 3: (16, 1), 4: (5, 5)}  # OUT's, OUT2's

    class Huge(Counter):
        def step(self, states: list[dict[str, int]]) -> list[tuple[dict[str, Any] | None, bool]]:
            zero = torch.zeros(1, dtype=torch.int64)
            ws = [widths[s["n"]] for s in states]
            return [({"OUT": zero.expand(a), "OUT2": zero.expand(b)}, False) for a, b in ws]

    wide = (TensorSpec("OUT", "INT64", (-1,)), TensorSpec("OUT2", "INT64", (-1,)))
    loop = StepLoop(dataclasses.replace(config(max_active=4), outputs=wide), Huge())
    for n in widths:
        header = wire.Header(kind=wire.Header.START, batch_id=n, model="fake",
                             max_response_bytes=64)  # fmt: skip
        header.tensors.add(name="N", datatype="INT64", shape=[1])
        assert loop.add(0, header, [np.array([n], np.int64).tobytes()], CPU) == []
    ((_, parts, _),) = loop.round()
    header, frames = wire.unpack(parts)
    steps = {s.id: s for s in header.steps}
    assert not steps[1].error and not steps[1].final and bytes(frames[0]) == bytes(16)
    assert steps[2].too_large and steps[2].final and "holds 8796093022208 bytes" in steps[2].error
    assert steps[3].too_large and "output 'OUT' holds 128 bytes (shape [16]" in steps[3].error
    assert steps[4].too_large and "outputs holding 80 bytes, more than" in steps[4].error
    assert [s.seq_id for s in loop.active] == [1]


def test_models_check_runs_a_step_wise_model_through_the_loop(tmp_path: Path) -> None:
    """`batchd models DIR --check` on step-wise models: a sequence of zeros runs to its
    end; one whose outputs are not as declared fails; one whose start() refuses zeros
    (InputRefused) is ok, with a note that its outputs were not checked."""
    toml = (
        '[[input]]\nname = "N"\ndatatype = "INT64"\nshape = [1]\n'
        '[[output]]\nname = "OUT"\ndatatype = "{out}"\nshape = [1]\n'
        "[generate]\nmax_active = 2\nmax_steps = 3\n"
    )
    model = (
        "import torch\n"
        "from batchd.worker import InputRefused\n"
        "class M:\n"
        "    def start(self, requests):\n"
        "        if {refuse}:\n"
        "            raise InputRefused('N must be >= 1')\n"
        "        return [0 for _ in requests]\n"
        "    def step(self, states):\n"
        "        return [({{'OUT': torch.tensor([7])}}, False) for _ in states]\n"
        "def load(device):\n"
        "    return M()\n"
    )
    for name, out, refuse in (("good", "INT64", False), ("wrong", "FP32", False),
                              ("picky", "INT64", True)):  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.toml").write_text(toml.format(out=out))
        (tmp_path / name / "model.py").write_text(model.format(refuse=refuse))
    rows = {r.model: r for r in (check_model(tmp_path / n) for n in ("good", "wrong", "picky"))}
    assert rows["good"].problem is None and rows["good"].note == "a sequence of zeros ran 3 step(s)"
    assert "declared FP32" in (rows["wrong"].problem or "")
    assert rows["picky"].problem is None
    assert "refused (N must be >= 1)" in (rows["picky"].note or "")


def test_the_readme_step_wise_example_runs(tmp_path: Path) -> None:
    """The README's step-wise model.toml and model.py, as written there: `--check`
    runs them, and sequences of several lengths step together to their ends."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("\n## Step-wise models\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    toml = next(code for lang, code in blocks if lang == "toml")
    source = next(code for lang, code in blocks if lang == "python" and "def load" in code)
    (tmp_path / "gru").mkdir()
    (tmp_path / "gru" / "model.toml").write_text(toml)
    (tmp_path / "gru" / "model.py").write_text(source)
    row = check_model(tmp_path / "gru")
    assert row.problem is None and row.note == "a sequence of zeros ran 1 step(s)", row

    cfg = load_model_config(tmp_path / "gru")
    loop = StepLoop(cfg, load_model(cfg, CPU))
    for seq, (prompt, new) in enumerate([([5, 6, 7], 4), ([9], 2), ([1, 2, 3, 4, 5], 3)]):
        header = wire.Header(kind=wire.Header.START, batch_id=seq, model="gru")
        header.tensors.add(name="PROMPT", datatype="INT64", shape=[len(prompt)])
        header.tensors.add(name="MAX_NEW_TOKENS", datatype="INT64", shape=[1])
        frames = [np.array(prompt, np.int64).tobytes(), np.array([new], np.int64).tobytes()]
        assert loop.add(0, header, frames, CPU) == []
    tokens: dict[int, int] = {}
    sizes = []
    while loop.busy:
        for _, parts, _ in loop.round():
            message, _ = wire.unpack(parts)
            sizes.append(message.active)
            for step in message.steps:
                assert not step.error, step.error
                tokens[step.id] = tokens.get(step.id, 0) + 1
    assert sizes[0] == 3  # one forward for all three
    assert tokens == {0: 4, 1: 2, 2: 3}  # MAX_NEW_TOKENS each (END did not come)


def test_a_frontend_whose_sequences_all_wait_hears_the_loop_step() -> None:
    """--frontends N share a worker: one frontend's sequences wait for a slot while
    another's run. It gets an empty STEP (no entries, no round to count), so it does
    not judge the worker stuck past execution_timeout_s."""
    loop = StepLoop(config(max_active=1), Counter())
    add(loop, 1, 5, frontend=0)
    add(loop, 1, 5, frontend=1)  # waits: the one slot is frontend 0's
    messages = {to: (wire.unpack(parts)[0], ends) for to, parts, ends in loop.round()}
    assert sorted(messages) == [0, 1]
    waiting, ends = messages[1]
    assert (waiting.kind, list(waiting.steps), waiting.round, ends) == (wire.Header.STEP, [], 0, 0)
    assert messages[0][0].round == 1 and len(messages[0][0].steps) == 1


def test_a_sequence_whose_credit_is_spent_keeps_its_slot_and_state_till_credit_comes() -> None:
    """Flow control: each step's outputs take their bytes and wire.OUTPUT_COST from
    the sequence's credit. Spent: the loop steps the others, keeps its state and slot,
    and counts no step for it; CREDIT: it goes on from where it was. A step past the
    credit left is held here, its Step saying what it needs, and sent once it came."""
    model = Counter()
    loop = StepLoop(config(max_active=2), model)
    cost = 8 + wire.OUTPUT_COST  # one INT64 a step
    add(loop, 1, 9, credit=2 * cost)  # two steps' worth
    add(loop, 2, 8)  # no credit: not flow-controlled
    add(loop, 3, 7)  # waits: the two slots stay taken while 1 is held
    assert [values for _, values, *_ in replies(loop)] == [[901], [801]]
    assert [values for _, values, *_ in replies(loop)] == [[902], [802]]
    assert replies(loop) == [(2, [803], False, "")]
    assert replies(loop) == [(2, [804], False, "")]
    assert model.starts == [[9, 8]] and model.released == []
    loop.credit(1, 1, cost)  # another frontend's sequence 1: not this one
    assert replies(loop) == [(2, [805], False, "")]
    loop.credit(0, 1, 1)  # a byte: it steps once more, but that step waits here
    ((header, _),) = [wire.unpack(parts) for _, parts, _ in loop.round()]
    assert [(s.id, s.tensors, s.final, s.need) for s in header.steps] == [
        (1, 0, False, cost),
        (2, 1, False, 0),
    ]
    assert replies(loop) == [(2, [807], False, "")]  # held: neither sent nor stepped on
    loop.credit(0, 1, cost - 1)  # what it said it needs
    assert replies(loop) == [(1, [903], False, ""), (2, [808], True, "")]
    assert replies(loop) == [(3, [701], False, "")]  # 1's credit spent again; 3 takes 2's slot


def test_a_loop_whose_sequences_are_all_held_is_idle_and_beats_for_the_waiting() -> None:
    """Nothing to step: the compute thread must not spin on it. A frontend whose
    sequence waits behind held ones still hears that the loop lives."""
    model = Counter()
    loop = StepLoop(config(max_active=1), model)
    add(loop, 1, 9, credit=1)  # one step, then held
    replies(loop)
    assert not loop.busy
    add(loop, 1, 5, frontend=1)  # waits for the held one's slot
    assert not loop.busy and loop.waiting
    messages = {to: wire.unpack(parts)[0] for to, parts, _ in loop.round()}
    assert list(messages) == [1] and list(messages[1].steps) == []
    assert model.steps == [[9]]  # no step ran
    loop.credit(0, 1, 8 + wire.OUTPUT_COST)  # what its one step took, over its 1
    assert loop.busy
    loop.cancel(0, 1)
    assert loop.busy  # the waiting one may start now
    assert replies(loop) == [(1, [501], False, "")]
