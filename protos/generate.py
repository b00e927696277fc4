"""Generate the Python stubs of protos/*.proto, or check that they are fresh.

    python protos/generate.py           # write the stubs beside the .proto files
    python protos/generate.py --check   # exit 1 if a committed stub is stale

The stubs register their descriptors in batchd's own descriptor pool
(`batchd.protos._pool.POOL`) instead of protobuf's process-wide default pool:
tritonclient registers the same `inference.*` names in the default pool, and
one process must be able to import both.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ("inference.proto", "jobs.proto", "wire.proto")
VIRTUAL_ROOT = "batchd/protos"  # the proto import path matches the Python package
POOL_IMPORT = "from batchd.protos._pool import POOL as _batchd_pool\n"


def _rewrite(text: str) -> str:
    if "_descriptor_pool.Default()" not in text:
        return text
    text = text.replace("_descriptor_pool.Default()", "_batchd_pool")
    marker = "from google.protobuf import descriptor_pool as _descriptor_pool\n"
    return text.replace(marker, marker + POOL_IMPORT, 1)


def generate() -> dict[str, str]:
    """Return {file name: content} of every generated stub."""
    from grpc_tools import protoc  # a build-time dependency only

    include = Path(protoc.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory() as out:
        args = [
            "protoc",
            f"-I{VIRTUAL_ROOT}={HERE}",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *(f"{VIRTUAL_ROOT}/{name}" for name in PROTOS),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        produced = Path(out) / VIRTUAL_ROOT
        files = {p.name: _rewrite(p.read_text()) for p in sorted(produced.iterdir())}
    # A proto without services still gets an empty *_grpc.py; keep only real ones.
    return {n: t for n, t in files.items() if not (n.endswith("_grpc.py") and "def add_" not in t)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if stubs are stale")
    check = parser.parse_args().check
    stale = []
    for name, text in generate().items():
        path = HERE / name
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale generated stubs: {', '.join(stale)}; run `make protos`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
