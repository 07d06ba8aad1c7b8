"""Outputs written atomically: into a temp file or folder beside the target, renamed over it only when
complete. A failure (a read-only or missing folder, a full disk, Ctrl-C) removes the temp and leaves the
old target as it was; every OS error becomes one OutputError naming the output."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .errors import OutputError


def _parent(out: Path) -> Path:
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{out}: the folder {parent} does not exist")
    return parent


def _fail(out: Path, e: BaseException) -> OutputError:
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).split("I/O error:")[-1].strip()
    try:  # some writers (numpy's tofile) report a full disk only as a short write
        if shutil.disk_usage(out.parent).free < 1 << 20 and "space" not in reason:
            reason += "; the disk is full"
    except OSError:
        pass
    return OutputError(f"{out}: write failed ({reason}); nothing was written")


def _is_write_error(e: BaseException) -> bool:
    """An OSError, or a library's own wrapper of one (safetensors: SafetensorError "I/O error: ...")."""
    return isinstance(e, OSError) or (type(e).__name__ == "SafetensorError" and "I/O error" in str(e))


def _umask_mode(mode: int) -> int:
    """`mode` as the user's umask would leave it (mkstemp/mkdtemp create 0600/0700)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def _fsync(path: Path, directory: bool = False) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        return  # e.g. a folder that cannot be opened for reading: the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a folder
    finally:
        os.close(fd)


class AtomicFile:
    """`with AtomicFile(out) as tmp:` write `tmp`; on success it is flushed to disk and renamed to `out`."""

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out)

    def __enter__(self) -> Path:
        parent = _parent(self.out)
        if self.out.is_dir():
            raise OutputError(f"{self.out}: is a folder, not a file")
        try:
            fd, name = tempfile.mkstemp(prefix=f".{self.out.name}.tmp-", dir=parent)
        except OSError as e:
            raise OutputError(f"{self.out}: cannot write in {parent} ({e.strerror or e})") from e
        os.close(fd)
        self.tmp = Path(name)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            try:
                os.chmod(self.tmp, _umask_mode(0o666))
                _fsync(self.tmp)
                os.replace(self.tmp, self.out)
            except OSError as e:
                self.tmp.unlink(missing_ok=True)
                raise _fail(self.out, e) from e
            _fsync(self.out.parent, directory=True)
            return False
        self.tmp.unlink(missing_ok=True)
        if _is_write_error(exc):
            raise _fail(self.out, exc) from exc
        return False


class AtomicFolder:
    """`with AtomicFolder(out) as tmp:` fill the folder `tmp`; on success it replaces `out`."""

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out)

    def __enter__(self) -> Path:
        parent = _parent(self.out)
        if self.out.exists() and not self.out.is_dir():
            raise OutputError(f"{self.out}: exists and is not a folder")
        try:
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=parent))
        except OSError as e:
            raise OutputError(f"{self.out}: cannot write in {parent} ({e.strerror or e})") from e
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if _is_write_error(exc):
                raise _fail(self.out, exc) from exc
            return False
        old = None
        try:
            os.chmod(self.tmp, _umask_mode(0o777))
            for f in self.tmp.iterdir():
                os.chmod(f, _umask_mode(0o666))
                _fsync(f)
            if self.out.exists():  # keep the old folder until the new one is in place
                old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-", dir=self.out.parent))
                os.replace(self.out, old / "x")
            os.replace(self.tmp, self.out)
        except OSError as e:
            if old is not None and (old / "x").exists() and not self.out.exists():
                os.replace(old / "x", self.out)
            shutil.rmtree(self.tmp, ignore_errors=True)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            raise _fail(self.out, e) from e
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        _fsync(self.out.parent, directory=True)
        return False


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """A small text output (a JSON record, a chat) written whole or not at all."""
    with AtomicFile(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def check_writable(out: str | os.PathLike) -> None:
    """Fail now, not after minutes of work, when `out` cannot be written: its folder exists and takes a file."""
    out = Path(out)
    parent = _parent(out)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.probe-", dir=parent)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise OutputError(f"{out}: cannot write in {parent} ({e.strerror or e})") from e
