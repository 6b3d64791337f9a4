"""Bad input and faults, each with its own tiny checkpoint: a broken safetensors header or config.json is a clean
error naming the file and the tensor (or key) through the reader, ``parity inspect`` and the pytest plugin (a
usage error there, not an INTERNALERROR); values a checkpoint must not hold fail ``parity inspect``; a full disk,
a writer killed with SIGKILL and two runs at once lose nothing already written."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_inspect import run_cli
from vllm_parity.errors import CheckpointError, ParityInputError
from vllm_parity.fixtures.checkpoints import Dims, make_fixture
from vllm_parity.harness import snapshots
from vllm_parity.harness.session import Options, ParitySession
from vllm_parity.reference.checkpoint import Checkpoint

pytest_plugins = ["pytester"]

TINY = Dims(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128, vocab=64)
Q = "model.layers.0.self_attn.q_proj"
T = f"{Q}.weight_ternary"


@pytest.fixture(scope="module")
def seed_dir(tmp_path_factory) -> Path:
    return make_fixture("seed-article", tmp_path_factory.mktemp("bad") / "seed", dims=TINY)


@pytest.fixture
def broken(seed_dir, tmp_path) -> Path:
    """A fresh copy of the seed-article fixture, to break."""
    out = tmp_path / "broken"
    shutil.copytree(seed_dir, out)
    return out


def _header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (hlen,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + hlen]), data[8 + hlen:]


def _rewrite_header(path: Path, change) -> None:
    header, body = _header(path)
    change(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def _set(key: str, value):
    return lambda h: h[T].__setitem__(key, value)


def _shift_next(h: dict) -> None:
    """The tensor stored right after T starts 4 bytes early: the two overlap."""
    end = h[T]["data_offsets"][1]
    after = next(n for n, e in h.items() if n != "__metadata__" and e["data_offsets"][0] == end)
    h[after]["data_offsets"] = [o - 4 for o in h[after]["data_offsets"]]


def _reverse(h: dict) -> None:
    h[T]["data_offsets"] = h[T]["data_offsets"][::-1]


HEADER_CASES = {  # case -> (change, what the message says after the file's name)
    "data_offsets as strings": (lambda h: h[T].__setitem__("data_offsets", [str(o) for o in h[T]["data_offsets"]]),
                                rf"entry for tensor '{T}': data_offsets must be \[begin, end\], two non-negative"),
    "data_offsets one number": (_set("data_offsets", 1024), rf"tensor '{T}': data_offsets must be \[begin, end\]"),
    "data_offsets negative": (_set("data_offsets", [-1, 1023]), rf"tensor '{T}': data_offsets must be"),
    "data_offsets reversed": (_reverse, rf"tensor '{T}': data_offsets \[\d+, \d+\] end before they begin"),
    "data_offsets out of range": (lambda h: h[T].__setitem__("data_offsets", [o + 10 ** 15 for o in
                                                                              h[T]["data_offsets"]]),
                                  rf"truncated: tensor '{T}' needs bytes \[1000000000\d+"),
    "data_offsets overlapping": (_shift_next, rf"overlaps tensor '{T}', which ends at byte"),
    "shape as strings": (_set("shape", ["64", "16"]), rf"tensor '{T}': shape must be a list of non-negative integers"),
    "shape negative": (_set("shape", [-64, -16]), rf"tensor '{T}': shape must be a list of non-negative integers"),
    "shape of floats": (_set("shape", [64.0, 16.0]), rf"tensor '{T}': shape must be a list"),
    "shape a string": (_set("shape", "64x16"), rf"tensor '{T}': shape must be a list"),
    "dtype unknown": (_set("dtype", "U4"), rf"tensor '{T}' has unsupported dtype 'U4' \(known: F64"),
    "dtype not a string": (_set("dtype", 8), rf"tensor '{T}' has unsupported dtype 8"),
    "entry not an object": (lambda h: h.__setitem__(T, [1, 2, 3]), rf"tensor '{T}': expected an object of dtype"),
    "entry without dtype": (lambda h: h[T].pop("dtype"), rf"tensor '{T}': expected an object of dtype, shape"),
    "__metadata__ a string": (lambda h: h.__setitem__("__metadata__", "pt"),
                              r"__metadata__ must map strings to strings, got 'pt'"),
    "__metadata__ of numbers": (lambda h: h.__setitem__("__metadata__", {"format": 1}),
                                r"__metadata__ must map strings to strings"),
}


@pytest.mark.parametrize("case", HEADER_CASES)
def test_a_header_entry_of_the_wrong_type_names_file_and_tensor(pytester, broken, case):
    change, says = HEADER_CASES[case]
    _rewrite_header(broken / "model.safetensors", change)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: .*{says}") as info:
        Checkpoint(broken)
    rc, out, err = run_cli(broken)  # the same message from parity inspect, exit 2
    assert rc == 2 and out == "" and err == f"parity inspect: error: {info.value}\n", err
    _usage_error(pytester, broken, str(info.value))


def test_a_hole_in_the_data_section_is_named(broken):
    f = broken / "model.safetensors"
    header, body = _header(f)
    last = max(e["data_offsets"][1] for n, e in header.items() if n != "__metadata__")
    f.write_bytes(f.read_bytes() + b"\0" * 8)  # trailing bytes no tensor owns
    with pytest.raises(CheckpointError, match=rf"the tensors cover {last} bytes of the data section, the file "
                                              rf"holds {last + 8}"):
        Checkpoint(broken)


# -- config.json --------------------------------------------------------------------------------------------------

CONFIG_CASES = {
    "num_hidden_layers missing": (lambda c: c.pop("num_hidden_layers"), "lacks num_hidden_layers"),
    "vocab_size missing": (lambda c: c.pop("vocab_size"), "lacks vocab_size"),
    "num_hidden_layers a string": (lambda c: c.__setitem__("num_hidden_layers", "1"),
                                   "num_hidden_layers must be a positive integer, got '1'"),
    "vocab_size zero": (lambda c: c.__setitem__("vocab_size", 0), "vocab_size must be a positive integer, got 0"),
}


def _change_config(ckpt: Path, change) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    change(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_a_config_without_the_models_sizes_names_the_key(broken, case):
    change, says = CONFIG_CASES[case]
    _change_config(broken, change)
    with pytest.raises(CheckpointError, match=rf"broken/config\.json: {says}"):
        ParitySession(Options(model=str(broken), candidate="kernels", level="op"))


QUANT_CASES = {  # found by the fuzzer (tests/test_fuzz_input.py)
    "ignore of nulls": ({"quant_method": "ternary", "ignore": [None]},
                        r"config.json: quantization_config: ignore must list module names \(strings\), got \[None\]"),
    "a field of the wrong type": ({"attention_bias": None},
                                  r"config.json: transformers cannot build model_type 'llama' from it: "
                                  r"StrictDataclassFieldValidationError"),
}


@pytest.mark.parametrize("case", QUANT_CASES)
def test_a_config_value_of_the_wrong_type_is_a_clean_error(broken, case):
    change, says = QUANT_CASES[case]
    _change_config(broken, lambda c: c.update(change) if "quant_method" not in change else
                   c.__setitem__("quantization_config", change))
    with pytest.raises(ParityInputError, match=says):
        ckpt = Checkpoint(broken)
        ckpt.spec, ckpt.linear_shapes()


# -- parity inspect: values a checkpoint must not hold ---------------------------------------------------------------

def _rewrite(ckpt: Path, change) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})


def _illegal_code(t):
    t[T][3, 5] = 0xFF


INSPECT_CASES = {
    "NaN scale": (lambda t: t[f"{Q}.weight_scale"].__setitem__(0, float("nan")),
                  rf"model.safetensors: tensor '{Q}.weight_scale' holds 1 NaN or Inf value\(s\); expected finite"),
    "Inf in a float weight": (lambda t: t["model.norm.weight"].__setitem__(3, float("inf")),
                              r"model.safetensors: tensor 'model.norm.weight' holds 1 NaN or Inf value\(s\)"),
    "embedding of 100 rows": (lambda t: t.__setitem__("model.embed_tokens.weight", torch.zeros(100, 64)),
                              r"model.safetensors: tensor 'model.embed_tokens.weight' has shape \(100, 64\), expected "
                              r"\(64, 64\) from config.json"),
    "must-not-occur code": (_illegal_code, rf"model.safetensors: tensor '{T}': 1 of 1024 bytes hold code\(s\) \[3\], which "
                                           rf"code_map \[0, 1, -1, None\] marks as must-not-occur \(first at packed "
                                           rf"index \(3, 5\)"),
}


@pytest.mark.parametrize("case", INSPECT_CASES)
def test_inspect_fails_on_values_a_checkpoint_must_not_hold(broken, case):
    change, says = INSPECT_CASES[case]
    _rewrite(broken, change)
    rc, out, _ = run_cli(broken)
    assert rc != 0, out[-2000:]
    warnings = [line for line in out.splitlines() if line.startswith("!!! ") and "WARNINGS" not in line]
    assert any(__import__("re").search(says, w) for w in warnings), warnings


# -- the pytest plugin: a usage error, not an INTERNALERROR -------------------------------------------------------

def _truncate(ckpt: Path) -> None:
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])


def _corrupt(ckpt: Path) -> None:
    f = ckpt / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"\xff" * 12
    f.write_bytes(bytes(data))


def _pickle_only(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04never unpickled")


def _empty(ckpt: Path) -> None:
    shutil.rmtree(ckpt)
    ckpt.mkdir()


PLUGIN_CASES = {
    "truncated": (_truncate, "model.safetensors: truncated: tensor"),
    "corrupt header": (_corrupt, "model.safetensors: corrupt safetensors header (not JSON"),
    "pickle only": (_pickle_only, "only pickle weight files (pytorch_model.bin)"),
    "config missing": (lambda c: (c / "config.json").unlink(), "broken: no config.json"),
    "empty directory": (_empty, "broken: no config.json"),
    "shape as strings": (lambda c: _rewrite_header(c / "model.safetensors", _set("shape", ["64", "16"])),
                         f"tensor '{T}': shape must be a list of non-negative integers"),
    "num_hidden_layers missing": (lambda c: _change_config(c, CONFIG_CASES["num_hidden_layers missing"][0]),
                                  "config.json: lacks num_hidden_layers"),
    "vocab_size a string": (lambda c: _change_config(c, lambda cfg: cfg.__setitem__("vocab_size", "64")),
                            "config.json: vocab_size must be a positive integer, got '64'"),
}


def _usage_error(pytester, ckpt: Path, says: str) -> None:
    result = pytester.runpytest("-p", "no:cacheprovider", "--parity-level=op", f"--parity-model={ckpt}",
                                "--parity-candidate=kernels")
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    assert "INTERNALERROR" not in out and "Traceback" not in out, out[-3000:]
    assert f"ERROR: parity: {ckpt}" in out and says in out, out[-3000:]


@pytest.mark.parametrize("case", PLUGIN_CASES)
def test_a_checkpoint_that_does_not_open_is_a_usage_error(pytester, broken, case):
    breaks, says = PLUGIN_CASES[case]
    breaks(broken)
    _usage_error(pytester, broken, says)


def test_a_bad_prompt_file_is_a_usage_error(pytester, broken, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text("[[1, 2], [3, 99999]]")
    result = pytester.runpytest("-p", "no:cacheprovider", "--parity-level=op", f"--parity-model={broken}",
                                "--parity-candidate=kernels", f"--parity-prompts={prompts}")
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    assert "INTERNALERROR" not in out and "Traceback" not in out, out[-3000:]
    assert f"{prompts}: prompt 1, position 1: token 99999 >= vocab_size" in out, out[-3000:]


# -- a full disk ----------------------------------------------------------------------------------------------------

@pytest.fixture
def full_disk(tmp_path) -> Path:
    """A tmpfs of 16 KiB mounted for the test, filled to its last byte; skipped where mounting is not allowed."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mnt)], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"a full disk needs a tmpfs mounted by the test: {exc}")
    if done.returncode:
        pytest.skip(f"a full disk needs a tmpfs mounted by the test, and mount refused: {done.stderr.strip()}")
    try:
        (mnt / "snap").mkdir()
        (mnt / "report").mkdir()
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 512):
                pass
        except OSError:  # ENOSPC: full
            pass
        finally:
            os.close(fd)
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=30)


