"""The worker's pure parts in-process: the three artifact loaders,
`run_batch`'s checks of what a model returns, and loading and unloading."""

from __future__ import annotations

import ast
import contextlib
import gc
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from batchd.protos import wire
from batchd.protos.model_config import TensorSpec, load_model_config, model_key
from batchd.protos.repository import digest, files_of, find_model, identity
from batchd.protos.tensors import from_raw, to_raw
from batchd.worker import loading
from batchd.worker import runner as runner_module
from batchd.worker.__main__ import _endpoints
from batchd.worker.execute import BatchError, OutputTooLarge, encode_output, run_batch, why
from batchd.worker.frontend_link import FrontendLink
from batchd.worker.generate import EVERY, time_limit
from batchd.worker.loader import defaults_kept, load_model
from batchd.worker.loading import Loaded, load
from batchd.worker.runner import Runner, RunnerOptions
from tests.conftest import make_model, model_log, stepwise_toml
from tests.servers import wait_for
from tests.test_worker_behind import FLOOD_PY

InProcess = tuple[Path, Runner, "zmq.Context[Any]", "zmq.Socket[Any]"]  # in_process()'s
CPU = torch.device("cpu")
TOML = """max_batch_size = 8
[[input]]
name = "X"
datatype = "FP32"
shape = [4]
[[output]]
name = "Y"
datatype = "FP32"
shape = [4]
"""


def repo_model(tmp_path: Path, artifact: str, write: Any, toml: str = TOML) -> Path:
    d = tmp_path / artifact.replace(".", "_")
    d.mkdir()
    (d / "model.toml").write_text(toml)
    write(d / artifact)
    return d


def batch(arr: np.ndarray, name: str = "X") -> tuple[list[wire.Tensor], list[bytes]]:
    datatype, shape, raw = to_raw(arr)
    return [wire.Tensor(name=name, datatype=datatype, shape=shape)], [raw]


def install(runner: Runner, header: wire.Header) -> str:
    """Load as the loader thread does, and install: LOADED's error ("" once loaded)."""
    o = runner.options
    held = runner.held.models.items()
    have = {k: (cfg.directory, files_of(cfg.directory)) for k, (cfg, _) in held}
    loaded = load(header, o.repository, o.device, o.allowed, have)  # (held: as its files are)
    if loaded.model is not None:
        runner._install(loaded)
    return loaded.error


def unload(runner: Runner, header: wire.Header) -> None:
    """Unload as the loader hands an UNLOAD on (with the copy installed) and the compute
    thread runs it."""
    runner._unload(header, [runner.held.take(model_key(header.model, header.version))])


def run(d: Path, arr: np.ndarray) -> np.ndarray:
    cfg = load_model_config(d)
    tensors, frames = batch(arr)
    headers, out = run_batch(load_model(cfg, CPU), cfg, CPU, tensors, frames)
    return from_raw(headers[0].datatype, headers[0].shape, bytes(out[0]))


@pytest.fixture
def linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4).eval()


X = np.arange(8, dtype=np.float32).reshape(2, 4)


def test_torchscript_artifact(tmp_path: Path, linear: torch.nn.Module) -> None:
    def write(p: Path) -> None:
        with warnings.catch_warnings():  # torch 2.13 deprecates scripting; loading stays
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.script(linear).save(str(p))

    d = repo_model(tmp_path, "model.pt", write)
    with torch.inference_mode():
        assert np.allclose(run(d, X), linear(torch.from_numpy(X)).numpy())


def test_torch_export_artifact(tmp_path: Path, linear: torch.nn.Module) -> None:
    def write(p: Path) -> None:
        batch_dim = torch.export.Dim("batch", min=1, max=8)
        program = torch.export.export(
            linear, (torch.zeros(2, 4),), dynamic_shapes={"input": {0: batch_dim}}
        )
        torch.export.save(program, str(p))

    d = repo_model(tmp_path, "model.pt2", write)
    with torch.inference_mode():
        assert np.allclose(run(d, X[:1]), linear(torch.from_numpy(X[:1])).numpy(), atol=1e-6)


@pytest.mark.parametrize(
    ("example", "dim", "takes"),
    [
        (1, None, "only batches of 1 row(s)"),
        (2, torch.export.Dim("b", max=4), "batches of 0 to 4 rows"),
        (3, torch.export.Dim("b", min=3), "batches of 3 or more rows"),
        (2, torch.export.Dim.AUTO, ""),  # [2, oo]: torch runs a batch of 1 even so
        (2, torch.export.Dim("b", max=8), ""),
    ],
)
def test_a_program_that_cannot_take_every_batch_size_is_refused_at_load(
    tmp_path: Path, linear: torch.nn.Module, example: int, dim: Any, takes: str
) -> None:
    """Exported without a dynamic batch dim (or with one too small for max_batch_size
    8), it loaded, and each other batch failed in its forward, saying no more than
    "Guard failed: x.size()[0] == 1". Those that take 1 to 8 rows load."""
    shapes = None if dim is None else {"input": {0: dim}}

    def write(p: Path) -> None:
        program = torch.export.export(linear, (torch.zeros(example, 4),), dynamic_shapes=shapes)
        torch.export.save(program, str(p))

    d = repo_model(tmp_path, "model.pt2", write)
    if not takes:
        model = load_model(load_model_config(d), CPU)
        with torch.inference_mode():
            assert [len(model(torch.zeros(n, 4))) for n in range(1, 9)] == list(range(1, 9))
        return
    with pytest.raises(ValueError) as e:
        load_model(load_model_config(d), CPU)
    assert f"input X ('input' in the program) takes {takes} as exported" in str(e.value)
    assert "max_batch_size = 8 sends batches of 1 to 8" in str(e.value)
    assert "dynamic_shapes={'input': {0: torch.export.Dim('batch', max=8)}}" in str(e.value)


def test_python_artifact_gets_the_device(tmp_path: Path) -> None:
    code = "def load(device):\n    assert str(device) == 'cpu'\n    return lambda x: x + 1\n"
    d = repo_model(tmp_path, "model.py", lambda p: p.write_text(code))
    assert run(d, X).tolist() == (X + 1).tolist()


def test_python_artifact_without_load_is_named(tmp_path: Path) -> None:
    d = repo_model(tmp_path, "model.py", lambda p: p.write_text("x = 1\n"))
    with pytest.raises(TypeError, match="defines no load"):
        load_model(load_model_config(d), CPU)


def test_inputs_are_private_writable_copies(tmp_path: Path) -> None:
    code = "def load(device):\n    return lambda x: x.mul_(2)\n"  # writes into its input
    d = repo_model(tmp_path, "model.py", lambda p: p.write_text(code))
    cfg = load_model_config(d)
    tensors, frames = batch(X)
    before = bytes(frames[0])
    run_batch(load_model(cfg, CPU), cfg, CPU, tensors, frames)
    assert frames[0] == before


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "x.double()",
            "output 'Y' is declared FP32 (torch.float32), the model returned torch.float64",
        ),
        ("x[:1]", "output 'Y': expected shape [2, 4], the model returned [1, 4]"),
        ("x[:, :3]", "expected shape [2, 4], the model returned [2, 3]"),
        ("(x, x)", "the model returned 2 output(s), model.toml declares 1"),
        ("{'Z': x}", "the model returned a dict without output(s) ['Y']"),
        ("'text'", "output 'Y': the model returned str, expected a tensor"),
        # other layouts: named, not torch's own text about a missing kernel
        ("x.to_sparse()", "output 'Y' is a sparse_coo tensor, expected a dense (strided) one"),
        ("x.to_mkldnn()", "output 'Y' is a _mkldnn tensor, expected a dense"),
        ("torch.empty_like(x, device='meta')", "output 'Y' is a meta tensor, expected a dense"),
        (
            "torch.nested.nested_tensor(list(x), layout=torch.jagged)",
            "output 'Y' is a nested tensor, expected a dense",
        ),
        # a view of 16 TiB: refused by its shape, before a copy (which fails, or takes
        # the worker's memory and its execution_timeout_s)
        (
            "x[:, :1, None].expand(2, 4, 1 << 42)",
            "expected shape [2, 4], the model returned [2, 4, 4398046511104]",
        ),
    ],
)
def test_bad_outputs_are_named(tmp_path: Path, body: str, message: str) -> None:
    code = f"import torch\ndef load(device):\n    return lambda x: {body}\n"
    d = repo_model(tmp_path, "model.py", lambda p: p.write_text(code))
    with pytest.raises(BatchError) as info:
        run(d, X)
    assert message in str(info.value)


