"""Loading a model artifact into a callable on a device.

    model.py   the operator's code: `load(device: torch.device) -> callable`.
               Its `__file__` is its absolute path: files beside it are
               `Path(__file__).parent / "weights.bin"`. A relative path resolves
               against the worker's working directory, as anywhere in Python;
               when a file missing there lies beside model.py, the error says so.
    model.pt   TorchScript (torch.jit.load)
    model.pt2  torch.export program (torch.export.load(...).module())

The callable takes the inputs positionally in [[input]] order and returns a
tensor, a tuple in [[output]] order, or a dict by output name.

Only artifacts inside the repository load (`confined`). model.py is code the
operator trusts; model.pt and model.pt2 are too: torch.jit.load and
torch.export.load have no weights-only mode. Anything read with torch.load
here must pass weights_only=True (a test checks every call).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import itertools
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
from torch.export.passes import move_to_device_pass

from batchd.protos.model_config import ModelConfig
from batchd.protos.processes import descendants, kill_all
from batchd.protos.repository import confined

_PID = os.getpid()  # the worker's (forked_off)
_DTYPE = torch.get_default_dtype()  # the worker's, which each model's call starts with
_lock, _running = threading.Lock(), 0  # model code running (a call, a load): defaults_kept
EXIT_S = 5.0  # what the atexit handlers may take as the worker leaves (leave)

ModelFn = Callable[..., Any]
log = logging.getLogger("batchd.worker")


_loads = itertools.count(1)


def _load_python(cfg: ModelConfig, device: torch.device) -> tuple[ModelFn, str]:
    # Each load of a model.py is a package of its own, under a name no other model,
    # version or reload shares, registered in sys.modules while the version is loaded:
    # `from . import helper` finds helper.py beside it, afresh for each version (never
    # another model's helper of that name), and what looks a class's module up there
    # (dataclasses under `from __future__ import annotations`, pickle) finds it. It goes
    # with the copy that is dropped (forget), never with another copy of that version.
    module_name = f"batchd_model_{re.sub(r'[^0-9A-Za-z_]', '_', cfg.name)}_{next(_loads)}"
    # __file__ is absolute whatever --model-repository was: Path(__file__).parent is
    # the model's folder. The working directory is not changed for the load: it is
    # the whole process's, and the I/O thread runs on while the compute thread loads
    # (it reconnects relative ipc:// paths and re-reads --worker-keys DIR when it opens
    # a new socket); the model's forward would also see another directory than load.
    folder = [str(cfg.artifact.parent.absolute())]
    spec = importlib.util.spec_from_file_location(
        module_name, cfg.artifact.absolute(), submodule_search_locations=folder
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"{cfg.artifact}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        try:  # (torch's defaults kept: one its import or load() set stayed the process's
            with defaults_kept():  # dtype, or the loader thread's device, the next load's)
                spec.loader.exec_module(module)
                forked_off()  # (a fork as it imported: the child would load the model too;
                load = getattr(module, "load", None)  # one whose import raised ends below)
                if not callable(load):
                    raise TypeError(f"{cfg.artifact}: defines no load(device) function")
                fn = _checked(cfg, _eval(load(device)))
        finally:
            forked_off()
    except FileNotFoundError as e:
        _forget_module(module_name)
        _explain_relative_path(cfg, e)
        raise
    except BaseException:  # nothing of a load that failed stays
        _forget_module(module_name)
        raise
    return fn, module_name


def leave(code: int) -> NoReturn:
    """End the worker process: its atexit handlers first (a TemporaryDirectory's cleanup,
    a model's own, the trace exporter's flush), on this, the main, thread, for EXIT_S at
    most, then every process a model's code started and left (protos/processes.py), then
    out at once. Python's own exit would wait for every thread that is not a daemon, and
    one a model started kept the worker alive after SIGTERM for good (under a server, its
    stop waited 10 s, then killed it)."""
    watchdog = threading.Timer(EXIT_S, _out, (code,))
    watchdog.daemon = True
    watchdog.start()
    atexit._run_exitfuncs()  # (logging's shutdown among them; multiprocessing's ends its
    sys.stdout.flush()  # daemonic children, after the model's own handlers)
    sys.stderr.flush()
    _out(code)


def _out(code: int) -> NoReturn:
    kill_all(descendants(os.getpid()))
    os._exit(code)


# What torch.set_default_device sets, per thread (torch.get_default_device() took 5 µs)
_DEVICE = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)


@contextlib.contextmanager
def defaults_kept() -> Iterator[None]:
    """torch's default dtype (the process's) and device (this thread's) set back after a
    model's call or load: one model's set_default_dtype or set_default_device held for
    every later model of this worker (review 57f). The dtype goes back to the worker's
    own once no model code runs in the other thread either: each thread found the
    other's change under way and one set it back for good (a load's float64 stayed),
    and one set back as the other still ran changed that one's dtype under it (late
    review 59c). A device, and a `with torch.device(...)` left entered (a mode on the
    thread's stack, which set_default_device then refused to leave), are undone."""
    global _running
    depth = _modes()
    with _lock:
        _running += 1
    try:
        yield
    finally:
        with _lock:
            _running -= 1
            if not _running:
                torch.set_default_dtype(_DTYPE)
        if getattr(_DEVICE, "device_context", None) is not None or _modes() != depth:
            while _modes() > depth:  # (the model's: its default device's, its contexts)
                torch._C._pop_torch_function_stack()
            if _DEVICE is not None:  # (the worker sets none: none is ever found)
                _DEVICE.device_context = None


def _modes() -> int:
    """How many torch function modes this thread has entered (0 where torch cannot say)."""
    count = getattr(torch._C, "_len_torch_function_stack", None)
    return count() if count is not None else 0


def forked_off() -> None:
    """Called as a model's code returns or raises: in a process it forked (os.fork() in
    load() or a forward) this copy of the worker would go on, with the worker's sockets:
    it hung, holding its memory, past the server's stop. It ends here, at once."""
    if os.getpid() != _PID:
        os._exit(0)


def _checked(cfg: ModelConfig, fn: Any) -> ModelFn:
    """What load(device) returned, if it is what `cfg` declares."""
    if cfg.generate is not None:  # a step-wise model: start / step (/ release)
        missing = [m for m in ("start", "step") if not callable(getattr(fn, m, None))]
        if missing:
            raise TypeError(
                f"{cfg.artifact}: [generate] declares a step-wise model, but what load(device) "
                f"returned ({type(fn).__name__}) has no {' or '.join(missing)}() method"
            )
        return fn  # type: ignore[no-any-return]
    if not callable(fn):
        raise TypeError(
            f"{cfg.artifact}: load(device) returned {type(fn).__name__}, expected a callable"
        )
    return fn  # type: ignore[no-any-return]


def _explain_relative_path(cfg: ModelConfig, e: FileNotFoundError) -> None:
    """Raise a FileNotFoundError that says how to reach the file if model.py opened,
    by a relative path, a file that is missing from the working directory but lies
    beside model.py."""
    name = e.filename
    if not isinstance(name, str) or os.path.isabs(name):
        return
    if (cfg.artifact.parent / name).exists():
        raise FileNotFoundError(
            f"{cfg.artifact}: {name!r} was looked for in the worker's working directory "
            f"{os.getcwd()}, not beside model.py; open Path(__file__).parent / {name!r}"
        ) from e


def forget(package: str) -> None:
    """A copy of a model is dropped: the modules of the package its model.py was loaded
    as (load_model; "": none) leave sys.modules, so that what they hold goes with it."""
    if package:
        _forget_module(package)


def _forget_module(name: str) -> None:
    # (a copy first, in one step: another thread may be importing meanwhile)
    for loaded in [m for m in list(sys.modules) if m == name or m.startswith(name + ".")]:
        del sys.modules[loaded]


def _eval(module: Any) -> Any:
    """An nn.Module in inference mode: dropout off, batch norm on its running
    statistics, so an answer never depends on the requests batched beside it."""
    if isinstance(module, torch.nn.Module):
        module.eval()
    return module


def load_model(cfg: ModelConfig, device: torch.device) -> ModelFn:
    return load_copy(cfg, device)[0]


def load_copy(cfg: ModelConfig, device: torch.device) -> tuple[ModelFn, str]:
    """The model's callable, and the package its model.py was loaded as ("": another
    artifact), for `forget` once that copy is dropped."""
    confined(cfg.directory.parent, cfg.artifact)  # models are the repository's subdirectories
    if cfg.platform == "python":
        return _load_python(cfg, device)
    if cfg.platform == "pytorch_libtorch":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DeprecationWarning)
            module = torch.jit.load(str(cfg.artifact), map_location=device)
        if caught:
            log.warning("model %s: %s (%s)", cfg.name, caught[0].message, cfg.artifact)
        return _eval(module), ""
    if cfg.platform == "torch_export":
        program = torch.export.load(str(cfg.artifact))
        _check_batch_dim(cfg, program)
        if device.type != "cpu":
            program = move_to_device_pass(program, device)
        return program.module(), ""  # already in inference form: no eval()
    raise ValueError(f"{cfg.directory}: unknown platform {cfg.platform!r}")


