"""Loading a model artifact into a callable on a device.

    model.py   the operator's code: `load(device: torch.device) -> callable`
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

import importlib.util
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.export.passes import move_to_device_pass

from batchd.protos.model_config import ModelConfig, confined

ModelFn = Callable[..., Any]
log = logging.getLogger("batchd.worker")


def _load_python(cfg: ModelConfig, device: torch.device) -> ModelFn:
    module_name = f"batchd_model_{cfg.name}"
    spec = importlib.util.spec_from_file_location(module_name, cfg.artifact)
    if spec is None or spec.loader is None:
        raise ImportError(f"{cfg.artifact}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    load = getattr(module, "load", None)
    if not callable(load):
        raise TypeError(f"{cfg.artifact}: defines no load(device) function")
    fn = load(device)
    if not callable(fn):
        raise TypeError(
            f"{cfg.artifact}: load(device) returned {type(fn).__name__}, expected a callable"
        )
    return fn  # type: ignore[no-any-return]


def _eval(module: Any) -> ModelFn:
    if isinstance(module, torch.nn.Module):
        module.eval()
    return module  # type: ignore[no-any-return]


def load_model(cfg: ModelConfig, device: torch.device) -> ModelFn:
    confined(cfg.directory.parent, cfg.artifact)  # models are the repository's subdirectories
    if cfg.platform == "python":
        return _load_python(cfg, device)
    if cfg.platform == "pytorch_libtorch":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DeprecationWarning)
            module = torch.jit.load(str(cfg.artifact), map_location=device)
        if caught:
            log.warning("model %s: %s (%s)", cfg.name, caught[0].message, cfg.artifact)
        return _eval(module)
    if cfg.platform == "torch_export":
        program = torch.export.load(str(cfg.artifact))
        if device.type != "cpu":
            program = move_to_device_pass(program, device)
        return program.module()  # already in inference form: no eval()
    raise ValueError(f"{cfg.directory}: unknown platform {cfg.platform!r}")
