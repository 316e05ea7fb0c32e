"""Coordinator checkpoints: atomic, verified, written in the background.

Each checkpoint is `ckpt-VERSION.safetensors` plus `ckpt-VERSION.json` (metadata and the
SHA-256 of the tensor file). Both are written to a temporary name, fsynced and renamed;
the JSON goes last, so a checkpoint exists only once it is whole. Saving hands a shallow
copy of the state to a writer thread: the coordinator replaces tensors when it changes
them and never mutates them in place, so unchanged tensors are shared, not copied (lazy
copy). If saves arrive faster than the disk takes them, only the newest waits. A failed
write is not lost in the thread: the next save or flush raises it as a CheckpointError.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from fedrl.failpoints import failpoint


def _fsync_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    failpoint("checkpoint-write")
    os.replace(tmp, path)


def remove_leftovers(directory: Path) -> None:
    """What a write killed midway leaves: temporary files, and tensor files whose manifest
    (written last) never came. Run before the writer starts, so nothing is being written."""
    for tmp in directory.glob("ckpt-*.tmp"):
        tmp.unlink(missing_ok=True)
    for tensors in directory.glob("ckpt-*.safetensors"):
        if not tensors.with_suffix(".json").exists():
            tensors.unlink(missing_ok=True)


class CheckpointError(OSError):
    """A checkpoint could not be written; the run should stop and say why."""


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 3, on_saved: Callable[[int], None] | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        remove_leftovers(self.directory)
        self.keep, self.on_saved = keep, on_saved  # on_saved(version) runs in the writer thread
        self._pending: tuple | None = None
        self._cond = threading.Condition()
        self._busy = False
        self.saved_versions: list[int] = []
        self._error: CheckpointError | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="checkpointer", daemon=True)
        self._thread.start()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def save_async(self, version: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        with self._cond:
            self._raise_error()
            self._pending = (version, dict(tensors), json.loads(json.dumps(meta)))
            self._cond.notify()

    def flush(self, timeout: float = 60.0) -> None:
        if not self.settled(timeout):
            with self._cond:
                self._raise_error()
            raise CheckpointError(f"checkpoint writes to {self.directory} still busy after {timeout} s")

    def settled(self, timeout: float = 60.0) -> bool:
        """Whether every write queued so far is on disk, once it is (False at `timeout`, or after a
        failure, which the next save_async or flush raises)."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)
            return done and self._error is None

    def close(self) -> None:
        """Stop the writer thread once queued work is done (or failed); does not raise."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                job, self._pending, self._busy = self._pending, None, True
            try:
                self.write(*job)
                if self.on_saved is not None:
                    self.on_saved(job[0])
            except Exception as err:  # kept for the caller: the next save or flush raises it
                with self._cond:
                    self._error = CheckpointError(
                        f"checkpoint of version {job[0]} to {self.directory} failed: {err}"
                    )
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def write(self, version: int, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
        stem = self.directory / f"ckpt-{version:08d}"
        tensor_path = stem.with_suffix(".safetensors")
        data = save({k: v.contiguous() for k, v in tensors.items()})
        _fsync_write(tensor_path, data)
        digest = hashlib.sha256(data).hexdigest()
        _fsync_write(
            stem.with_suffix(".json"),
            json.dumps({"version": version, "sha256": digest, "meta": meta}).encode(),
        )
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self.saved_versions.append(version)
        for old in sorted(self.directory.glob("ckpt-*.json"))[: -self.keep]:
            old.unlink(missing_ok=True)
            old.with_suffix(".safetensors").unlink(missing_ok=True)
        return tensor_path


def load_checkpoints(
    directory: str | Path, skipped: list[str] | None = None
) -> Iterator[tuple[int, dict[str, torch.Tensor], dict]]:
    """Every checkpoint whose tensor file matches its recorded hash, newest first; each one that
    does not, or cannot be read, is passed over and named, with why, in `skipped`."""
    directory = Path(directory)
    for manifest in sorted(directory.glob("ckpt-*.json"), reverse=True):
        try:
            record = json.loads(manifest.read_text())
            tensor_path = manifest.with_suffix(".safetensors")
            if hashlib.sha256(tensor_path.read_bytes()).hexdigest() != record["sha256"]:
                raise ValueError(f"{tensor_path.name} does not match the SHA-256 its manifest records")
            yield int(record["version"]), load_file(str(tensor_path)), record["meta"]
        except (OSError, ValueError, KeyError) as err:
            if skipped is not None:
                skipped.append(
                    f"{manifest.name}: "
                    + (f"its manifest lacks {err}" if isinstance(err, KeyError) else str(err))
                )


def load_latest(directory: str | Path) -> tuple[int, dict[str, torch.Tensor], dict] | None:
    """The newest verified checkpoint, or None."""
    return next(load_checkpoints(directory), None)