def test_a_snapshot_on_a_full_disk_is_a_snapshot_error_and_leaves_no_temporary(full_disk, tmp_path):
    root = full_disk / "snap"
    with pytest.raises(snapshots.SnapshotError, match=rf"snapshot run not written under {root}: the disk is full"):
        snapshots.write(root, "run", {"a@0": torch.ones(4096)}, {"a@0": torch.zeros(4096)}, {"a": {}}, {})
    assert list(root.iterdir()) == []


FAULT_PLUGIN = '''
import torch

from vllm_parity.harness import kernel_candidate

_BUILD = kernel_candidate.build_kernel_model


def _faulty(*args, **kwargs):  # layer 0's input norm off by half: its op tap fails
    model = _BUILD(*args, **kwargs)
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.mul_(1.5)
    return model


def pytest_configure(config):
    kernel_candidate.build_kernel_model = _faulty


def pytest_unconfigure(config):
    kernel_candidate.build_kernel_model = _BUILD
'''


@pytest.fixture(scope="module")
def vllm_imported():
    """A run imports vllm for its version; pytester drops what an in-process run imported, and vllm registers
    torch types that cannot be registered twice: so it is imported once, before the first run."""
    import vllm  # noqa: F401


def _parity_run(pytester, ckpt: Path, report: Path, snap: Path, fault: bool):
    if fault:
        pytester.makepyfile(fault_plugin=FAULT_PLUGIN)
        pytester.syspathinsert()
    prompts = pytester.path / "prompts.json"
    prompts.write_text(json.dumps([[1, 5, 9, 2, 7, 3], [4, 8, 6, 1, 2, 63]]))  # inside the tiny vocabulary
    plugin = ("-p", "fault_plugin") if fault else ()
    return pytester.runpytest("-p", "no:cacheprovider", *plugin, "--parity-level=op", f"--parity-model={ckpt}",
                              "--parity-candidate=kernels", "--parity-taps=layers.0.attn.*", f"--parity-prompts={prompts}",
                              f"--parity-report={report}", f"--parity-snapshot-dir={snap}")


