"""Hostile model.toml files and `batchd serve` flags: each is refused at start-up
(or by `batchd models DIR --check`) with a ConfigError naming the file and the key,
never accepted into a server that then fails every request, and never a traceback."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from batchd.protos import repository
from batchd.protos.model_config import ConfigError, load_model_config
from batchd.protos.repository import find_model, load_each, load_repository
from batchd.server import index, supervisor
from batchd.server.config import ServerConfig, Workers
from batchd.server.describe import model_config
from batchd.server.supervisor import plan_workers
from batchd.worker.check import batch_sizes, check_model, check_repository
from tests.servers import EXAMPLES
from tests.test_contracts import GOOD  # X FP32 [2] -> Y FP32 [2], max_batch_size 4

ECHO = "def load(device):\n    return lambda x: x\n"


def write(root: Path, name: str, toml: str | bytes, model: str = ECHO) -> Path:
    d = root / name
    d.mkdir(parents=True)
    if isinstance(toml, str):
        toml = toml.encode()
    (d / "model.toml").write_bytes(toml)
    (d / "model.py").write_text(model)
    return d


def refused(d: Path, *parts: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_model_config(d)
    message = str(info.value)
    assert message.startswith(f"{d / 'model.toml'}: "), message
    for part in parts:
        assert part in message, message
    return message


@pytest.mark.parametrize(
    ("table", "key"),
    [("instances", "execution_timeout_s"), ("batching", "target_latency_ms")],
)
def test_a_nan_number_is_refused(tmp_path: Path, table: str, key: str) -> None:
    """NaN compares false with every bound: a NaN execution_timeout_s would never
    declare a hung forward overdue. inf stays what it was, a limit never reached."""
    d = write(tmp_path, "nan", f"{GOOD}[{table}]\n{key} = nan\n")
    refused(d, f"[{table}] key '{key}': expected a number >= ", "got nan")
    (d / "model.toml").write_text(f"{GOOD}[{table}]\n{key} = inf\n")
    cfg = load_model_config(d)
    assert math.isinf(getattr(cfg.instances if table == "instances" else cfg.batching, key))


LONG = "Q" * 100_000


@pytest.mark.parametrize(
    ("toml", "parts"),
    [
        (GOOD.replace('datatype = "FP32"', f'datatype = "{LONG}"', 1),
         ["key 'datatype': expected one of", f"got '{'Q' * 59}... (100002 characters)"]),
        (f'name = "{LONG}"\n' + GOOD, ["key 'name': expected letters", "(100002 characters)"]),
        (GOOD + f"[instances]\n{LONG} = 1\n",
         ["[instances] unknown key(s): QQQ", "... (100000 characters)"]),
        (GOOD.replace('name = "X"', f'name = "{LONG}"', 1).replace("shape = [2]", "shape = 2", 1),
         ["[[input]] 'QQQ", "... (100000 characters)' key 'shape': expected list, got 2"]),
        (GOOD + "".join(f"k{i} = 1\n" for i in range(20)),
         ["unknown key(s): k0, k1, ", "k15, ..."]),
    ],
)  # fmt: skip
def test_a_long_value_is_quoted_by_its_prefix_and_the_message_is_bounded(
    tmp_path: Path, toml: str, parts: list[str]
) -> None:
    """A 100 KB value was quoted whole: over gRPC, RepositoryModelLoad's message passed
    the 16 KiB of metadata clients take, and its caller got RESOURCE_EXHAUSTED 'Stream
    removed', never which key was wrong. RepositoryIndex's reasons held it too."""
    message = refused(write(tmp_path, "long", toml), *parts)
    assert len(message) < 1000, message


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        ("shape = [2]\n[[output]]", "shap = [2]\n[[output]]",
         "[[input]] 'X' key 'shape': is required ('shap' is there: misspelt?)"),
        ('datatype = "FP32"\nshape = [2]\n[[output]]', 'dtype = "FP32"\nshape = [2]\n[[output]]',
         "[[input]] 'X' key 'datatype': is required ('dtype' is there: misspelt?)"),
        ("[[input]]", "[[inputs]]",
         "key 'input': expected at least one [[input]] table ('inputs' is there: misspelt?)"),
        # (not a misspelling: a level with no levels, which passed and was never used)
        ("shape = [2]\n", "shape = [2]\n[batching]\ndefault_priority_level = 2\n",
         "[batching] key 'default_priority_level': expected 1..priority_levels (0), got 2"),
    ],
)  # fmt: skip
def test_a_misspelt_key_is_named_where_its_key_is_missed(
    tmp_path: Path, old: str, new: str, said: str
) -> None:
    """The error named only the key it missed ("is required"), never the misspelling
    beside it: the unknown key would have been reported once every key was read."""
    refused(write(tmp_path, "m", GOOD.replace(old, new, 1)), said)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (b"# mod\xe8le de r\xe9f\xe9rence\n" + GOOD.encode(), "not UTF-8 (TOML is): byte 0xe8"),
        ('model = "x"\n' + GOOD, "[model] must be a table, got str"),
        ("pad = " + "9" * 5000 + "\n" + GOOD, "not valid TOML"),
        ("pad = " + "9" * 40 + "\n" + GOOD, "an integer of 40 digits, beyond the 64 bits"),
    ],
)
def test_a_malformed_file_is_a_config_error_naming_it(
    tmp_path: Path, toml: str | bytes, message: str
) -> None:
    refused(write(tmp_path, "bad", toml), message)


def test_a_huge_file_or_a_fifo_is_refused_without_reading_it_all_or_waiting(
    tmp_path: Path,
) -> None:
    """A model.toml grown past 1 MiB (valid TOML: comments) was read whole, every
    RepositoryIndex call; one swapped for a FIFO after the scan blocked the reading
    thread until a writer came."""
    d = write(tmp_path, "big", ("# " + "x" * 1022 + "\n") * 1025 + GOOD)
    path = d / "model.toml"
    assert refused(d) == f"{path}: over 1 MiB; a model.toml holds keys only, and is read no further"
    path.unlink()
    os.mkfifo(path)
    assert refused(d) == f"{path}: not a regular file"  # (not "not valid TOML: PATH: ...")


def test_a_model_s_files_leave_out_hidden_ones_caches_and_logs(tmp_path: Path) -> None:
    """What a version is loaded from, to tell whether it changed: not what loading and
    serving write beside it (__pycache__, *.log), nor hidden files and folders (a .git
    beside a model was walked whole, then left out); a link to a folder is not followed."""
    d = tmp_path / "m"
    for rel in ("model.py", "sub/w.bin", "a.log", ".env", "sub/.hidden", "__pycache__/m.pyc",
                ".git/objects/ab", "sub/.cache/x", "../elsewhere/f"):  # fmt: skip
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(rel)
    (d / "link").symlink_to(tmp_path / "elsewhere")
    (d / "file-link").symlink_to(d / "model.py")
    files = repository.files_of(d)
    assert sorted(path for path, _, _ in files) == ["file-link", "model.py", "sub/w.bin"]
    assert ("model.py", len("model.py"), (d / "model.py").stat().st_mtime_ns) in files


def test_a_model_toml_rewritten_before_the_files_snapshot_is_read_as_the_snapshot_has_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load read model.toml, then snapshotted the files to check them against once
    loaded: a rewrite between the two was in the snapshot, so the load passed as unchanged
    with the frontend holding the old config and the workers the new (36 of 40 loads of a
    review's race). The config is read again after the snapshot."""
    write(tmp_path, "m", GOOD)
    real = repository.files_of

    def rewritten_first(directory: Path) -> repository.Files:
        (directory / "model.toml").write_text(
            GOOD.replace("max_batch_size = 4", "max_batch_size = 3")
        )
        return real(directory)

    monkeypatch.setattr(repository, "files_of", rewritten_first)
    cfg, files = repository.find_with_files(tmp_path, "m")
    assert cfg.max_batch_size == 3 and files == real(tmp_path / "m")

    def moved_first(directory: Path) -> repository.Files:  # (a deploy renamed the folder)
        write(tmp_path, "m2", 'name = "n"\n' + GOOD)
        (directory / "model.toml").unlink()
        return real(directory)

    write(tmp_path, "n", GOOD)
    monkeypatch.setattr(repository, "files_of", moved_first)
    with pytest.raises(ConfigError, match=r"m2: model 'n' moved here from .*/n as it was read"):
        repository.find_with_files(tmp_path, "n")

    def flipped_first(directory: Path) -> repository.Files:  # (a deploy's symlink swap)
        (tmp_path / "live").unlink()
        (tmp_path / "live").symlink_to(tmp_path / "blue")
        return real(directory)

    for colour in ("green", "blue"):
        write(tmp_path, colour, 'name = "live"\n' + GOOD)
    (tmp_path / "live").symlink_to(tmp_path / "green")
    monkeypatch.setattr(repository, "files_of", flipped_first)
    with pytest.raises(ConfigError, match="model 'live' moved here from"):
        repository.find_with_files(tmp_path, "live")


