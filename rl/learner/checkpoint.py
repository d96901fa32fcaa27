"""Atomic, pickle-free checkpoints.

A checkpoint is a directory `checkpoints/step-000012/` holding tensors in safetensors files and
everything else in JSON; it is written under a temporary name, every file and the directory are
fsynced, then it is renamed into place and `checkpoints/latest` (a one-line text file, itself
replaced atomically) names it. A directory without its `manifest.json` (written last) or with a
file whose SHA-256 differs from the manifest is never loaded: resuming from it is an error, never
a silent restart from step 0. `prune` keeps only the newest `checkpoint.keep_last` of them.

The learner's tensors inside are written by torch.distributed.checkpoint (rl/learner/state.py)
as safetensors files under `learner/`; the manifest covers them like every other file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


class CheckpointError(RuntimeError):
    """A missing, incomplete or corrupt checkpoint (the message says which and why)."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def write_json(path: Path, data: Any) -> None:
    _write_bytes(path, json.dumps(data, indent=1, sort_keys=True).encode())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def staging_dir(root: Path, step: int) -> Path:
    """A fresh temporary directory to fill; `commit` makes it the checkpoint of `step`."""
    tmp = root / f".tmp-step-{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(root: Path, tmp: Path, step: int) -> Path:
    """Manifest (hashes of every file) last, fsync, rename into place, then point `latest` at it."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {"step": step, "files": {str(p.relative_to(tmp)): _sha256(p) for p in files}}
    write_json(tmp / "manifest.json", manifest)
    for directory in {p.parent for p in files} | {tmp}:
        _fsync_dir(directory)
    final = root / f"step-{step:06d}"
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    latest_tmp = root / ".latest.tmp"
    _write_bytes(latest_tmp, final.name.encode())
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)
    return final


def prune(root: Path, keep_last: int) -> list[str]:
    """After a commit: delete the step directories older than the newest `keep_last` (0: keep
    all), never the one `latest` names. Each is first renamed to `.pruned-...` (atomic), so a
    crash mid-delete leaves nothing that looks like a checkpoint; leftovers go next time.
    Returns the names deleted."""
    if keep_last <= 0:
        return []
    pointer = root / "latest"
    current = pointer.read_text().strip() if pointer.is_file() else None
    steps = sorted(
        (p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()),
        key=lambda p: int(p.name[5:]),
    )
    doomed = [p for p in steps[:-keep_last] if p.name != current]
    for path in doomed:
        os.rename(path, root / f".pruned-{path.name}")
    if doomed:
        _fsync_dir(root)
    for leftover in root.glob(".pruned-step-*"):
        shutil.rmtree(leftover)
    return [p.name for p in doomed]


def latest(root: Path) -> Path:
    """The newest committed checkpoint, verified; CheckpointError if there is none or it is bad."""
    path = latest_named(root)
    verify(path)
    return path


def latest_named(root: Path) -> Path:
    """Where the 'latest' pointer points, not yet verified (a check before anything starts);
    CheckpointError if there is no pointer."""
    pointer = root / "latest"
    if not pointer.is_file():
        raise CheckpointError(f"no checkpoint in {root} (no 'latest' file): cannot resume")
    return root / pointer.read_text().strip()


def verify(path: Path) -> dict:
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} is incomplete (no manifest.json): refusing to load it")
    manifest = json.loads(manifest_path.read_text())
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if _sha256(file) != expected:
            raise CheckpointError(f"{path}: {name} is corrupt (SHA-256 mismatch)")
    return manifest


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def read_jsonl(path: Path) -> list[Any]:
    """The records of a JSON-lines file ([] when it is missing). A last line that a crash (a full
    disk, a SIGKILL) left half-written is left out; any other line that is not JSON raises
    ValueError naming the file and the line."""
    return [record for _, record in _jsonl_lines(path)]


def _jsonl_lines(path: Path) -> list[tuple[str, Any]]:
    """(line, record) for each record line of `path` ([] when missing); see read_jsonl."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):  # torn by the crash that stopped the run
                break
            raise ValueError(f"{path} line {number} is not a JSON record ({exc.msg})") from None
        out.append((line, record))  # (callers check what a record must hold)
    return out


def truncate_jsonl(path: Path, step: int, *, drop: Callable[[dict], bool] | None = None) -> int:
    """Keep the records of a JSON-lines file whose "step" is <= `step` and that `drop` (if
    given) does not match (a torn last line goes too); returns how many went. Rewritten through
    a temporary file, so a crash meanwhile leaves the old file whole; CheckpointError for a
    file that cannot be read."""
    if not path.exists():
        return 0
    try:
        lines = _jsonl_lines(path)
        keep = [
            line
            for line, record in lines
            if record["step"] <= step and not (drop is not None and drop(record))
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot cut {path} back to step {step}: {exc!r}") from None
    written = sum(1 for line in path.read_text(errors="replace").splitlines() if line.strip())
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in keep))
    os.replace(tmp, path)
    return written - len(keep)