def test_an_output_no_response_may_carry_is_refused_before_it_is_copied() -> None:
    """`most` (Header.max_response_bytes): an output whose every row is past it is
    refused by its shape alone; one that fits a row, or exactly, is encoded. A ragged
    one is not judged (its requests' rows differ), nor BYTES till encoded."""
    y = TensorSpec("Y", "FP32", (-1,))
    view = torch.zeros(1, 1).expand(3, 1 << 40)  # 4 TiB a row, never made
    with pytest.raises(OutputTooLarge, match=r"output 'Y' holds 4398046511104 bytes a row "
                       r"\(shape \[3, 1099511627776\], FP32\), more than a response may "
                       r"carry \(1024, --max-message-bytes\)"):  # fmt: skip
        encode_output(y, view, True, rows=3, most=1024)
    assert encode_output(y, torch.zeros(3, 256), True, rows=3, most=1024)[0].shape == [3, 256]
    with pytest.raises(OutputTooLarge, match="1028 bytes a row"):
        encode_output(y, np.zeros((3, 257), np.float32), True, rows=3, most=1024)
    with pytest.raises(OutputTooLarge, match=r"holds 2048 bytes \(shape \[512\]"):
        encode_output(y, torch.zeros(512), False, most=1024)  # (no batch dim: one request)
    with pytest.raises(OutputTooLarge, match="1200 bytes a row"):
        encode_output(TensorSpec("B", "BYTES", (1,)), np.array([[b"x" * 1196]], object), True,
                      rows=1, most=1024)  # (its 4-byte length, then its bytes)  # fmt: skip
    packed = TensorSpec("P", "FP32", (-1,), ragged_like="X")
    assert encode_output(packed, torch.zeros(512), True, rows=1, packed=512, most=1024)[0]


def test_dict_and_numpy_outputs_are_accepted(tmp_path: Path) -> None:
    code = "def load(device):\n    return lambda x: {'Y': x.numpy() * 3}\n"
    d = repo_model(tmp_path, "model.py", lambda p: p.write_text(code))
    assert run(d, X).tolist() == (X * 3).tolist()


CYCLIC_MODEL = """
class Model:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector can free it

    def __call__(self, x):
        return x


def load(device):
    return Model()
"""


def test_an_unloaded_model_is_freed_though_loading_froze_the_heap(tmp_path: Path) -> None:
    d = repo_model(tmp_path, "model.py", lambda p: p.write_text(CYCLIC_MODEL))
    runner = Runner(RunnerOptions("w", "ipc://unused", CPU, tmp_path))
    header = wire.Header(kind=wire.Header.LOAD, model=d.name, version="1")
    try:
        assert install(runner, header) == ""
        assert gc.get_freeze_count() > 0  # the loaded model is out of the collector's sight
        ref = weakref.ref(runner.held.models[model_key(d.name, "1")][1])
        unload(runner, header)
        assert (
            runner._collections.run(time.monotonic(), runner._timed) is None
        )  # (the first: at once)
        assert ref() is None  # ... until it is unloaded
    finally:
        gc.unfreeze()


