"""A reader over one TOML table that names the file, the table and the key in
every error. Used by model_config.py only."""

from __future__ import annotations

import difflib
import math
import os
import stat
import tomllib
from pathlib import Path
from typing import Any

# The widest integers TOML holds (its spec: 64-bit signed; tomllib takes any), and
# the widest a key may take where it travels in an int32 field (ModelConfig's
# max_batch_size: server/describe.py).
INT64_MAX, INT32_MAX = 2**63 - 1, 2**31 - 1
# A model.toml is a page of keys; read no more than this of one (a file swapped for a
# log, a disk image), so that a repository scan's memory and time stay bounded.
MAX_TOML_BYTES = 1 << 20


class ConfigError(ValueError):
    """A model.toml (or repository) is invalid; the message names the file and the key.
    It is cut to MAX_ERROR_CHARS: it travels in a gRPC status, whose clients take 16 KiB
    of metadata (a 100 KB value quoted whole failed the call as RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str) -> None:
        if len(message) > MAX_ERROR_CHARS:
            message = f"{message[:MAX_ERROR_CHARS]}... ({len(message)} characters)"
        super().__init__(message)


MAX_ERROR_CHARS, SAID_CHARS = 2000, 60


def said(value: Any, quoted: bool = True) -> str:
    """A value from a file, as an error quotes it: its repr (a key: as it is), cut to
    SAID_CHARS."""
    text = repr(value) if quoted else str(value)
    return text if len(text) <= SAID_CHARS else f"{text[:SAID_CHARS]}... ({len(text)} characters)"


_REQUIRED = object()


def read_toml(path: Path) -> dict[str, Any]:
    """The document in `path`: UTF-8 TOML (as its spec says) whose integers are 64-bit;
    any other file is a ConfigError naming it, never a UnicodeDecodeError."""
    try:
        doc = tomllib.loads(read_bounded(path).decode("utf-8"))
    except ConfigError:
        raise  # (its own: a ValueError too, not to be said again as "not valid TOML")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 (TOML is): byte {e.object[e.start]:#04x} at "
                          f"offset {e.start}") from None  # fmt: skip
    except ValueError as e:  # TOMLDecodeError; an integer of over 4300 digits
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    _check_integers(path, doc)
    return doc


def read_bounded(path: Path) -> bytes:
    """At most MAX_TOML_BYTES of a regular file; opened without blocking, so that a
    model.toml swapped for a FIFO after the scan saw a file is refused, not waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{path}: not a regular file")
        data = f.read(MAX_TOML_BYTES + 1)
    if len(data) > MAX_TOML_BYTES:
        raise ConfigError(f"{path}: over {MAX_TOML_BYTES >> 20} MiB; a model.toml holds keys "
                          "only, and is read no further")  # fmt: skip
    return data


def _check_integers(path: Path, value: Any) -> None:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        for v in value:
            _check_integers(path, v)
    elif isinstance(value, int) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ConfigError(f"{path}: not valid TOML: an integer of {len(str(abs(value)))} "
                          "digits, beyond the 64 bits TOML integers have")  # fmt: skip


class Reader:
    def __init__(self, path: Path, table: Any, where: str) -> None:
        if not isinstance(table, dict):
            what = where.strip() or "the file"
            raise ConfigError(f"{path}: {what} must be a table, got {type(table).__name__}")
        self.path, self.table, self.where = path, dict(table), where

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: {self.where}key '{key}': {problem}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = _REQUIRED) -> Any:
        if key not in self.table:
            if default is _REQUIRED:
                raise self.fail(key, f"is required{self.near(key)}")
            return default
        value = self.table.pop(key)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise self.fail(key, f"expected {names}, got {said(value)}")
        return value

    def integer(self, key: str, default: int, minimum: int = 0, maximum: int = INT64_MAX) -> int:
        value: int = self.get(key, int, default)
        if not minimum <= value <= maximum:
            bound = f">= {minimum}" if maximum == INT64_MAX else f"from {minimum} to {maximum}"
            raise self.fail(key, f"expected an integer {bound}, got {value}")
        return value

    def number(self, key: str, default: float, minimum: float = 0.0) -> float:
        """A float or integer >= `minimum`; inf passes (a limit that never ends), NaN,
        which compares false with everything and so would pass any bound, does not."""
        value = float(self.get(key, (int, float), default))
        if math.isnan(value) or value < minimum:
            raise self.fail(key, f"expected a number >= {minimum}, got {value}")
        return value

    def choice(self, key: str, options: tuple[str, ...], default: str) -> str:
        value: str = self.get(key, str, default)
        if value not in options:
            raise self.fail(key, f"expected one of {', '.join(options)}, got {said(value)}")
        return value

    def int_list(self, key: str, minimum: int = 0) -> tuple[int, ...]:
        values = self.get(key, list, [])
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in values):
            raise self.fail(key, f"expected a list of integers >= {minimum}, got {said(values)}")
        return tuple(values)

    def shape(self, key: str) -> tuple[int, ...]:
        """A tensor's dims: each positive, or -1 (variable)."""
        dims = self.get(key, list)
        if not all(isinstance(d, int) and not isinstance(d, bool) and (d > 0 or d == -1)
                   for d in dims):  # fmt: skip
            raise self.fail(key, f"expected a list of positive integers or -1, got {said(dims)}")
        return tuple(dims)

    def near(self, key: str) -> str:
        """For a key that is not there: the key not yet read that is most like it, if
        any (`shap` for `shape`, `dtype` for `datatype`), said as a likely misspelling."""
        like = difflib.get_close_matches(key, [k for k in self.table if isinstance(k, str)], 1)
        return f" ('{said(like[0], False)}' is there: misspelt?)" if like else ""

    def table_of(self, key: str) -> Reader:
        return Reader(self.path, self.table.pop(key, {}), f"[{key}] ")

    def done(self) -> None:
        if self.table:
            keys = sorted(self.table)
            unknown = ", ".join(said(k, False) for k in keys[:8]) + (", ..." if keys[8:] else "")
            raise ConfigError(f"{self.path}: {self.where}unknown key(s): {unknown}")