def test_an_unforeseen_failure_while_parsing_is_a_config_error_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backstop: whatever escapes the checks still names the file."""

    def broken(*args: object) -> None:
        raise KeyError("surprise")

    monkeypatch.setattr("batchd.protos.model_config._batching", broken)
    refused(write(tmp_path, "m", GOOD), "cannot be read as a model: KeyError: 'surprise'")


def test_a_malformed_neighbour_is_reported_not_raised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Start-up names the file; a model found by its declared name loads past a broken
    neighbour (RepositoryIndex, a worker's LOAD); `--check` reports it as FAILED."""
    write(tmp_path, "a_latin", b"# \xe9\n" + GOOD.encode())
    write(tmp_path, "b_scalar", 'model = "x"\n' + GOOD)
    write(tmp_path, "c_good", 'name = "declared"\n' + GOOD)
    with pytest.raises(ConfigError, match=r"a_latin/model\.toml: not UTF-8"):
        load_repository(tmp_path)
    assert find_model(tmp_path, "declared").directory == tmp_path / "c_good"
    assert check_repository(tmp_path) == 2
    out = capsys.readouterr().out
    assert "b_scalar/model.toml: [model] must be a table" in out and "1 ok, 2 failed" in out


def test_the_index_lists_a_name_several_folders_declare_under_that_name(tmp_path: Path) -> None:
    """Folder k/ declares y, y/ and z/ declare m: the index keyed the duplicate's error by
    its folder, so model y (loadable, from k/) was listed as broken and m not at all
    (review 54g). m is UNAVAILABLE, naming every folder that declares it; y is loadable."""
    write(tmp_path, "k", 'name = "y"\n' + GOOD)
    for sub in ("y", "z", "zz"):
        write(tmp_path, sub, 'name = "m"\n' + GOOD)
    listed = {e.name: e for e in index.entries(load_each(tmp_path), {}, {}, bool, {})}
    assert set(listed) == {"m", "y"} and listed["y"].reason == "not loaded", listed
    assert listed["m"].reason == "model name 'm' is declared by y/, z/ and zz/; rename one"
    write(tmp_path, "m", "max_batch_size = [")  # a broken folder of that name: both said
    listed = {e.name: e for e in index.entries(load_each(tmp_path), {}, {}, bool, {})}
    assert "m/model.toml" in listed["m"].reason and "declared by y/" in listed["m"].reason