def _check_batch_dim(cfg: ModelConfig, program: torch.export.ExportedProgram) -> None:
    """Refuse a program whose inputs cannot take every batch from 1 to max_batch_size
    rows: exported with an example batch of 1 (and no dynamic batch dim), it takes that
    batch size alone, and each other batch failed in its forward with nothing but
    torch's "Guard failed: x.size()[0] == 1". A dynamic dim's lower bound of 2 is how
    torch records Dim.AUTO and Dim.DYNAMIC: it runs batches of 1 too (3 and up it
    refuses), on the branches traced for the example's batch."""
    if not cfg.batches:
        return
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for spec, name in zip(cfg.inputs, program.graph_signature.user_inputs, strict=False):
        shape = getattr(nodes[name].meta.get("val"), "shape", ())
        if spec.packed or not shape:  # (a packed input's first dim is its elements)
            continue
        dim, n = shape[0], cfg.max_batch_size
        if isinstance(dim, int):
            takes, fits = f"only batches of {dim} row(s)", dim == n == 1
        elif (bounds := program.range_constraints.get(dim.node.expr)) is not None:
            low, high = int(bounds.lower), bounds.upper  # (high: int_oo, if unbounded)
            fits = low <= 2 and bool(high >= n)
            most = "or more" if bool(high > 2**62) else f"to {high}"
            takes = f"batches of {low} {most} rows"
        else:
            continue
        if not fits:
            raise ValueError(
                f"{cfg.artifact}: input {spec.name} ({name!r} in the program) takes {takes} "
                f"as exported, but max_batch_size = {n} sends batches of 1 to {n}: "
                f"export it with an example batch of 2 and dynamic_shapes={{{name!r}: "
                f"{{0: torch.export.Dim('batch', max={n})}}}}"
            )
