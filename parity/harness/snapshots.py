"""Snapshots of failing taps: both sides' tensors, the diff summary, the metadata, the command.

One new directory per run under the snapshot root, written into a temporary directory first and
renamed into place, so a snapshot is either whole or absent; nothing is ever overwritten. Retention
keeps the newest ``keep`` runs and at most ``max_gb`` in all, never removing the one just written.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

TMP_PREFIX = ".tmp-"


class SnapshotError(OSError):
    def __str__(self) -> str:  # the sentence alone, without OSError's "[Errno 28]"
        return self.strerror or super().__str__()


def write(root: str | Path, run_id: str, reference: dict[str, torch.Tensor], candidate: dict[str, torch.Tensor],
          diff: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write one snapshot directory ``root/run_id`` (``run_id-2`` … if taken) and return it."""
    root = Path(root)
    tmp = root / f"{TMP_PREFIX}{run_id}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        _save(reference, tmp / "reference.safetensors")
        _save(candidate, tmp / "candidate.safetensors")
        (tmp / "diff.json").write_text(json.dumps(diff, indent=1, allow_nan=False) + "\n")
        (tmp / "meta.json").write_text(json.dumps({**meta, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
                                                  indent=1) + "\n")
        final = root / run_id
        n = 1
        while True:
            try:
                os.rename(tmp, final)  # fails on an existing non-empty directory: never overwrite
                return final
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                n += 1
                final = root / f"{run_id}-{n}"
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        why = "the disk is full" if exc.errno == errno.ENOSPC else str(exc)
        raise SnapshotError(exc.errno, f"snapshot {run_id} not written under {root}: {why}; "
                                       f"no earlier snapshot was touched") from exc


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    except SafetensorError as exc:  # not an OSError: its message is all that carries the OS's errno
        found = re.search(r"os error (\d+)", str(exc))
        raise OSError(int(found.group(1)) if found else errno.EIO, f"{path.name}: {exc}") from exc


def runs(root: str | Path) -> list[Path]:
    """Snapshot directories, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(TMP_PREFIX)
            and (d / "meta.json").is_file()]
    return sorted(dirs, key=lambda d: ((d / "meta.json").stat().st_mtime, d.name))


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def prune(root: str | Path, keep: int, max_gb: float, protect: Path | None = None) -> list[Path]:
    """Remove the oldest snapshots beyond ``keep`` runs or ``max_gb``; return what was removed."""
    existing = runs(root)
    removed = []
    candidates = [d for d in existing if protect is None or d.resolve() != Path(protect).resolve()]
    while candidates and len(existing) - len(removed) > max(keep, 1):
        removed.append(candidates.pop(0))
    total = sum(size_of(d) for d in existing if d not in removed)
    while candidates and total > max_gb * 2**30:
        d = candidates.pop(0)
        total -= size_of(d)
        removed.append(d)
    for d in removed:
        shutil.rmtree(d)
    for stale in Path(root).glob(f"{TMP_PREFIX}*") if Path(root).is_dir() else []:
        if time.time() - stale.stat().st_mtime > 3600:  # left by a killed run
            shutil.rmtree(stale, ignore_errors=True)
    return removed
