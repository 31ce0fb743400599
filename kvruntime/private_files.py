"""Files that hold a secret or a tenant's data: created mode 0600 in a directory of mode 0700.

What uses it: the SQLite state store (its file; SQLite gives the ``-wal`` / ``-shm`` files the
database file's own mode), the API key file, the ``fs://`` KV tier's directory and the
calibration runs. A directory or file that already exists with a looser mode is not changed
(it may be shared on purpose) but warned about once per path, naming the path, its mode and the
``chmod`` that fixes it (:func:`looser_than_private` says the same for a check at start).
"""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

DIR_MODE, FILE_MODE = 0o700, 0o600
_warned: set[str] = set()


def looser_than_private(path: str | Path) -> str | None:
    """One line when ``path`` (a file or directory) grants its group or others any access, else
    None (also when it does not exist, and for a sticky shared directory such as ``/tmp``, mode
    1777: shared by design, the 0600 files in it stay unreadable to others and undeletable by them)."""
    p = Path(path).expanduser()
    try:
        mode = stat.S_IMODE(p.stat().st_mode)
    except OSError:
        return None
    if mode & 0o077 == 0 or (p.is_dir() and mode & stat.S_ISVTX):
        return None
    want = DIR_MODE if p.is_dir() else FILE_MODE
    return (f"{p} is mode {mode:04o}: it holds secrets or tenant data that other users of this machine can read; "
            f"`chmod {want:o} {p}`")


def _warn_if_loose(path: Path) -> None:
    why = looser_than_private(path)
    if why is not None and str(path) not in _warned:
        _warned.add(str(path))
        log.warning("%s", why)


def private_dir(path: str | Path) -> Path:
    """``path`` as a directory: created (with its missing parents) mode 0700; an existing one
    with a looser mode is kept and warned about."""
    p = Path(path).expanduser()
    if not p.is_dir():
        p.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        os.chmod(p, DIR_MODE)               # mkdir's mode is masked by the umask
    _warn_if_loose(p)
    return p


def private_file(path: str | Path) -> Path:
    """``path`` as a file: created empty mode 0600 (its directory by :func:`private_dir`) when
    missing, never truncated; an existing one with a looser mode is kept and warned about."""
    p = Path(path).expanduser()
    private_dir(p.parent)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        _warn_if_loose(p)
        return p
    os.fchmod(fd, FILE_MODE)
    os.close(fd)
    return p


def write_private(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically, mode 0600 in a 0700 directory (a temporary file
    beside it, renamed over it)."""
    p = Path(path).expanduser()
    private_dir(p.parent)
    tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), FILE_MODE)
        f.write(text)
    os.replace(tmp, p)
    return p