def test_a_name_two_folders_declare_is_found_twice_even_escaped(tmp_path: Path) -> None:
    """find_model(unique=True), a load's: a folder that declares the name too, spelt with
    an escape, is found; a backslash elsewhere (a comment) has no file parsed for it."""
    write(tmp_path, "dup", GOOD)
    write(tmp_path, "other", 'name = "d\\u0075p"\n' + GOOD)
    write(tmp_path, "third", "# C:\\models\n" + GOOD)
    assert find_model(tmp_path, "dup").directory.name == "dup"
    with pytest.raises(ConfigError, match="'dup' is declared by dup/ and other/; rename one"):
        find_model(tmp_path, "dup", unique=True)
    assert repository._may_declare(tmp_path / "third" / "model.toml", "dup") is False


def test_models_check_refuses_a_name_used_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As serving does (load_repository), not each directory on its own; both folders
    are refused, as a load of the name is (the first was listed as fine)."""
    for sub in ("dupA", "dupB"):
        write(tmp_path, sub, 'name = "same"\n' + GOOD)
    assert check_repository(tmp_path) == 2
    out = capsys.readouterr().out
    for sub in ("dupA", "dupB"):
        assert f"{sub}/model.toml: model name 'same' is declared by dupA/ and dupB/" in out
    assert "0 ok, 2 failed" in out


def test_a_repository_pointed_at_the_wrong_folder_is_said_to_be_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model's own folder given as the repository, an empty one, and a model folder
    without its model.toml were served (or checked: "0 ok, 0 failed", exit 0) without
    a word: the server then said "unknown model" to every call."""
    model = write(tmp_path, "scaler", GOOD)
    with pytest.raises(ConfigError, match=r"scaler holds a model.toml: it is one model's folder"):
        load_repository(model)
    assert check_repository(model) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    assert check_repository(empty) == 1
    (tmp_path / "noconf").mkdir()
    (tmp_path / "noconf" / "model.py").write_text(ECHO)
    (tmp_path / "looped" / "model.toml").mkdir(parents=True)  # (a folder: no word was said)
    (tmp_path / "nowhere").mkdir()
    (tmp_path / "nowhere" / "model.toml").symlink_to("model.toml")  # a link in a loop
    assert check_repository(tmp_path) == 0  # scaler passes; noconf is said to be no model
    out = capsys.readouterr().out
    assert "looped/model.toml: not a file, or a link to none: not a model, passed over" in out
    assert "nowhere/model.toml: not a file, or a link to none" in out
    assert "a model repository is the folder above it" in out
    assert "the model repository holds no model: each model is a folder of it" in out
    assert "noconf: model.py but no model.toml beside it: not a model, passed over" in out
    batchd = str(Path(sys.executable).parent / "batchd")
    listing = subprocess.run([batchd, "models", str(empty)], capture_output=True, text=True)
    assert listing.returncode == 1 and "holds no model" in listing.stderr