def test_a_full_disk_under_the_snapshot_dir_loses_nothing_else(vllm_imported, pytester, seed_dir, full_disk):
    report = pytester.path / "report"
    result = _parity_run(pytester, seed_dir, report, full_disk / "snap", fault=True)
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED and "INTERNALERROR" not in out, out[-3000:]
    assert "first divergence: layers.0.attn.norm" in out, out[-3000:]
    assert f"no snapshot of the failing taps: snapshot" in out and "the disk is full" in out, out[-3000:]
    assert list((full_disk / "snap").iterdir()) == []  # no .tmp-* left on the full disk
    extras = json.loads((report / "report.json").read_text())["run"]["extras"]
    assert extras["snapshot_error"]["passed"] is False and "the disk is full" in extras["snapshot_error"]["message"]


def test_a_report_on_a_full_disk_is_said_and_fails_the_run(vllm_imported, pytester, seed_dir, full_disk):
    snap = pytester.path / "snap"
    result = _parity_run(pytester, seed_dir, full_disk / "report", snap, fault=False)
    out = result.stdout.str()
    assert "INTERNALERROR" not in out and "Traceback" not in out, out[-3000:]
    assert "no divergence over" in out, out[-3000:]
    assert f"no report written under {full_disk / 'report'}: the disk is full" in out, out[-3000:]
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    assert [p.name for p in (full_disk / "report").iterdir()] == []


