"""The dump store: one directory per side, safetensors files plus ``manifest.json``.

The tensor of tap ``T`` for prompt ``p`` is stored under the key ``T@p`` with shape
``(positions, features)``. Tensors are written as they arrive, a group (usually one decoder layer of
one forward) per file, and read back lazily, so memory stays bounded by one group.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SCHEMA = "parity-dump/1"


def tensor_sha256(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def key(tap: str, prompt: int) -> str:
    return f"{tap}@{prompt}"


def step_dir(root: str | Path, step: int) -> Path:
    """Where decode step ``step`` of the dump at ``root`` is kept: a dump of its own beside it, each prompt's
    rows being the one position that step computed, so every comparison reads it as it reads a prefill."""
    root = Path(root)
    return root.parent / f"{root.name}-decode{step}"


def split_key(k: str) -> tuple[str, int]:
    tap, _, p = k.rpartition("@")
    return tap, int(p)


class DumpWriter:
    def __init__(self, root: str | Path, meta: dict[str, Any] | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        if (self.root / "manifest.json").exists():
            raise FileExistsError(f"{self.root}: already holds a dump (manifest.json); use a new directory")
        self.meta = dict(meta or {})
        self.entries: dict[str, dict[str, Any]] = {}
        self._files = 0

    def write(self, group: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write one group of ``{"T@p": tensor}`` to a new file."""
        if not tensors:
            return
        dup = sorted(set(tensors) & set(self.entries))
        if dup:
            raise ValueError(f"{self.root}: {dup[:3]} written twice")
        self._files += 1
        fname = f"{self._files:05d}-{_safe(group)}.safetensors"
        data = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        tmp = self.root / f".{fname}.tmp"
        save_file(data, str(tmp), metadata={"group": group})
        os.replace(tmp, self.root / fname)
        for k, v in data.items():
            self.entries[k] = {"file": fname, "shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch."),
                               "sha256": tensor_sha256(v)}

    def close(self) -> Path:
        taps: dict[str, dict[str, Any]] = {}
        for k, entry in self.entries.items():
            tap, p = split_key(k)
            taps.setdefault(tap, {})[str(p)] = entry
        manifest = {"schema": SCHEMA, **self.meta, "taps": taps}
        tmp = self.root / ".manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, self.root / "manifest.json")
        return self.root


OPEN_FILES = 2  # files a reader keeps open (a layer's taps share one)


class DumpReader:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        path = self.root / "manifest.json"
        try:
            self.manifest = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.root}: no manifest.json — not a dump directory") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: corrupt manifest ({exc})") from None
        if self.manifest.get("schema") != SCHEMA:
            raise ValueError(f"{path}: schema {self.manifest.get('schema')!r}, expected {SCHEMA!r}")
        self._handles: dict[str, Any] = {}

    def taps(self) -> list[str]:
        return list(self.manifest["taps"])

    def prompts(self, tap: str) -> list[int]:
        return sorted(int(p) for p in self.manifest["taps"].get(tap, {}))

    def stacked(self, tap: str, prompts: list[int] | None = None) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Every prompt's rows of one tap, concatenated as ``(rows, features)``, and (prompt, position) per row."""
        parts, rows = [], []
        for p in self.prompts(tap) if prompts is None else prompts:
            t = self.get(tap, p)
            parts.append(t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(-1, 1))
            first = self.first_position(p)
            rows += [(p, first + i) for i in range(t.shape[0])]
        return torch.cat(parts), rows

    def first_position(self, prompt: int) -> int:
        """The position of the prompt's first row: 0, but a decode step's dump starts where that step ran."""
        first = self.manifest.get("first_positions")
        return int(first[prompt]) if first else 0

    def steps(self) -> list[DumpReader]:
        """The dumps of the decode steps this capture ran (its manifest's ``decode``), in order."""
        return [DumpReader(step_dir(self.root, s)) for s in range(int(self.manifest.get("decode", {}).get("steps", 0)))]

    def entry(self, tap: str, prompt: int) -> dict[str, Any]:
        try:
            return self.manifest["taps"][tap][str(prompt)]
        except KeyError:
            raise KeyError(f"{self.root}: no tensor for tap {tap!r}, prompt {prompt}") from None

    def get(self, tap: str, prompt: int) -> torch.Tensor:
        entry = self.entry(tap, prompt)
        handle = self._handles.pop(entry["file"], None)
        if handle is None:
            handle = safe_open(str(self.root / entry["file"]), framework="pt")
            while len(self._handles) >= OPEN_FILES:  # an open file stays mapped: a large dump would all be resident
                self._handles.pop(next(iter(self._handles)))
        self._handles[entry["file"]] = handle  # the most recent last
        return handle.get_tensor(key(tap, prompt))

    def verify(self, tap: str, prompt: int) -> torch.Tensor:
        """``get`` plus a check of the stored sha256."""
        t = self.get(tap, prompt)
        if tensor_sha256(t) != self.entry(tap, prompt)["sha256"]:
            raise ValueError(f"{self.root}: tensor {key(tap, prompt)} does not match its manifest sha256")
        return t


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:80]