STEPWISE = """[[input]]
name = "N"
datatype = "INT64"
shape = [1]
[[output]]
name = "OUT"
datatype = "INT64"
shape = [1]
[generate]
max_steps = 2
"""
STARTS = """import torch
from batchd.worker import InputRefused
class M:
    def start(self, requests):
        {start}
        return [0 for _ in requests]
    def step(self, states):
        return [({{'OUT': torch.tensor([7])}}, False) for _ in states]
def load(device):
    return M()
"""


def test_models_check_fails_a_start_that_raises_anything_but_input_refused(
    tmp_path: Path,
) -> None:
    """Refused zeros (InputRefused: the caller's fault) are a note; a bug is a failure."""
    buggy = check_model(write(tmp_path, "buggy", STEPWISE, STARTS.format(start="undefined")))
    assert "start() raised: NameError: name 'undefined' is not defined" in (buggy.problem or "")
    picky = STARTS.format(start="raise InputRefused('N must be >= 1')")
    row = check_model(write(tmp_path, "picky", STEPWISE, picky))
    assert row.problem is None, row.problem
    assert row.note == "a sequence of zeros was refused (N must be >= 1): outputs not checked"


def test_models_check_runs_one_row_and_the_largest_batch(tmp_path: Path) -> None:
    """A model that takes only batches of 2 (a .pt2 exported with a fixed batch dim)
    fails --check; a huge max_batch_size is checked with MAX_ROWS rows, no more."""
    fixed = "def load(device):\n    return lambda x: x.reshape(2, 2)\n"
    row = check_model(write(tmp_path, "fixed", GOOD, fixed))
    assert (row.problem or "").startswith("a batch of 1 row(s): RuntimeError: shape '[2, 2]'")
    huge = GOOD.replace("max_batch_size = 4", "max_batch_size = 100000")
    capped = "def load(device):\n    return lambda x: x[:64] if len(x) <= 64 else None\n"
    d = write(tmp_path, "huge", huge, capped)
    assert batch_sizes(load_model_config(d)) == [2, 1, 64]
    assert check_model(d).problem is None
    tokens = huge.replace("shape = [2]\n", "shape = [-1]\nragged = true\n", 1)
    tokens += "[batching]\nmax_batch_tokens = 12\n"  # 3 rows of the check's length 4
    assert batch_sizes(load_model_config(write(tmp_path, "tokens", tokens))) == [2, 1, 3]
    assert batch_sizes(load_model_config(EXAMPLES / "decoder")) == [0]


POSITIONS = """
import torch
def load(device):
    table = torch.nn.Embedding(2, 2)  # max_length = 2 promises no row is longer
    def forward(x, companion):  # padded: [rows, length] and its mask; packed: offsets
        longest = x.shape[1] if x.dim() == 2 else int(companion.diff().max())
        rows = len(x) if x.dim() == 2 else len(companion) - 1
        return table(torch.arange(longest)).sum(0).expand(rows, 2)
    return forward
"""