# -- a writer killed inside the snapshot write; two runs at once ---------------------------------------------------

WRITER = '''
import sys, time
import torch
from vllm_parity.harness import snapshots

root, run_id, times, stall = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "stall"
_save = snapshots.save_file


def _stalling(tensors, path, *args, **kwargs):  # the first file whole, then stop inside the write
    _save(tensors, path, *args, **kwargs)
    print("inside the snapshot write", flush=True)
    time.sleep(600)


if stall:
    snapshots.save_file = _stalling
for i in range(times):
    snapshots.write(root, run_id, {"a@0": torch.full((64,), float(i))}, {"a@0": torch.zeros(64)}, {"a": {}},
                    {"command": "x", "writer": sys.argv[5]})
'''


def _writer(root: Path, run_id: str, times: int, stall: bool, tag: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(root), run_id, str(times),
                             "stall" if stall else "go", tag], stdout=subprocess.PIPE, text=True)


def test_a_writer_killed_inside_the_snapshot_write_leaves_the_snapshots_whole(tmp_path):
    root = tmp_path / "snap"
    before = snapshots.write(root, "run", {"a@0": torch.ones(4)}, {"a@0": torch.ones(4)}, {"a": {}}, {"command": "x"})
    writer = _writer(root, "run", 1, stall=True, tag="killed")
    try:
        assert writer.stdout.readline().strip() == "inside the snapshot write"
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.wait(timeout=60)
    assert writer.returncode == -signal.SIGKILL
    left = [p for p in root.iterdir() if p.name.startswith(snapshots.TMP_PREFIX)]
    assert len(left) == 1 and snapshots.runs(root) == [before]  # half a snapshot is never one
    again = snapshots.write(root, "run", {"a@0": torch.ones(4)}, {"a@0": torch.ones(4)}, {"a": {}}, {"command": "y"})
    assert again.name == "run-2" and load_file(str(before / "reference.safetensors"))["a@0"].tolist() == [1.0] * 4
    old = time.time() - 7200
    os.utime(left[0], (old, old))
    snapshots.prune(root, keep=5, max_gb=1.0)  # the killed run's temporary goes once it is stale
    assert not left[0].exists() and snapshots.runs(root) == [before, again]


