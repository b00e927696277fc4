"""A reader over one TOML table that names the file, the table and the key in
every error. Used by model_config.py only."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A model.toml (or repository) is invalid; the message names the file and the key."""


_REQUIRED = object()


class Reader:
    def __init__(self, path: Path, table: Any, where: str) -> None:
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {where.strip() or 'the file'} must be a table")
        self.path, self.table, self.where = path, dict(table), where

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: {self.where}key '{key}': {problem}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = _REQUIRED) -> Any:
        if key not in self.table:
            if default is _REQUIRED:
                raise self.fail(key, "is required")
            return default
        value = self.table.pop(key)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise self.fail(key, f"expected {names}, got {value!r}")
        return value

    def integer(self, key: str, default: int, minimum: int = 0) -> int:
        value: int = self.get(key, int, default)
        if value < minimum:
            raise self.fail(key, f"expected an integer >= {minimum}, got {value}")
        return value

    def number(self, key: str, default: float, minimum: float = 0.0) -> float:
        value = float(self.get(key, (int, float), default))
        if value < minimum:
            raise self.fail(key, f"expected a number >= {minimum}, got {value}")
        return value

    def choice(self, key: str, options: tuple[str, ...], default: str) -> str:
        value: str = self.get(key, str, default)
        if value not in options:
            raise self.fail(key, f"expected one of {', '.join(options)}, got {value!r}")
        return value

    def int_list(self, key: str, minimum: int = 0) -> tuple[int, ...]:
        values = self.get(key, list, [])
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in values):
            raise self.fail(key, f"expected a list of integers >= {minimum}, got {values!r}")
        return tuple(values)

    def table_of(self, key: str) -> Reader:
        return Reader(self.path, self.table.pop(key, {}), f"[{key}] ")

    def done(self) -> None:
        if self.table:
            unknown = ", ".join(sorted(self.table))
            raise ConfigError(f"{self.path}: {self.where}unknown key(s): {unknown}")