def test_a_copy_a_load_of_changed_files_replaced_is_dropped_as_an_unload_s(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A LOAD of a version held, its files changed since, loads it again; the copy it
    replaced was never collected (frozen by the load) till another unload (review 55b).
    Its drop says so, not "unloaded" (review 55c)."""
    d = repo_model(tmp_path, "model.py", lambda p: p.write_text(CYCLIC_MODEL))
    runner = Runner(RunnerOptions("w", "ipc://unused", CPU, tmp_path))
    header = wire.Header(kind=wire.Header.LOAD, model=d.name, version="1")
    key = model_key(d.name, "1")
    try:
        assert install(runner, header) == ""
        have = {key: (d, files_of(d))}
        ref = weakref.ref(runner.held.models[key][1])
        (d / "model.py").write_text(CYCLIC_MODEL + "# changed\n")
        loaded = load(header, tmp_path, CPU, (), have)
        assert loaded.model is not None
        runner._install(loaded)
        del loaded
        item = runner._work.get_nowait()  # the old copy's drop
        assert (item[1].kind, item[1].model, item[1].version) == (wire.Header.UNLOAD, d.name, "1")
        with caplog.at_level(logging.INFO, logger="batchd.worker"):
            runner._handle(item, lambda *_: None)
        assert "model_py version 1 was reloaded (its files changed)" in caplog.text
        assert "unloaded" not in caplog.text
        assert runner._collections.run(time.monotonic(), runner._timed) is None
        assert ref() is None and key in runner.held.models
    finally:
        gc.unfreeze()


def test_unloads_of_one_copy_from_two_frontends_drop_it_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two frontends' UNLOADs of one version each dropped the copy: "unloaded" logged
    twice, two collections asked (review 55c). The second takes nothing."""
    with in_process(tmp_path, CYCLIC_MODEL) as (d, runner, ctx, results):
        runner._loader.start(ctx, runner_module._RESULTS)
        try:
            for frontend, kind in ((0, wire.Header.LOAD), (0, wire.Header.UNLOAD),
                                   (1, wire.Header.UNLOAD)):  # fmt: skip
                runner._loader.put((frontend, wire.Header(kind=kind, model=d.name,
                                                          version="1"), []))  # fmt: skip
            assert results.poll(30_000)
            with caplog.at_level(logging.INFO, logger="batchd.worker"):
                for _ in range(2):
                    runner._handle(runner._work.get(timeout=30), lambda *_: None)
            assert caplog.text.count("unloaded model") == 1
            assert not runner.held.models and not runner.held._taken
        finally:
            assert runner._loader.stop(10)


def test_unloads_back_to_back_share_a_collection_spaced_out(tmp_path: Path) -> None:
    """Each unload ran a full collection of the worker's every object on the compute
    thread (gc.unfreeze, then collect: 35-150 ms with the GIL held): reloads back to back
    took another model on the worker from 1,338 to 79 req/s. A collection now waits
    until the last is far enough behind, and the unloads meanwhile share it."""
    d = repo_model(tmp_path, "model.py", lambda p: p.write_text(CYCLIC_MODEL))
    runner = Runner(RunnerOptions("w", "ipc://unused", CPU, tmp_path))
    collected: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            collected.append(1)

    refs = []
    gc.callbacks.append(count)
    try:
        for version in "123":
            header = wire.Header(kind=wire.Header.LOAD, model=d.name, version=version)
            assert install(runner, header) == ""
            refs.append(weakref.ref(runner.held.models[model_key(d.name, version)][1]))
        collected.clear()  # (the loads' own)
        now = 1_000.0
        unload(runner, wire.Header(kind=wire.Header.UNLOAD, model=d.name, version="1"))
        assert (
            runner._collections.run(now, runner._timed) is None and refs[0]() is None and collected
        )
        collected.clear()
        for version in "23":
            unload(runner, wire.Header(kind=wire.Header.UNLOAD, model=d.name, version=version))
            wait = runner._collections.run(now, runner._timed)
            assert wait is not None and wait > 0 and not collected  # not yet, not at once
        assert refs[1]() is not None and refs[2]() is not None
        assert runner._collections.run(now + wait, runner._timed) is None  # its time: one, for both
        assert refs[1]() is None and refs[2]() is None and len(collected) == 1
        assert runner._collections.run(now + wait, runner._timed) is None and len(collected) == 1
    finally:
        gc.callbacks.remove(count)
        gc.unfreeze()


def test_an_idle_compute_thread_runs_a_spaced_collection_when_its_time_comes(
    tmp_path: Path,
) -> None:
    """With nothing else to do, the compute thread waits for the collection's time, not
    for work that may never come: an unload's model is freed without another message."""
    with in_process(tmp_path, CYCLIC_MODEL) as (d, runner, ctx, _):
        refs = []
        for version in "12":
            assert install(runner, wire.Header(kind=wire.Header.LOAD, model=d.name,
                                               version=version)) == ""  # fmt: skip
            refs.append(weakref.ref(runner.held.models[model_key(d.name, version)][1]))
        compute = threading.Thread(target=runner._compute, args=(ctx,))
        compute.start()
        try:
            for version in "12":  # the second's collection waits for the first's to age
                copy = runner.held.take(model_key(d.name, version))  # (as the loader hands
                runner._work.put((0, wire.Header(kind=wire.Header.UNLOAD, model=d.name,
                                                 version=version), [copy]))  # it on)  # fmt: skip
            del copy
            wait_for(lambda: refs[0]() is None and refs[1]() is None, 30, "both freed")
        finally:
            runner._work.put(None)
            compute.join()


@contextlib.contextmanager
def in_process(tmp_path: Path, code: str, toml: str = TOML) -> Iterator[InProcess]:
    """The model `code` as `model_py` in `tmp_path`, an in-process Runner for it, and the
    PULL socket its threads answer on: closed, the heap unfrozen, after."""
    d = repo_model(tmp_path, "model.py", lambda p: p.write_text(code), toml)
    runner = Runner(RunnerOptions("w", "ipc://unused", CPU, tmp_path))
    ctx: zmq.Context[Any] = zmq.Context()
    results = ctx.socket(zmq.PULL)
    results.bind(runner_module._RESULTS)
    try:
        yield d, runner, ctx, results
    finally:
        results.close(linger=0)
        ctx.term()
        gc.unfreeze()


def test_a_model_unloaded_is_freed_though_it_was_the_loader_s_last(tmp_path: Path) -> None:
    """The loader thread kept the last model it loaded in a local until its next load:
    an unload freed nothing (a worker of a 1 GiB model stayed at 1.25 GB, and unload A
    then load B peaked at both). And the UNLOAD it hands on carries the copy it drops:
    the compute loop kept the item after running it, so the model outlived its collection
    till the next unload's (review 55b: a worker kept 609 MB RSS after an unload, not 228)."""
    with in_process(tmp_path, CYCLIC_MODEL) as (d, runner, ctx, results):
        header = wire.Header(kind=wire.Header.LOAD, model=d.name, version="1")
        runner._loader.start(ctx, runner_module._RESULTS)
        try:
            runner._loader.put((0, header, []))
            assert results.poll(30_000)
            _, *parts = results.recv_multipart()
            assert wire.unpack(parts)[0].error == ""
            ref = weakref.ref(runner.held.models[model_key(d.name, "1")][1])
            runner._loader.put((0, wire.Header(kind=wire.Header.UNLOAD, model=d.name,
                                               version="1"), []))  # fmt: skip
            item = runner._work.get(timeout=30)  # (held, as the compute loop holds it)
            runner._handle(item, lambda *_: None)
            assert runner._collections.run(time.monotonic(), runner._timed) is None
            assert ref() is None
        finally:
            assert runner._loader.stop(10)


def test_a_load_of_a_version_installed_here_is_answered_at_once(tmp_path: Path) -> None:
    """With --frontends N, a frontend's LOAD of a model the worker already held waited in
    the loader's queue behind the loads other frontends asked before it, and its calls
    with it (review 54j: a 12 s load, 0 of 5 calls with a 5 s deadline answered). A LOAD
    of a version installed here from the same files (or said held), that nothing asked
    before it touches, is answered by the I/O thread at once; any other goes in turn."""
    with in_process(tmp_path, CYCLIC_MODEL) as (d, runner, ctx, results):
        files, folder = digest(files_of(d)), identity(tmp_path)
        header = wire.Header(kind=wire.Header.LOAD, model=d.name, version="1", files=files,
                             folder=folder)  # fmt: skip
        loader = runner._loader
        assert loader.at_once(header, False) is None  # (not installed yet)
        loader.start(ctx, runner_module._RESULTS)
        try:
            loader.put((0, header, []))
            assert results.poll(30_000)
            _, *parts = results.recv_multipart()
            assert wire.unpack(parts)[0].error == ""
            answer = loader.at_once(header, False)
            assert answer is not None
            said = wire.unpack(answer)[0]
            assert (said.kind, said.model, said.version, said.error) == (
                wire.Header.LOADED, d.name, "1", "")  # fmt: skip
            assert loader.at_once(header, True) is None  # (stopping: in turn, as before)
            other = wire.Header(kind=wire.Header.LOAD, model=d.name, version="1", files="x",
                                folder=folder)  # fmt: skip
            assert loader.at_once(other, False) is None  # (other files: load() decides)
            other.held = True
            assert loader.at_once(other, False) is not None
        finally:
            assert loader.stop(10)
        unload = wire.Header(kind=wire.Header.UNLOAD, model=d.name, version="1")
        loader.put((0, unload, []))  # (asked before it, not yet done: the loader stopped)
        assert loader.at_once(header, False) is None


LAZY_MODEL = """
def load(device):
    def forward(x):
        from . import helper  # (each call: from its package, in sys.modules)
        return helper.twice(x)
    return forward
"""


def test_an_unload_the_compute_thread_runs_late_drops_the_copy_it_was_asked_to(
    tmp_path: Path,
) -> None:
    """LOAD, UNLOAD and LOAD of one version, the compute thread busy: the loader installed
    the second copy, then the compute thread's older UNLOAD dropped it by key while the
    loader held it loaded: each later LOAD was answered LOADED and each batch failed "not
    loaded on this worker" (review 54k). It drops the copy installed as it was handed on,
    and that copy's package (a forward's `from . import` failed on the other), at its
    turn: the loader never waits for it (review 55a: while it did, every other LOAD did)."""
    with in_process(tmp_path, LAZY_MODEL) as (d, runner, ctx, results):
        (d / "helper.py").write_text("def twice(x):\n    return x * 2\n")
        load = wire.Header(kind=wire.Header.LOAD, model=d.name, version="1")
        unload = wire.Header(kind=wire.Header.UNLOAD, model=d.name, version="1")
        ours = lambda: {m for m in sys.modules if re.fullmatch(r"batchd_model_\w+", m)}  # noqa: E731
        before = ours()
        packages = lambda: ours() - before  # noqa: E731
        runner._threads_all = 1

        def run() -> wire.Header:
            got: list[Any] = []
            tensors, frames = batch(np.ones((1, 4), np.float32))
            header = wire.Header(kind=wire.Header.BATCH, model=d.name, version="1", batch_id=7,
                                 tensors=tensors)  # fmt: skip
            runner._handle((0, header, frames), lambda to, parts, ends=1: got.append(parts))
            return wire.unpack(got[0])[0]

        def answered() -> str:
            assert results.poll(30_000)
            _, *parts = results.recv_multipart()
            return wire.unpack(parts)[0].error

        runner._loader.start(ctx, runner_module._RESULTS)
        try:
            runner._loader.put((0, load, []))
            assert answered() == ""
            (first,) = packages()
            runner._loader.put((1, unload, []))  # (no compute thread: it waits)
            runner._loader.put((0, load, []))
            assert answered() == ""  # (not after the UNLOAD: nothing else would be either)
            assert len(packages()) == 2  # the old copy's, the new's
            assert runner._work.qsize() == 1  # the UNLOAD alone: the copy it took is not
            # dropped again, as one the LOAD replaced
            item = runner._work.get(timeout=30)
            assert item[1].kind == wire.Header.UNLOAD
            assert run().kind == wire.Header.RESULT  # (a batch asked before the UNLOAD)
            runner._handle(item, lambda *_: None)
            assert model_key(d.name, "1") in runner.held.models
            assert not runner.held._taken
            assert first not in packages() and len(packages()) == 1
            reply = run()
            assert (reply.kind, reply.error) == (wire.Header.RESULT, "")
        finally:
            assert runner._loader.stop(10)


def test_a_load_asked_while_the_same_one_waits_is_answered_with_it(tmp_path: Path) -> None:
    """With --frontends N, two frontends' LOADs of one model that reached the worker before
    it had installed it were answered in turn: the second behind the loads asked between
    them, and its frontend's calls with it (review 54j). It rides on the first now, if
    nothing tells them apart and no UNLOAD came between."""
    with in_process(tmp_path, CYCLIC_MODEL) as (d, runner, ctx, results):

        def ask(frontend: int, kind: int, version: str, held: bool = False) -> None:
            header = wire.Header(kind=kind, model=d.name, version=version, held=held)
            runner._loader.put((frontend, header, []))

        def answers(n: int) -> list[tuple[int, str, str]]:
            got = []
            for _ in range(n):
                assert results.poll(30_000)
                to, *parts = results.recv_multipart()
                said = wire.unpack(parts)[0]
                got.append((to[0], said.version, said.error))
            return got

        ask(0, wire.Header.LOAD, "1")
        ask(0, wire.Header.LOAD, "2")
        ask(1, wire.Header.LOAD, "1")  # rides on frontend 0's
        ask(1, wire.Header.LOAD, "1", held=True)  # (asks another thing: in turn)
        ask(0, wire.Header.UNLOAD, "2")
        ask(1, wire.Header.LOAD, "2")  # (an UNLOAD came between: in turn, after it)
        runner._loader.start(ctx, runner_module._RESULTS)
        try:
            assert answers(4) == [(0, "1", ""), (1, "1", ""), (0, "2", ""), (1, "1", "")]
            unload = runner._work.get(timeout=30)
            assert (unload[1].kind, unload[1].version) == (wire.Header.UNLOAD, "2")
            runner._handle(unload, lambda *_: None)
            assert answers(1) == [(1, "2", "")]
            assert {model_key(d.name, v) for v in "12"} <= runner.held.models.keys()
            assert not runner._loader._queued and not runner._loader._open
        finally:
            assert runner._loader.stop(10)


THREAD_COUNTING_MODEL = """
import os
import subprocess
import sys
import torch

def _threads():
    return len(os.listdir("/proc/self/task"))

def load(device):
    at_load = _threads()
    def forward(x):
        torch.nn.Linear(512, 2048)(torch.randn(4, 512))  # goes parallel where it may
        return torch.full_like(x, float(_threads() - at_load))
    return forward
"""


def _forwards(tmp_path: Path, source: str, count: int, threads: int = 1) -> list[float]:
    """The first output value of each of `count` one-row batches of a model of `source`,
    run on a runner's compute thread as `batchd worker --threads N` runs them."""
    d = repo_model(tmp_path, "model.py", lambda p: p.write_text(source))
    runner = Runner(RunnerOptions("w", "ipc://unused", CPU, tmp_path))
    ctx: zmq.Context[Any] = zmq.Context()
    results = ctx.socket(zmq.PULL)
    results.bind(runner_module._RESULTS)
    configured = torch.get_num_threads()
    torch.set_num_threads(threads)  # what `batchd worker --threads N` does before serving
    compute = threading.Thread(target=runner._compute, args=(ctx,))
    compute.start()
    values = []
    try:
        assert install(runner, wire.Header(kind=wire.Header.LOAD, model=d.name, version="1")) == ""
        for n in range(count):
            tensors, frames = batch(X)
            header = wire.Header(
                kind=wire.Header.BATCH, batch_id=n + 1, model=d.name, version="1", tensors=tensors
            )
            runner._work.put((0, header, frames))
            reply, out = wire.unpack(results.recv_multipart()[1:])
            assert reply.error == ""
            got = from_raw(reply.tensors[0].datatype, reply.tensors[0].shape, bytes(out[0]))
            values.append(float(got.max()))
    finally:
        runner._work.put(None)
        compute.join()
        results.close(linger=0)
        ctx.term()
        torch.set_num_threads(configured)
        gc.unfreeze()
    return values


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: OpenMP starts no team anyway")
def test_models_run_on_the_threads_configured_not_one_per_core(tmp_path: Path) -> None:
    # OpenMP keeps its thread count per thread: `--threads 1`, set in the main
    # thread, must also hold in the compute thread, or a large op starts a team of
    # one spinning thread per core there and takes the CPU the frontend needs.
    assert _forwards(tmp_path, THREAD_COUNTING_MODEL, 1) == [0.0]


def test_a_cancel_holds_the_compute_thread_to_its_own_model_version_s_limit() -> None:
    """A release() that hangs is held to its model version's execution_timeout_s: a
    CANCEL naming no version took the longest of the versions of that name (30 s for
    a 2 s one, reloaded beside it), one naming no model every loop's longest."""
    loops: Any = {
        model_key(name, version): SimpleNamespace(
            cfg=SimpleNamespace(instances=SimpleNamespace(execution_timeout_s=limit))
        )
        for name, version, limit in (("rel", "1", 2.0), ("rel", "2", 30.0), ("long", "1", 60.0))
    }
    cancel = wire.Header(kind=wire.Header.CANCEL, batch_id=7, model="rel", version="1")
    assert time_limit(loops, cancel) == 2.0
    assert time_limit(loops, wire.Header(kind=wire.Header.CANCEL, batch_id=EVERY)) == 60.0
    for runs_no_model_code in (wire.Header.START, wire.Header.CREDIT):
        assert time_limit(loops, wire.Header(kind=runs_no_model_code, model="rel")) is None


def test_a_model_that_sets_its_own_thread_count_leaves_the_next_batch_the_worker_s(
    tmp_path: Path,
) -> None:
    """torch.set_num_threads(7) in a forward stuck for every batch after it, any model's:
    the worker compared its own count with the one it had set last, not torch's."""
    source = (
        "import torch\n\ndef load(device):\n    def forward(x):\n"
        "        seen = torch.get_num_threads()\n        torch.set_num_threads(7)\n"
        "        return torch.full_like(x, float(seen))\n    return forward\n"
    )
    assert _forwards(tmp_path, source, 3, threads=2) == [2.0, 2.0, 2.0]


def test_no_worker_class_shares_a_name_with_a_server_class() -> None:
    """A reader who meets `Runner` or `Batch` must know which side of the wire it is on."""
    root = Path(__file__).resolve().parent.parent

    def classes(package: str) -> set[str]:
        return {
            node.name
            for path in (root / package).rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef)
        }

    assert classes("worker") & classes("server") == set()


