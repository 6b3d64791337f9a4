"""Golden references: a committed reference dump per fixture, for the nightly gate.

``references/golden/<fixture>/`` is an ordinary dump directory (``manifest.json`` + safetensors,
keys ``T@p``) of the fp32 reference, whose manifest also records the model and prompt-set hashes
and the library versions it was made with. Comparing the candidate against it needs no reference
run. A golden is only ever (re)written through :func:`write_golden`.

Integrity is checked in two steps: :func:`load_golden` checks the manifest, the hashes of the model
and prompt set, and that every tensor file opens and holds its tensors with the recorded shape and
dtype (headers only, cheap); each tensor's sha256 is then checked the first time it is read, so a
comparison of a few taps hashes only those. ``GoldenReader.verify_all()`` checks everything at once.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open

import vllm_parity.reference as reference_pkg
from vllm_parity.harness.dumps import DumpReader, DumpWriter, key, tensor_sha256

GOLDEN_DIR = Path("references") / "golden"
DEFAULT_FIXTURE = "default"
_TMP = ".tmp-"
_OLD = ".old-"


class GoldenError(ValueError):
    """A golden reference that cannot be used: missing, corrupt, or made for other inputs."""


class GoldenMissing(GoldenError):
    pass


class GoldenCorrupt(GoldenError):
    pass


class GoldenMismatch(GoldenError):
    pass


def fixture_name(model_dir: str | Path | None) -> str:
    """``default`` for the embedded default model (no ``--parity-model``, or its cached directory),
    otherwise the model directory's name."""
    if model_dir is None:
        return DEFAULT_FIXTURE
    from vllm_parity.fixtures.default_model import FORMAT, cache_root

    p = Path(model_dir).resolve()
    # the default's cache directory is cache_root()/default-<format>-<recipe hash>; asking
    # default_model_dir() instead would generate the model as a side effect of naming it
    if p.parent == cache_root().resolve() and p.name.startswith(f"default-{FORMAT}-"):
        return DEFAULT_FIXTURE
    return p.name


def golden_path(root: Path, fixture: str, writing: bool = False) -> Path:
    """``root/references/golden/<fixture>``; ``root`` is the repository (pytest's rootdir). To read, a
    golden the root does not hold comes from the installed package (which ships the default's)."""
    if not fixture or fixture in (".", "..") or "/" in fixture or "\\" in fixture or fixture.startswith("."):
        raise ValueError(f"fixture name {fixture!r} cannot name a golden directory: use a plain directory name")
    here = Path(root) / GOLDEN_DIR / fixture
    shipped = Path(reference_pkg.__file__).parent / "golden" / fixture
    if writing or here.exists() or not shipped.exists():
        return here
    return shipped


class GoldenReader(DumpReader):
    """A DumpReader that checks each tensor's sha256 on its first read and records the taps read."""

    def __init__(self, root: str | Path):
        super().__init__(root)
        self._checked: set[str] = set()
        self.read: set[str] = set()

    def get(self, tap: str, prompt: int) -> torch.Tensor:
        entry = self.entry(tap, prompt)
        k = key(tap, prompt)
        try:
            t = super().get(tap, prompt)
        except SafetensorError as exc:
            raise GoldenCorrupt(f"{self.root / entry['file']}: tensor {k} unreadable ({exc})") from None
        if k not in self._checked:
            got = tensor_sha256(t)
            if got != entry["sha256"]:
                raise GoldenCorrupt(
                    f"{self.root / entry['file']}: tensor {k} has sha256 {got[:16]}…, the golden manifest "
                    f"records {entry['sha256'][:16]}…; the golden is corrupt: restore it from version "
                    f"control or regenerate it (--parity-update-golden)")
            self._checked.add(k)
        self.read.add(tap)
        return t

    def steps(self) -> list["GoldenReader"]:
        """The golden's decode steps, each kept inside it (``decode<s>``)."""
        return [GoldenReader(self.root / f"decode{s}")
                for s in range(int(self.manifest.get("decode", {}).get("steps", 0)))]

    def verify_all(self) -> None:
        """Hash every tensor now (raises GoldenCorrupt on the first mismatch); not counted as read."""
        read = set(self.read)
        for tap in self.taps():
            for p in self.prompts(tap):
                self.get(tap, p)
        self.read = read


def load_golden(dest: Path, model_sha256: str, prompts_sha256: str) -> DumpReader:
    """Open the golden at ``dest`` for a run on the model and prompt set with these hashes.

    Raises GoldenMissing (no golden), GoldenCorrupt (unreadable manifest or tensor file, a tensor
    absent or of another shape or dtype; a sha256 mismatch surfaces on first read) or GoldenMismatch
    (made for another model or prompt set). Returns a :class:`GoldenReader`.
    """
    dest = Path(dest)
    if not (dest / "manifest.json").is_file():
        raise GoldenMissing(f"{dest}: no golden reference (no manifest.json); write one with "
                            f"--parity-update-golden")
    try:
        reader = GoldenReader(dest)
    except (OSError, ValueError) as exc:
        raise GoldenCorrupt(f"{dest}: golden manifest unusable: {exc}") from None
    man = reader.manifest
    if not isinstance(man.get("taps"), dict):
        raise GoldenCorrupt(f"{dest / 'manifest.json'}: no 'taps' table; the golden manifest is damaged")
    diffs = []
    if man.get("model_sha256") != model_sha256:
        diffs.append(f"model sha256 {man.get('model_sha256')} (this run's model: {model_sha256})")
    if man.get("prompts_sha256") != prompts_sha256:
        diffs.append(f"prompts sha256 {man.get('prompts_sha256')} (this run's prompts: {prompts_sha256})")
    if diffs:
        raise GoldenMismatch(f"{dest}: golden was made for another input: {'; '.join(diffs)}; regenerate it "
                             f"with --parity-update-golden if the change is intended")
    for r in [reader, *_steps_of(reader, dest)]:
        _check_structure(r)
    return reader