@pytest.mark.parametrize("packed", [False, True])
def test_models_check_sends_no_row_longer_than_serving_admits(tmp_path: Path, packed: bool) -> None:
    """A model indexing a table of max_length positions failed --check (IndexError): the
    zeros had rows of 4 whatever max_length said, though serving refuses any longer."""
    toml = GOOD.replace("shape = [2]\n", "shape = [-1]\nragged = true\nmax_length = 2\n", 1)
    toml += '[[batch_input]]\nname = "C"\nkind = "mask"\nsource = "X"\n'
    if packed:
        toml = toml.replace("ragged = true\n", "ragged = true\npacked = true\n", 1)
        toml = toml.replace('"mask"', '"offsets"')
    row = check_model(write(tmp_path, "positions", toml, POSITIONS))
    assert row.problem is None, row.problem


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("priority_levels", 257, "expected an integer from 0 to 256, got 257"),
        ("max_batch_size", 2**31, "expected an integer from 0 to 2147483647"),
        ("max_batch_size", 2**63 - 1, "expected an integer from 0 to 2147483647"),
        ("count", 1000, "expected an integer from 1 to 64, got 1000"),
    ],
)
def test_integers_are_bounded(tmp_path: Path, key: str, value: int, message: str) -> None:
    """priority_levels: the scheduler scans every level per batch; max_batch_size
    travels in ModelConfig's int32 field; each of `count` copies is a worker process."""
    toml = GOOD.replace("max_batch_size = 4", f"max_batch_size = {value}")
    if key == "priority_levels":
        toml = f"{GOOD}[batching]\npriority_levels = {value}\n"
    if key == "count":
        toml = f"{GOOD}[instances]\ncount = {value}\n"
    refused(write(tmp_path, "m", toml), f"key '{key}': {message}")


def test_the_largest_accepted_integers_describe_on_the_wire(tmp_path: Path) -> None:
    toml = GOOD.replace("max_batch_size = 4", f"max_batch_size = {2**31 - 1}")
    toml += f"[batching]\npriority_levels = 256\nmax_queue_delay_us = {2**63 - 1}\n"
    cfg = load_model_config(write(tmp_path, "m", toml))
    config = model_config(cfg).config
    assert config.max_batch_size == 2**31 - 1 and config.dynamic_batching.priority_levels == 256
    assert config.SerializeToString()


@pytest.mark.parametrize("devices", [",", "", " , "])
def test_a_device_list_naming_no_device_is_refused(devices: str) -> None:
    """It would start no worker, and the server would never be ready."""
    workers = Workers(devices=devices)
    with pytest.raises(ConfigError, match=r"--devices takes a list such as cpu or cuda:0,cuda:1"):
        ServerConfig(model_repository=EXAMPLES, workers=workers).check()
    away = Workers(devices=devices, local=False)  # workers join with `batchd worker`
    ServerConfig(model_repository=EXAMPLES, workers=away).check()