BESIDE = """
from pathlib import Path

assert Path(__file__).is_absolute(), __file__  # documented: model.py's absolute path


def load(device):
    scale = float((Path(__file__).parent / "scale.txt").read_text())
    return lambda x: x * scale
"""
RELATIVE = """
def load(device):
    with open("scale.txt") as f:  # resolves against the worker's working directory
        scale = float(f.read())
    return lambda x: x * scale
"""


def _scaled(repo: Path, name: str, code: str) -> None:
    d = repo / name
    d.mkdir(parents=True)
    (d / "model.toml").write_text(TOML)
    (d / "model.py").write_text(code)
    (d / "scale.txt").write_text("3\n")


def test_model_py_finds_the_files_beside_it_through___file__(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _scaled(tmp_path / "repo", "beside", BESIDE)
    monkeypatch.chdir(tmp_path)  # the repository given relative, as `--model-repository repo`
    cfg = find_model(Path("repo"), "beside")
    tensors, frames = batch(X)
    headers, out = run_batch(load_model(cfg, CPU), cfg, CPU, tensors, frames)
    assert from_raw("FP32", headers[0].shape, bytes(out[0])).tolist() == (X * 3).tolist()


def test_a_relative_path_that_misses_a_file_beside_model_py_says_how_to_find_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _scaled(tmp_path / "repo", "relative", RELATIVE)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the worker's working directory
    cfg = find_model(tmp_path / "repo", "relative")
    with pytest.raises(FileNotFoundError) as info:
        load_model(cfg, CPU)
    message = str(info.value)
    assert "'scale.txt'" in message and str(tmp_path / "elsewhere") in message
    assert "Path(__file__).parent / 'scale.txt'" in message


COUNTING_MODEL = """
def load(device):
    def forward(x):
        return x * 0 + x.shape[0]  # every row says how many rows its forward had
    return forward
"""


def test_batches_waiting_from_several_frontends_run_as_one_forward(tmp_path: Path) -> None:
    """Three batches of one model wait (frontends 0, 1, 0) with a retry marked alone
    behind them: the first three run as one forward of 1 + 2 + 3 rows, each answered
    to its own frontend with its own rows; the alone one runs by itself."""
    with in_process(tmp_path, COUNTING_MODEL) as (d, runner, ctx, results):
        header = wire.Header(kind=wire.Header.LOAD, model=d.name, version="1")
        assert install(runner, header) == ""
        for batch_id, (frontend, rows) in enumerate([(0, 1), (1, 2), (0, 3), (1, 1)], 1):
            tensors, frames = batch(np.full((rows, 4), batch_id, np.float32))
            h = wire.Header(kind=wire.Header.BATCH, batch_id=batch_id, model=d.name,
                            version="1", tensors=tensors, alone=batch_id == 4)  # fmt: skip
            runner._work.put((frontend, h, frames))
        runner._work.put(None)
        runner._compute(ctx)  # runs what is queued, then stops at None
        got = {}
        for _ in range(4):
            first, *parts = results.recv_multipart()
            reply, out = wire.unpack(parts)
            y = from_raw(reply.tensors[0].datatype, reply.tensors[0].shape, bytes(out[0]))
            got[reply.batch_id] = (first[0], y.shape[0], float(y.max()), reply.forward_rows)
    assert got == {1: (0, 1, 6.0, 6), 2: (1, 2, 6.0, 6), 3: (0, 3, 6.0, 6), 4: (1, 1, 1.0, 1)}


RAISING_MODEL = """
def load(device):
    def forward(x):
        if (x < 0).any():
            raise ValueError("a negative input")
        return x
    return forward
"""


def compute(
    tmp_path: Path, code: str, items: list[tuple[int, wire.Header, list[Any]]], toml: str = TOML
) -> list[tuple[int, wire.Header, list[bytes]]]:
    """Load the model `code` as `model_py` version 1 in an in-process Runner, run
    `items` (frontend, header, frames) through its compute thread's loop, and return
    every reply: (frontend, header, frames), in order."""
    with in_process(tmp_path, code, toml) as (d, runner, ctx, results):
        assert install(runner, wire.Header(kind=wire.Header.LOAD, model=d.name, version="1")) == ""
        for item in items:
            runner._work.put(item)
        runner._work.put(None)
        runner._compute(ctx)  # runs what is queued, then stops at None
        got = []
        while results.poll(0):
            first, *parts = results.recv_multipart()
            if parts:
                header, frames = wire.unpack(parts)
                got.append((first[0], header, [bytes(f) for f in frames]))
    return got


def batch_of(batch_id: int, arr: np.ndarray, model: str = "model_py") -> wire.Header:
    tensors, _ = batch(arr)
    return wire.Header(kind=wire.Header.BATCH, batch_id=batch_id, model=model, version="1",
                       tensors=tensors)  # fmt: skip


def test_a_merged_forward_that_raises_tells_each_batch_the_forward_s_rows(tmp_path: Path) -> None:
    """So a frontend whose batch held one request knows it did not run alone, and
    retries it alone instead of failing it with another frontend's error."""
    items = []
    for batch_id, (frontend, value) in enumerate([(0, 1.0), (1, -1.0)], 1):
        x = np.full((1, 4), value, np.float32)
        items.append((frontend, batch_of(batch_id, x), batch(x)[1]))
    replies = compute(tmp_path, RAISING_MODEL, items)
    got = {h.batch_id: (f, h.kind, h.forward_rows) for f, h, _ in replies}
    assert got == {1: (0, wire.Header.ERROR, 2), 2: (1, wire.Header.ERROR, 2)}


SURROGATE_MODEL = """
def load(device):
    def forward(x):
        if (x < 0).any():  # an exception naming a file by bytes that are not UTF-8
            raise OSError("cannot open " + b"w\\xffeights".decode("utf-8", "surrogateescape"))
        return x
    return forward
"""


def test_a_failure_the_wire_cannot_carry_as_it_is_fails_its_batch_only(tmp_path: Path) -> None:
    """A model error holding a lone surrogate (protobuf refuses it), and a BATCH no
    frontend sends (a scalar first input): each fails its own batch with a message, and
    the compute thread goes on to answer the next one."""
    bad = np.full((1, 4), -1.0, np.float32)
    good = np.ones((1, 4), np.float32)
    scalar = wire.Header(kind=wire.Header.BATCH, batch_id=2, model="model_py", version="1",
                         tensors=[wire.Tensor(name="X", datatype="FP32", shape=[])])  # fmt: skip
    got = compute(tmp_path, SURROGATE_MODEL, [
        (0, batch_of(1, bad), batch(bad)[1]),
        (0, scalar, [b""]),
        (0, batch_of(3, good), batch(good)[1]),
    ])  # fmt: skip
    assert [(h.batch_id, h.kind) for _, h, _ in got] == [
        (1, wire.Header.ERROR), (2, wire.Header.ERROR), (3, wire.Header.RESULT),
    ]  # fmt: skip
    assert got[0][1].error == "OSError: cannot open w\\udcffeights"
    assert got[1][1].error


def test_a_load_that_fails_with_a_surrogate_in_its_message_is_answered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Its ERROR log's traceback holds the lone surrogate, which pytest-xdist cannot
    # carry from its worker to the controller (the worker crashes): not captured.
    caplog.set_level(logging.CRITICAL, logger="batchd.worker")
    code = (
        "def load(device):\n"
        '    raise OSError("no " + b"\\xff".decode("utf-8", "surrogateescape"))\n'
    )
    d = repo_model(tmp_path, "model.py", lambda p: p.write_text(code))
    runner = Runner(RunnerOptions("w", "ipc://unused", CPU, tmp_path))
    header = wire.Header(kind=wire.Header.LOAD, model=d.name, version="1")
    assert install(runner, header) == "OSError: no \\udcff"


def test_a_load_failure_s_log_line_has_its_message_cut_short_and_its_frames(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """log.exception wrote a model's 10 MB message whole into the log, at every
    restart of the worker; now the line says what the reply says, with the frames,
    and those of the exception it came of (the missing file a load names)."""
    code = (
        "def load(device):\n"
        "    try:\n"
        "        open('/nonexistent/shard-00017.safetensors')\n"
        "    except OSError as e:\n"
        "        raise ValueError('y' * 10**7) from e\n"
    )
    d = repo_model(tmp_path, "model.py", lambda p: p.write_text(code))
    header = wire.Header(kind=wire.Header.LOAD, model=d.name, version="1")
    with caplog.at_level(logging.ERROR, logger="batchd.worker"):
        loaded = load(header, tmp_path, CPU, (), {})
    assert loaded.error.endswith("... (10000000 characters)")
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert line.endswith(loaded.error) and "in load\n    raise ValueError" in line
    assert "No such file or directory: '/nonexistent/shard-00017.safetensors'" in line
    assert len(line) < 10_000 and not any(r.exc_info for r in caplog.records)


REUSING_MODEL = """
import torch
def load(device):
    out = torch.empty(0)
    def forward(x):  # writes every answer into the one buffer it returns (the out= style)
        torch.mul(x, 2, out=out)
        return out
    return forward
"""


def test_an_output_buffer_the_model_reuses_is_copied_before_the_next_forward(
    tmp_path: Path,
) -> None:
    """The reply leaves zero-copy (64 KiB and more): each must keep its own values,
    not the next batch's."""
    items = []
    for batch_id in (1, 2, 3):
        x = np.full((1, 20_000), float(batch_id), np.float32)
        header = batch_of(batch_id, x)
        header.alone = True  # one forward each, not merged into one
        items.append((0, header, batch(x)[1]))
    got = compute(tmp_path, REUSING_MODEL, items, TOML.replace("[4]", "[20000]"))
    assert [h.kind for _, h, _ in got] == [wire.Header.RESULT] * 3
    assert [set(np.frombuffer(f[0], np.float32).tolist()) for _, _, f in got] == [
        {2.0}, {4.0}, {6.0},
    ]  # fmt: skip


def test_integers_returned_for_a_bytes_output_are_refused_not_made_zero_bytes(
    tmp_path: Path,
) -> None:
    """bytes(50000) is 50,000 zero bytes: token ids returned for a BYTES output would
    become strings of zeros (and a large id, gigabytes)."""
    code = "import torch\ndef load(device):\n    return lambda x: torch.full((len(x), 4), 50000)\n"
    toml = TOML[: TOML.rindex("FP32")] + 'BYTES"\nshape = [4]\n'
    d = repo_model(tmp_path, "model.py", lambda p: p.write_text(code), toml)
    cfg = load_model_config(d)
    tensors, frames = batch(X)
    refused = "output 'Y' is declared BYTES: a BYTES element is bytes or str, not int"
    with pytest.raises(BatchError, match=refused):
        run_batch(load_model(cfg, CPU), cfg, CPU, tensors, frames)


PACKAGED = """
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import helper  # helper.py beside this model.py, not another model's


@dataclass
class Settings:  # under the future import, dataclass looks its module up in sys.modules
    scale: float


class Net(torch.nn.Module):
    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.scale, self.drop = settings.scale, torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(x) * self.scale  # dropout is off once the worker has it eval()


def load(device):
    return Net(Settings(helper.SCALE))
"""


def test_each_model_py_is_a_package_of_its_own_while_its_version_is_loaded(
    tmp_path: Path,
) -> None:
    """Two models each import their own helper.py; a version loaded again after its
    helper changed gets the new one; an nn.Module is put in eval mode; an unloaded
    version's modules leave sys.modules."""
    for name, scale in (("a", 2), ("b", 3)):
        d = repo_model(tmp_path, "model.py", lambda p: p.write_text(PACKAGED))
        d = d.rename(tmp_path / name)
        (d / "helper.py").write_text(f"SCALE = {scale}\n")
    runner = Runner(RunnerOptions("w", "ipc://unused", CPU, tmp_path))

    def answer(name: str, version: str) -> list[list[float]]:
        cfg, fn = runner.held.models[model_key(name, version)]
        headers, out = run_batch(fn, cfg, CPU, *batch(X))
        return from_raw("FP32", headers[0].shape, bytes(out[0])).tolist()

    def header(kind: int, name: str, version: str) -> wire.Header:
        return wire.Header(kind=kind, model=name, version=version)

    try:
        for name in "ab":
            assert install(runner, header(wire.Header.LOAD, name, "1")) == ""
        assert answer("a", "1") == (X * 2).tolist() and answer("b", "1") == (X * 3).tolist()
        (tmp_path / "a" / "helper.py").write_text("SCALE = 5\n")
        assert install(runner, header(wire.Header.LOAD, "a", "2")) == ""
        assert answer("a", "2") == (X * 5).tolist() and answer("a", "1") == (X * 2).tolist()
        loaded = {m for m in sys.modules if m.startswith("batchd_model_a_")}
        assert len(loaded) == 4  # versions 1 and 2, each with its helper
        unload(runner, header(wire.Header.UNLOAD, "a", "1"))
        unload(runner, header(wire.Header.UNLOAD, "a", "2"))
        assert not any(m.startswith("batchd_model_a_") for m in sys.modules)
        assert answer("b", "1") == (X * 3).tolist()
    finally:
        gc.unfreeze()


def test_a_worker_thread_that_dies_takes_its_process_with_it_not_a_model_s() -> None:
    """A dead compute or loader thread must not leave a worker that heartbeats on and
    answers nothing: the process exits, and its frontend sees that at once. A thread a
    model started is the model's: its exception is logged and the worker goes on (the
    worker exited, was started again, loaded the model again and exited: 12 in 25 s)."""
    code = (
        "import threading, time\n"
        "from batchd.worker.__main__ import die_with_a_worker_thread\n"
        "from batchd.worker.loading import own_thread\n"
        "threading.excepthook = die_with_a_worker_thread\n"
        "model_s = threading.Thread(target=lambda: 1 / 0, name='helper')\n"
        "model_s.start(); model_s.join()\n"
        "print('went on', flush=True)\n"
        "own_thread(lambda: [][1], 'compute').start()\n"
        "time.sleep(60)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 70 and done.stdout == "went on\n"
    assert "thread helper (a model's) died" in done.stderr and "ZeroDivisionError" in done.stderr
    assert "thread compute died; exiting" in done.stderr and "IndexError" in done.stderr


def test_nothing_of_a_load_that_failed_stays_in_sys_modules(tmp_path: Path) -> None:
    """Its module would hold what it made (weights) for good: the frontend sends no
    UNLOAD for a version that did not load, and each try is a version of its own."""
    code = "def load(device):\n    return 7\n"
    d = repo_model(tmp_path, "model.py", lambda p: p.write_text(code))
    before = set(sys.modules)
    for _ in range(2):
        with pytest.raises(TypeError, match="load\\(device\\) returned int, expected a callable"):
            load_model(load_model_config(d), CPU)
    assert set(sys.modules) - before == set()


def test_a_result_says_how_long_its_batch_waited_on_the_worker(tmp_path: Path) -> None:
    """RESULT's waited_ns: from the BATCH's arrival (the I/O thread stamps it) to its
    forward. The frontend counts it as queue time: in compute_input, a GPU worker's
    staged batch showed the forward it had waited behind."""
    now = time.perf_counter_ns()
    items = []
    for batch_id, arrived in ((1, now - 20_000_000), (2, now)):  # 1 came 20 ms earlier
        header = batch_of(batch_id, X[:1])
        header.waited_ns = arrived  # as runner._from_frontend stamps it
        items.append((0, header, batch(X[:1])[1]))
    got = compute(tmp_path, RAISING_MODEL, items)  # (it echoes X >= 0)
    replies = {h.batch_id: h for _, h, _ in got}
    assert replies[1].forward_rows == 2  # one forward: the same start for both
    assert replies[1].waited_ns - replies[2].waited_ns == 20_000_000
    assert replies[2].waited_ns > 0


def test_a_model_s_long_error_message_is_cut_in_its_reply() -> None:
    """A model may raise with megabytes of text: the reply carried it whole (past the
    frontend's header limit it would be dropped as malformed), and a client takes 8 KiB
    of a status's details."""
    said = why(ValueError("y" * 100_000))
    assert said.startswith("ValueError: yyy") and said.endswith("... (100000 characters)")
    assert len(said) < 4200 and why(ValueError("short")) == "ValueError: short"


EVIL_MESSAGE_MODEL = """
class Evil(Exception):
    def __str__(self):
        raise SystemExit(5)  # a BaseException, out of the message of an Exception


def load(device):
    def forward(x):
        if (x < 0).any():
            raise Evil()
        return x
    return forward
"""


def test_an_exception_whose_message_raises_a_base_exception_fails_its_batch_alone(
    tmp_path: Path,
) -> None:
    """why() caught only Exception: SystemExit out of __str__ ended the compute thread,
    so the worker died (twice, as the request was retried) and every model on it with
    it. Now the batch fails naming the type, and the thread goes on."""
    items = [(0, batch_of(1, -X), batch(-X)[1])]
    [(_, reply, _)] = compute(tmp_path, EVIL_MESSAGE_MODEL, items)  # (it returned)
    assert (reply.kind, reply.error) == (wire.Header.ERROR, "Evil: (its message could not be read)")


def test_a_plain_load_of_a_version_held_whose_files_changed_loads_them_again(
    tmp_path: Path,
) -> None:
    """A frontend started again numbers its versions from 1: a remote worker that
    outlived it held "scaled@1" from the old files and answered with the old weights
    under the new version's number (with a fresh worker beside it, half the answers
    were each). A plain LOAD of a version held whose files changed loads them again;
    one with `held` (a frontend that knows they changed) keeps the copy."""
    d = make_model(tmp_path, "scaled", 2.0)
    plain = wire.Header(kind=wire.Header.LOAD, model="scaled", version="1")
    first = load(plain, tmp_path, CPU, (), {})
    assert first.model is not None and first.files is not None
    have = {"scaled@1": first.files}
    assert load(plain, tmp_path, CPU, (), have) == Loaded()  # the same files: kept
    (d / "scale.txt").write_text("3.0")
    held = wire.Header(kind=wire.Header.LOAD, model="scaled", version="1", held=True)
    assert load(held, tmp_path, CPU, (), have) == Loaded()
    again = load(plain, tmp_path, CPU, (), have)
    assert again.model is not None and again.files is not None and again.files != first.files
    assert again.model[0].key == "scaled@1"
    assert [r["scale"] for r in model_log(d, "loads.log")] == [2.0, 3.0]  # the new weights


def test_a_load_reads_only_the_files_its_version_was_numbered_for(tmp_path: Path) -> None:
    """The frontend checked a version's files after its workers said LOADED: a file
    touched just after one had loaded it (an editor, a deploy's rsync) read as changed
    as it loaded, and the frontend dropped the copy; with --frontends N, the copy every
    frontend served. The LOAD now names the files (their digest) and the worker checks
    them as it reads: before its load, and at its end."""
    d = make_model(tmp_path, "scaled", 2.0)
    plain = wire.Header(kind=wire.Header.LOAD, model="scaled", version="1",
                        files=digest(files_of(d)), folder=identity(tmp_path))  # fmt: skip
    first = load(plain, tmp_path, CPU, (), {})
    assert first.model is not None and first.files is not None
    os.utime(d / "model.py", ns=(1, 1))  # touched once it had it: its copy is that version's
    assert load(plain, tmp_path, CPU, (), {"scaled@1": first.files}) == Loaded()
    (d / "scale.txt").write_text("3.0")  # changed before a worker read them: not loaded
    refused = load(plain, tmp_path, CPU, (), {})
    assert refused.model is None
    assert "files of model 'scaled' changed since they were read for version 1" in refused.error
    assert [r["scale"] for r in model_log(d, "loads.log")] == [2.0]  # (not read at all)
    renumbered = wire.Header(kind=wire.Header.LOAD, model="scaled", version="1",
                             files=digest(files_of(d)), folder=plain.folder)  # fmt: skip
    again = load(renumbered, tmp_path, CPU, (), {"scaled@1": first.files})
    assert again.model is not None and again.files is not None  # read again, the new ones
    assert [r["scale"] for r in model_log(d, "loads.log")] == [2.0, 3.0]
    copy = tmp_path / "copy"  # a worker on another host, its own copy: other times
    shutil.copytree(d, copy / "scaled", copy_function=shutil.copyfile)
    assert load(plain, copy, CPU, (), {}).model is not None


def test_a_folder_s_identity_is_where_its_files_are_not_the_host_s_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Named by host name, the same folder in a container (another name, one kernel) or
    read through a symlink was taken for a copy elsewhere, whose files go unchecked."""
    (release := tmp_path / "release-1").mkdir()
    (current := tmp_path / "current").symlink_to(release)
    here = identity(release)
    monkeypatch.setattr(socket, "gethostname", lambda: "container-2")
    assert identity(current) == here != "" and identity(tmp_path) != here
    (other := tmp_path / "release-2").mkdir()
    current.unlink()
    current.symlink_to(other)  # a deploy flips it: another folder now
    assert identity(current) == identity(other) != here


REWRITES_PY = """
from pathlib import Path

def load(device):
    name = bytes.fromhex("%s").decode(errors="surrogateescape")
    (Path(__file__).parent / name).write_text("5.0")  # as if rewritten as this load read it
    return lambda x: x
"""


def test_a_load_whose_files_change_as_it_reads_them_keeps_nothing(tmp_path: Path) -> None:
    d = tmp_path / "edited"
    d.mkdir()
    (d / "model.toml").write_text(TOML)
    for name, shown in ((b"scale.txt", "scale.txt"), (b"w\xff.bin", "w\\xff.bin")):
        (d / "model.py").write_text(REWRITES_PY % name.hex())  # (a name not UTF-8, too)
        header = wire.Header(kind=wire.Header.LOAD, model="edited", version="1",
                             files=digest(files_of(d)))  # fmt: skip
        loaded = load(header, tmp_path, CPU, (), {})
        assert loaded.model is None and loaded.files is None
        assert f"changed as version 1 loaded ({shown})" in wire.Header(error=loaded.error).error


STEPS_PY = """
class Steps:
    def start(self, requests):
        return [0 for _ in requests]
    def step(self, states):
        return [(None, True) for _ in states]
def load(device):
    return Steps()
"""


def test_a_step_wise_version_held_is_kept_though_its_files_changed(tmp_path: Path) -> None:
    """Loaded again, a step-wise model got a new loop over the old one: the sequences
    another frontend ran on it went without an answer till their callers' deadlines. A
    plain copy held, whose files made it step-wise, was kept the same way (review 55c:
    every START refused "not loaded as a step-wise model"): it is loaded again."""
    d = tmp_path / "steps"
    d.mkdir()
    (d / "model.toml").write_text(stepwise_toml(2, 10))
    (d / "model.py").write_text(STEPS_PY)
    plain = wire.Header(kind=wire.Header.LOAD, model="steps", version="1")
    first = load(plain, tmp_path, CPU, (), {})
    assert first.model is not None and first.files is not None
    (d / "model.py").write_text(STEPS_PY + "\n# changed\n")
    assert load(plain, tmp_path, CPU, (), {"steps@1": first.files}, stepping=True) == Loaded()
    again = load(plain, tmp_path, CPU, (), {"steps@1": first.files}, stepping=False)
    assert again.model is not None and again.model[0].generate is not None
    # and a frontend that still reads it as plain is told so, not "batch lacks input 'N'"
    runner = Runner(RunnerOptions("w", "ipc://unused", CPU, tmp_path))
    runner._install(again)
    runner._threads_all = 1
    tensors, frames = batch(np.ones((1, 1), np.int64), "N")
    header = wire.Header(kind=wire.Header.BATCH, model="steps", version="1", tensors=tensors)
    ((_, parts),) = runner._run([(0, header, frames)])
    said = wire.unpack(parts)[0]
    assert (said.kind, said.error) == (wire.Header.ERROR, "model 'steps' version '1' is "
                                       "step-wise (its files changed) on this worker")  # fmt: skip


STEPPER = FLOOD_PY  # N quick steps, an output each


def test_sequences_step_between_forwards_however_many_batches_are_staged(tmp_path: Path) -> None:
    """With 2 credits a staged batch always waits, and the compute thread stepped its
    sequences only when no work was queued: under steady one-shot traffic a sequence
    stepped once in seconds, and the frontend declared the healthy worker lost."""
    repo_model(tmp_path, "model.py", lambda p: p.write_text(COUNTING_MODEL))
    (tmp_path / "steps").mkdir()
    (tmp_path / "steps" / "model.toml").write_text(stepwise_toml(max_active=2, max_steps=8))
    (tmp_path / "steps" / "model.py").write_text(STEPPER)
    runner = Runner(RunnerOptions("w", "ipc://unused", CPU, tmp_path))
    ctx: zmq.Context[Any] = zmq.Context()
    results = ctx.socket(zmq.PULL)
    results.bind(runner_module._RESULTS)
    try:
        for name in ("model_py", "steps"):
            assert (
                install(runner, wire.Header(kind=wire.Header.LOAD, model=name, version="1")) == ""
            )
        start = wire.Header(kind=wire.Header.START, batch_id=1, model="steps", version="1")
        start.tensors.add(name="N", datatype="INT64", shape=[1])
        runner._work.put((0, start, [np.array([3], np.int64).tobytes()]))
        for batch_id in range(1, 7):  # one-shot batches, all queued: no moment without work
            header = batch_of(batch_id, X)
            header.alone = True  # one forward each
            runner._work.put((0, header, batch(X)[1]))
        runner._work.put(None)
        runner._compute(ctx)  # runs what is queued, then stops at None
        kinds = []
        while results.poll(0):
            _, *parts = results.recv_multipart()
            header, _ = wire.unpack(parts)
            kinds.append("step" if header.kind == wire.Header.STEP else "result")
    finally:
        results.close(linger=0)
        ctx.term()
        gc.unfreeze()
    assert kinds.count("result") == 6 and kinds.count("step") == 3, kinds
    assert kinds.index("step") < kinds.index("result") + 2  # a step after the first forward


BLOCKING_STEPPER = STEPPER.replace(
    "class Flood:  # N quick steps, an output each\n",
    "import threading\nclass Flood:\n    started, release = threading.Event(), threading.Event()\n",
).replace(
    "        for s in states:\n",
    "        self.started.set()\n        self.release.wait(30)\n        for s in states:\n",
    1,
)


def test_a_step_round_is_work_the_heartbeats_tell_of(tmp_path: Path) -> None:
    """A long step of one model held the worker, and its heartbeats said it was idle:
    another model's sequence waiting behind it was taken for stuck, the worker killed."""
    (tmp_path / "steps").mkdir()
    (tmp_path / "steps" / "model.toml").write_text(
        stepwise_toml(max_active=2, max_steps=8) + "[instances]\nexecution_timeout_s = 30\n"
    )
    (tmp_path / "steps" / "model.py").write_text(BLOCKING_STEPPER)
    runner = Runner(RunnerOptions("w", "ipc://unused", CPU, tmp_path))
    assert install(runner, wire.Header(kind=wire.Header.LOAD, model="steps", version="1")) == ""
    start = wire.Header(kind=wire.Header.START, batch_id=1, model="steps", version="1")
    start.tensors.add(name="N", datatype="INT64", shape=[1])
    loop = runner.held.loops["steps@1"]
    assert loop.add(0, start, [np.array([3], np.int64).tobytes()], CPU) == []
    rounds = threading.Thread(target=runner._rounds, args=(lambda *a: None, False))
    rounds.start()
    try:
        assert loop.model.started.wait(30)
        beat, _ = wire.unpack(runner._beat(0))
        assert beat.busy_ns > 0 and beat.busy_limit_s == 30.0
    finally:
        loop.model.release.set()
        rounds.join(30)
    beat, _ = wire.unpack(runner._beat(0))
    assert beat.busy_ns == 0 and beat.idle_ns > 0


SLOW_FINALIZER = """
import threading
class Model:
    started, release = threading.Event(), threading.Event()

    def __call__(self, x):
        return x

    def __del__(self):  # a finalizer of seconds (a GPU context's, a file flushed)
        self.started.set()
        self.release.wait(30)


def load(device):
    return Model()
"""


def test_a_drop_is_work_the_heartbeats_tell_of_as_a_drop(tmp_path: Path) -> None:
    """A worker in an unloaded model's finalizer beat busy, with none of the frontend's
    batches running: the frontend took it for idle (server/pool.py) and sent it batches,
    which waited out the finalizer while another worker idled. Its beats say it drops;
    a step round, busy too, is no drop."""
    d = repo_model(tmp_path, "model.py", lambda p: p.write_text(SLOW_FINALIZER))
    runner = Runner(RunnerOptions("w", "ipc://unused", CPU, tmp_path))
    header = wire.Header(kind=wire.Header.LOAD, model=d.name, version="1")
    assert install(runner, header) == ""
    model = type(runner.held.models[model_key(d.name, "1")][1])
    item = (0, wire.Header(kind=wire.Header.UNLOAD, model=d.name, version="1"),
            [runner.held.take(model_key(d.name, "1"))])  # fmt: skip
    dropping = threading.Thread(target=runner._handle, args=(item, lambda *a: None))
    dropping.start()
    try:
        assert model.started.wait(30)
        beat, _ = wire.unpack(runner._beat(0))
        assert beat.busy_ns > 0 and beat.dropping and not beat.running
    finally:
        model.release.set()
        dropping.join(30)
    beat, _ = wire.unpack(runner._beat(0))
    assert beat.idle_ns > 0 and not beat.dropping
    runner._busy = (time.perf_counter_ns(), (), 30.0)  # as a step round's (the test above)
    beat, _ = wire.unpack(runner._beat(0))
    assert beat.busy_ns > 0 and not beat.dropping


def test_a_drop_s_end_is_beaten_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its beats said it dropped, and the frontend counted it busy till the next one, up
    to a heartbeat interval after the drop ended: a lone request meanwhile waited out its
    model's whole queue delay (late review 59b). The drop's end is beaten at once: here
    no beat falls due once the drop is under way (the links are told the time is 0),
    and one comes when it ends."""
    d = repo_model(tmp_path, "model.py", lambda p: p.write_text(SLOW_FINALIZER))
    ctx: zmq.Context[Any] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    runner = Runner(RunnerOptions("w", f"tcp://127.0.0.1:{port}", CPU, tmp_path))
    serving = threading.Thread(target=runner.serve)
    frozen = threading.Event()
    tick = FrontendLink.tick
    monkeypatch.setattr(FrontendLink, "tick", lambda link, now, *more: tick(
        link, 0.0 if frozen.is_set() else now, *more))  # fmt: skip

    def recv(kind: int) -> wire.Header:  # (answered with a beat, as a frontend's: it is live)
        while True:
            assert router.poll(30_000), f"no {wire.Header.Kind.Name(kind)} came"
            _, *parts = router.recv_multipart()
            router.send_multipart([b"w", *wire.pack(wire.Header(kind=wire.Header.HEARTBEAT))])
            if (header := wire.unpack(parts)[0]).kind == kind:
                return header

    serving.start()
    model: Any = None
    try:
        recv(wire.Header.READY)
        header = wire.Header(kind=wire.Header.LOAD, model=d.name, version="1")
        router.send_multipart([b"w", *wire.pack(header)])
        assert recv(wire.Header.LOADED).error == ""
        model = type(runner.held.models[model_key(d.name, "1")][1])
        header = wire.Header(kind=wire.Header.UNLOAD, model=d.name, version="1")
        router.send_multipart([b"w", *wire.pack(header)])
        assert model.started.wait(30)
        while not recv(wire.Header.HEARTBEAT).dropping:
            pass
        frozen.set()  # no beat falls due from now on
        model.release.set()
        while recv(wire.Header.HEARTBEAT).dropping:  # (one sent before, or its collection's)
            pass
    finally:
        if model is not None:
            model.release.set()
        runner.stop()
        serving.join(30)
        router.close(linger=0)
        ctx.term()
        gc.unfreeze()
    assert not serving.is_alive()


@pytest.mark.parametrize("changer", ["forward", "load"])
def test_model_code_in_the_other_thread_does_not_set_the_dtype_back_under_a_call(
    changer: str,
) -> None:
    """A forward that sets float64 for itself while a load runs and ends beside it (or a
    load that sets it for its weights while forwards come and go): the other thread's end
    set the dtype back to the worker's under it (late review 59c). It goes back once no
    model code runs; till then both threads share it (the dtype is the process's)."""
    changed, other_done, checked = threading.Event(), threading.Event(), threading.Event()
    seen: list[torch.dtype] = []

    def changing() -> None:  # (the `changer`, in its thread)
        with defaults_kept():
            torch.set_default_dtype(torch.float64)
            changed.set()
            assert other_done.wait(30)
            seen.append(torch.tensor([1.0]).dtype)
        checked.set()

    def other() -> None:
        assert changed.wait(30)
        with defaults_kept():
            pass
        other_done.set()

    threads = [threading.Thread(target=changing, name=changer), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert checked.is_set() and seen == [torch.float64]
    assert torch.get_default_dtype() == torch.float32  # (none runs now: the worker's)


@pytest.mark.parametrize(
    "code",
    [
        "torch.device('meta').__enter__()",
        "torch.set_default_device('meta'); torch.device('meta').__enter__()",
        "torch.device('meta').__enter__(); torch.set_default_device(None)",
        "torch.set_default_device('meta')",
    ],
)
def test_a_device_a_model_left_entered_is_undone(code: str) -> None:
    """A `with torch.device(...)` a model entered and never left was kept for every later
    call of that thread (its models' weights on 'meta'), and with a default device set
    under it, setting that back raised (a call that had worked then failed: 59c)."""
    got: list[object] = []

    def call() -> None:
        try:
            with defaults_kept():
                exec(code, {"torch": torch})
        except Exception as e:  # (what defaults_kept itself raised)
            got.append(e)
        got.append(torch.empty(1).device)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(30)
    assert got == [torch.device("cpu")]


def test_a_relative_ipc_endpoint_is_made_absolute_only_where_the_path_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made absolute, a model's os.chdir cannot move it (review 57f); but from a deep
    working directory the absolute path passed the 107 bytes a Unix socket's path holds,
    and the worker never connected, saying nothing (late review 57g): kept as given."""
    monkeypatch.chdir(tmp_path)
    assert _endpoints("ipc://w.sock") == f"ipc://{tmp_path}/w.sock"
    assert _endpoints("ipc:///abs/w.sock,ipc://@abstract,tcp://127.0.0.1:5555") == (
        "ipc:///abs/w.sock,ipc://@abstract,tcp://127.0.0.1:5555"
    )
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.chdir(deep)
    assert _endpoints("ipc://w.sock") == "ipc://w.sock"


def test_an_ipc_endpoint_too_long_for_a_unix_socket_is_refused_at_once(tmp_path: Path) -> None:
    """It printed ZMQError's traceback and the worker hung (late review 57h)."""
    long = "ipc://" + "x" * 115 + ".sock"
    done = subprocess.run(
        [sys.executable, "-m", "batchd.worker", "--connect", long, "--model-repository",
         str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-500:]
    assert "an ipc:// path holds at most 107 bytes" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_unload_s_collection_is_given_a_worker_s_time_not_the_model_s() -> None:
    """The collection after an unload walks every model's objects: held to the dropped
    model's execution_timeout_s (0.05 s), a worker whose heap took longer was killed,
    every model reloaded (late review 58d). It is given COLLECT_MIN_S at least, a model's
    longer limit when it has one."""
    c = loading.Collections(cuda=False)
    c.due(0.05)
    assert c.pending and c.limit == loading.COLLECT_MIN_S
    c.due(120.0)
    assert c.limit == 120.0
