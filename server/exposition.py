"""/metrics' text: Prometheus' text format (version 0.0.4), written as lines.

prometheus_client builds an object for each sample, then renders it: a scrape of
1,500 models (39,000 samples) held the event loop 0.35-0.67 s, and the requests
that came meanwhile waited for it. batchd's own families (metrics.Collector) are
written here as lines instead, about 2.5 µs a sample, a few models a turn of the
loop: a source that has `parts()` is read a part a turn, and the loop runs between
parts. Another source (the jobs' counts, a few samples) is rendered by
prometheus_client. README.md, Metrics, has the figures (bench/metrics_scrape.py).

With `--frontends N`, frontend 0 merges every frontend's text (siblings.py):
`parse` reads it back, checks each line, and labels each sample with its frontend.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString


@dataclass(slots=True)
class Family:
    """One metric family's text: its HELP and TYPE lines, then its samples' lines."""

    name: str  # as its samples are named: a counter's ends in _total
    head: str
    lines: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, name: str, kind: str, doc: str) -> Family:
        name = f"{name}_total" if kind == "counter" else name
        doc = doc.replace("\\", r"\\").replace("\n", r"\n")
        return cls(name, f"# HELP {name} {doc}\n# TYPE {name} {kind}\n")

    def add(self, labels: str, value: float) -> None:
        """A sample: `labels` as labels() writes them ("" for none)."""
        braced = f"{{{labels}}}" if labels else ""
        self.lines.append(f"{self.name}{braced} {_value(value)}\n")

    def histogram(self, labels: str, buckets: Iterable[tuple[str, float]], total: float) -> None:
        """A histogram's samples: `buckets`, (upper bound, count at or under it), end at +Inf.
        `le` is written first, where prometheus_client sorts: `labels` sort after it."""
        count: float = 0
        rest = f",{labels}" if labels else ""
        for le, count in buckets:
            self.lines.append(f'{self.name}_bucket{{le="{le}"{rest}}} {_value(count)}\n')
        braced = f"{{{labels}}}" if labels else ""
        self.lines.append(f"{self.name}_count{braced} {_value(count)}\n")
        self.lines.append(f"{self.name}_sum{braced} {_value(total)}\n")


Families = dict[str, Family]  # by name, in the order written


def labels(**pairs: str) -> str:
    """Labels as a sample's braces hold them, names in order, values escaped."""
    return ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(pairs.items()))


def _value(value: float) -> str:
    return str(floatToGoString(value))  # type: ignore[no-untyped-call]


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class Parted(Protocol):
    def parts(self) -> Iterator[Families]: ...


class Collecting(Protocol):  # a prometheus_client collector
    def collect(self) -> Iterable[Metric]: ...


Source = Parted | Collecting


def merge(into: Families, more: Families) -> None:
    for name, family in more.items():
        if (have := into.setdefault(name, family)) is not family:
            have.lines += family.lines


def text(families: Families) -> bytes:
    return "".join(f.head + "".join(f.lines) for f in families.values()).encode()


async def render(sources: Sequence[Source]) -> bytes:
    """The text of every source's families, read a part a turn of the loop."""
    families: Families = {}
    for source in sources:
        if hasattr(source, "parts"):
            for part in cast(Parted, source).parts():
                merge(families, part)
                await asyncio.sleep(0)
        else:
            merge(families, parse(generate_latest(cast(CollectorRegistry, source)).decode()))
    return text(families)


_NAME, _QUOTED = r"[a-zA-Z_][a-zA-Z0-9_]*", r'"(?:[^"\\\n]|\\.)*"'  # a label's
_PAIR, _METRIC = f"{_NAME}={_QUOTED}", r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_NUMBER = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?Inf|NaN"
# name, labels (within the braces), value, timestamp
_SAMPLE = re.compile(
    rf"({_METRIC})(?:\{{((?:{_PAIR}(?:,{_PAIR})*,?)?)\}})?"
    rf" ({_NUMBER})( -?[0-9]+)?\n?"
)
_NAMED = re.compile(f"({_NAME})={_QUOTED}")
_TYPE = re.compile(rf"{_METRIC} (?:counter|gauge|histogram|summary|untyped)")


def parse(exposition: str, label: str = "", whole: Collection[str] = ()) -> Families:
    """The families of `exposition` as prometheus_client and this module write it (each
    family's HELP line, its TYPE line, its samples), each sample labelled `label`
    (name="value", in place of a label of that name) but in the families `whole`.
    ValueError: a line that is not one of those, or a sample of another family."""
    families: Families = {}
    family: Family | None = None
    add = ""
    for line in exposition.split("\n"):  # (only \n ends a line: a label may hold \r)
        if line.startswith("# HELP ") and re.fullmatch(_METRIC, name := line[7:].split(" ")[0]):
            family = families.setdefault(name, Family(name, line + "\n"))
            add = "" if name in whole else label
        elif (
            line.startswith("# TYPE ")
            and family
            and _TYPE.fullmatch(line[7:])
            and (line.split(" ")[2] == family.name)
        ):
            family.head += line + "\n" if family.head.count("\n") == 1 else ""
        elif (m := _SAMPLE.fullmatch(line)) and family and _of(m[1], family.name):
            pairs = [(p[0], p[1]) for p in _NAMED.finditer(m[2] or "")]  # (the pair, its name)
            if len({name for _, name in pairs}) < len(pairs) or not _finite(m[3]):
                raise ValueError(f"a label twice, or a number out of range: {line[:80]!r}")
            if add:  # first, in place of a label of its name
                kept = [pair for pair, name in pairs if name != add.split("=")[0]]
                line = f"{m[1]}{{{','.join([add, *kept])}}} {m[3]}{m[4] or ''}"
            family.lines.append(line + "\n")
        elif line:
            raise ValueError(f"not a line of a metric family: {line[:80]!r}")
    return families


def _finite(number: str) -> bool:
    """Whether Go reads `number` (Inf and NaN written so; 1e400 is out of its range)."""
    return math.isfinite(float(number)) or number.lstrip("+-") in ("Inf", "NaN")


def _of(sample: str, family: str) -> bool:
    return sample == family or sample.startswith(family + "_")