def _steps_of(reader: GoldenReader, dest: Path) -> list[GoldenReader]:
    try:
        return reader.steps()
    except (OSError, ValueError) as exc:
        raise GoldenCorrupt(f"{dest}: a decode step's manifest is unusable: {exc}") from None


def _check_structure(reader: DumpReader) -> None:
    by_file: dict[str, list[tuple[str, dict]]] = {}
    for tap, prompts in reader.manifest["taps"].items():
        for p, entry in prompts.items():
            by_file.setdefault(entry["file"], []).append((key(tap, int(p)), entry))
    for fname, entries in by_file.items():
        path = reader.root / fname
        if not path.is_file():
            raise GoldenCorrupt(f"{path}: missing; the golden manifest lists {len(entries)} tensor(s) in it "
                                f"(first {entries[0][0]})")
        try:
            with safe_open(str(path), framework="pt") as f:
                stored = set(f.keys())
                for k, entry in entries:
                    if k not in stored:
                        raise GoldenCorrupt(f"{path}: tensor {k} listed in the golden manifest is not in the file")
                    sl = f.get_slice(k)
                    shape, dtype = list(sl.get_shape()), _dtype_name(sl.get_dtype())
                    if shape != entry["shape"] or dtype != entry["dtype"]:
                        raise GoldenCorrupt(f"{path}: tensor {k} is {dtype}{shape}, the golden manifest records "
                                            f"{entry['dtype']}{entry['shape']}")
        except SafetensorError as exc:
            raise GoldenCorrupt(f"{path}: not a readable safetensors file ({exc})") from None


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _dtype_name(st: str) -> str:
    return _ST_DTYPES.get(st, st.lower())


def write_golden(src: DumpReader, dest: Path, taps: Iterable[str] | None = None,
                 extras: dict | None = None) -> Path:
    """Copy the reference dump ``src`` (all its taps, or only ``taps``) to ``dest`` and return it, with its
    decode steps (``src.steps()``: the manifest's ``decode`` names them and the tokens they ran) in
    ``dest/decode<s>``.

    ``extras`` (JSON data, e.g. the reference's greedy continuation, which no tap holds) is kept in
    the manifest under ``golden.extras``; :func:`extras_of` reads it back.

    Every source tensor is checked against its manifest sha256 first, so a corrupt dump never
    becomes a golden. The copy is built in a temporary sibling directory and renamed into place;
    an existing golden is moved aside, replaced, then deleted, so a reader sees the old golden or
    the new one whole (or, for an instant, none), never a mixture.
    """
    dest = Path(dest)
    meta = {k: v for k, v in src.manifest.items() if k not in ("schema", "taps", "golden")}
    lacking = [k for k in ("model_sha256", "prompts_sha256") if not meta.get(k)]
    if lacking:
        raise GoldenError(f"{src.root}: dump manifest has no {' or '.join(lacking)}; a golden without them "
                          f"could not be checked against the run that uses it")
    names = src.taps() if taps is None else list(taps)
    absent = [t for t in names if t not in src.manifest["taps"]]
    if absent:
        raise GoldenError(f"{src.root}: no tap(s) {absent[:5]} in this dump; it holds {src.taps()[:5]}…")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f"{_TMP}{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        meta["golden"] = {"written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                          "extras": extras or {}}
        _copy(src, names, DumpWriter(tmp, meta), dest)
        for s, step in enumerate(src.steps()):
            step_meta = {k: v for k, v in step.manifest.items() if k not in ("schema", "taps")}
            _copy(step, [t for t in names if t in step.manifest["taps"]], DumpWriter(tmp / f"decode{s}", step_meta),
                  dest)
        old = None
        if dest.exists():
            old = dest.parent / f"{_OLD}{dest.name}-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(dest, old)
        try:
            os.rename(tmp, dest)
        except OSError:
            if old is not None:
                os.rename(old, dest)  # put the previous golden back
            raise
        if old is not None:
            shutil.rmtree(old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _copy(src: DumpReader, names: list[str], w: DumpWriter, dest: Path) -> None:
    for tap in names:
        tensors = {}
        for p in src.prompts(tap):
            try:
                tensors[key(tap, p)] = src.verify(tap, p)
            except (ValueError, SafetensorError) as exc:
                raise GoldenCorrupt(f"{src.root}: not copied to {dest}: {exc}") from None
        w.write(tap, tensors)
    w.close()


def unused_taps(golden: DumpReader, read: set[str]) -> list[str]:
    """The golden's taps that no comparison read, in the golden's order."""
    return [t for t in golden.taps() if t not in read]


def read_taps(golden: DumpReader) -> set[str]:
    """The taps read so far through a :class:`GoldenReader` (empty for a plain DumpReader)."""
    return set(getattr(golden, "read", set()))


def extras_of(golden: DumpReader) -> dict:
    """The ``extras`` given to :func:`write_golden` ({} if none)."""
    return dict(golden.manifest.get("golden", {}).get("extras") or {})


def describe(golden: DumpReader) -> dict:
    """What a report says about the golden it used: where, when written, with which versions."""
    man = golden.manifest
    return {"path": str(golden.root), "written": man.get("golden", {}).get("written"),
            "model_sha256": man.get("model_sha256"), "prompts_sha256": man.get("prompts_sha256"),
            "versions": man.get("versions", {}), "taps": len(man["taps"])}