def test_two_runs_writing_snapshots_at_once_overwrite_nothing(tmp_path):
    root = tmp_path / "snap"
    writers = [_writer(root, "run", 4, stall=False, tag=tag) for tag in ("a", "b")]
    for w in writers:
        w.wait(timeout=120)
        assert w.returncode == 0
    runs = snapshots.runs(root)
    assert sorted(r.name for r in runs) == sorted(["run"] + [f"run-{i}" for i in range(2, 9)])
    by_writer = sorted((json.loads((r / "meta.json").read_text())["writer"],
                        load_file(str(r / "reference.safetensors"))["a@0"][0].item()) for r in runs)
    assert by_writer == [(tag, float(i)) for tag in ("a", "b") for i in range(4)]
    assert not [p for p in root.iterdir() if p.name.startswith(snapshots.TMP_PREFIX)]


def test_a_trend_line_on_a_full_disk_is_said_and_the_report_kept(full_disk, tmp_path):
    from tests.test_stages import _capture, _record
    from vllm_parity.harness import stages

    capture, taps = _capture(tmp_path, fault="layers.1.attn.o")
    record, written = stages.write(_record(capture, taps), capture, tmp_path / "report", str(tmp_path / "snap"),
                                   ["pytest"], keep=5, max_gb=1.0, trend=str(full_disk / "trend.jsonl"))
    assert written.failed and written.report_error is None and written.trend_error.startswith("the disk is full")
    assert (written.report / "report.json").is_file() and written.snapshot is not None