@pytest.mark.parametrize("devices", ["gpu0", "cpu,cuda:64"])
def test_a_device_this_host_does_not_have_is_refused_by_server_and_worker(devices: str) -> None:
    """`--devices gpu0` restarted a worker that failed on it forever; `--devices cuda:0`
    on a host without one served, every call failing. Both stop start-up, naming it;
    `batchd worker --device` likewise."""
    workers = Workers(devices=devices)
    with pytest.raises(ConfigError, match=r"--devices: '(gpu0|cuda:64)' is not a device of this"):
        ServerConfig(model_repository=EXAMPLES, workers=workers).check()
    device = devices.split(",")[-1]
    worker = subprocess.run(
        [sys.executable, "-m", "batchd.worker", "--connect", "tcp://127.0.0.1:1",
         "--device", device, "--model-repository", str(EXAMPLES)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert worker.returncode == 2 and f"--device {device!r}: " in worker.stderr, worker.stderr


def test_a_device_listed_twice_gets_two_workers_of_distinct_names() -> None:
    """`--devices cuda:0,cuda:0`: two processes on one GPU. One name for both gave them
    one process handle (by slot) and one socket identity (slot#generation)."""
    models = list(load_repository(EXAMPLES).values())
    slots = [s.slot for s in plan_workers(models, ["cuda:0", "cuda:0", "cpu", "cpu"], 1)]
    assert slots == ["cuda0", "cuda0-1", "cpu2", "cpu3"]


def test_models_check_reports_a_load_that_calls_sys_exit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """sys.exit(0) in a model's load() ended the whole check with status 0, its
    neighbours unchecked (a CI gate passed); it fails that model only, as serving does."""
    write(tmp_path, "a_exits", GOOD, "import sys\ndef load(device):\n    sys.exit(0)\n")
    write(tmp_path, "b_good", GOOD, "def load(device):\n    return lambda x: x\n")
    assert check_repository(tmp_path) == 1
    out = capsys.readouterr().out
    assert "SystemExit: 0" in out and "1 ok, 1 failed" in out


def test_models_check_reports_an_error_whose_message_raises_or_is_huge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The report said f"{e}": an exception whose __str__ raised ended the check with a
    traceback (SystemExit: silently, with its status) and no report of any model; a
    message of megabytes was printed whole. Now each is a line, as serving says it."""
    evil = "class Evil(Exception):\n    def __str__(self):\n        raise SystemExit(5)\n"
    write(tmp_path, "a_evil", GOOD, evil + "def load(device):\n    raise Evil()\n")
    write(tmp_path, "b_huge", GOOD, "def load(device):\n    raise ValueError('y' * 10**6)\n")
    write(tmp_path, "c_good", GOOD, "def load(device):\n    return lambda x: x\n")
    assert check_repository(tmp_path) == 2
    out = capsys.readouterr().out
    assert "Evil: (its message could not be read)" in out and "1 ok, 2 failed" in out
    assert "(1000000 characters)" in out and len(out) < 20_000


def test_worker_threads_split_the_cores_this_process_may_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """os.cpu_count() counts the machine's cores: each worker of a pod with 2 CPUs on a
    64-core node got 32 threads. Its affinity (taskset, a cpuset) and the tightest CPU
    quota of its own cgroup and those above it bound them (the mount's root alone missed
    systemd's CPUQuota= and any cgroup of its own)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(64)))
    root, own = tmp_path / "cgroup", tmp_path / "own"

    def cpus(own_line: str, files: dict[str, str]) -> int:
        shutil.rmtree(root, ignore_errors=True)
        for name, text in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        own.write_text(own_line + "\n")
        return supervisor.usable_cpus(root, own)

    assert cpus("0::/", {"cpu.max": "max 100000"}) == 64  # cgroup v2, a container's own
    assert cpus("0::/", {"cpu.max": "150000 100000"}) == 2
    assert (
        cpus(
            "0::/system.slice/batchd.service",
            {  # systemd's CPUQuota=50%
                "cpu.max": "max 100000",
                "system.slice/batchd.service/cpu.max": "50000 100000",
            },
        )
        == 1
    )
    assert cpus("0::/a/b", {"a/cpu.max": "300000 100000", "a/b/cpu.max": "max 100000"}) == 3
    assert (
        cpus(
            "4:cpu,cpuacct:/",
            {"cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
        )
        == 64
    )
    assert (
        cpus(
            "4:cpu,cpuacct:/review",
            {  # v1, a cgroup of its own
                "cpu,cpuacct/review/cpu.cfs_quota_us": "50000",
                "cpu,cpuacct/review/cpu.cfs_period_us": "100000",
            },
        )
        == 1
    )
    assert (
        cpus(
            "4:cpu:/docker/abc",
            {  # v1, the container's own mounted at the top
                "cpu/cpu.cfs_quota_us": "400000",
                "cpu/cpu.cfs_period_us": "100000",
            },
        )
        == 4
    )
    assert cpus("0::/", {"cpu.max": "100000 0"}) == 64  # (nonsense: no bound)
    assert cpus("garbage", {"cpu.max": "100000 100000"}) == 64
    assert supervisor.usable_cpus(tmp_path / "none", tmp_path / "none") == 64
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {3})  # taskset -c 3
    assert cpus("0::/", {"cpu.max": "max 100000"}) == 1
    monkeypatch.setattr(supervisor, "usable_cpus", lambda: 4)
    assert [s.threads for s in plan_workers([], ["cpu", "cpu"], 0)] == [2, 2]
