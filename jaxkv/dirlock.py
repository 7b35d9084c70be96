"""Live directories: a directory written in place by a long run (``jaxkv generate --out``) is *live* while its
writer holds an exclusive ``fcntl.flock`` on its `LOCK` file. Another writer refuses it (`live_writer`, `LockedError`),
and the holder notices (`DirectoryLock.check`, `DirectoryLost`) when the directory was moved, deleted or replaced
under it. Re-exported by `jaxkv.files`, where callers read these names.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket

from jaxkv.destination import DestinationError

LOCK = ".jaxkv-lock"  # inside a directory written in place; flock-ed by its writer, holds {"pid", "host"}


class LockedError(DestinationError):
    """The directory is being written by another running process (it holds the directory's `LOCK`)."""


class DirectoryLost(OSError):
    """The directory a run was writing was moved, deleted or replaced by someone else while it ran (the message
    says which)."""


def _read_lock_info(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe_writer(info: dict) -> str:
    pid, host = info.get("pid"), info.get("host")
    if not isinstance(pid, int):
        return "a running process"
    return f"a running process (pid {pid}" + (f" on {host}" if host and host != socket.gethostname() else "") + ")"


def live_writer(path: str) -> str | None:
    """Who is writing directory ``path`` now ("a running process (pid N)"), or None when no process holds its
    `LOCK` (no lock file, or one left by a finished or killed writer). Touches nothing."""
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return _describe_writer(_read_lock_info(fd))
            return None  # a file system without flock: cannot tell
        return None
    finally:
        os.close(fd)  # also drops the probe's shared lock


class DirectoryLock:
    """An exclusive ``flock`` on ``path/LOCK`` held for as long as this process writes the directory ``path``.

    `acquire` creates the lock file (recording this process's pid) and locks it, or raises `LockedError` naming
    the holder. The directory's identity (device, inode) is recorded: `check` raises `DirectoryLost` once
    ``path`` no longer is that directory or its lock file was removed (someone moved, deleted or replaced it).
    `release` removes the lock file (only while it is still ours) and unlocks; a process that dies unlocks too,
    leaving a lock file that no one holds (not live).
    """

    def __init__(self, path: str, fd: int, identity: tuple[int, int], lock_identity: tuple[int, int]):
        self.path, self._fd, self._identity, self._lock_identity = path, fd, identity, lock_identity

    @classmethod
    def acquire(cls, path: str) -> "DirectoryLock":
        path = os.path.abspath(path)
        lock_path = os.path.join(path, LOCK)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    raise LockedError(f"{path} is being written by {_describe_writer(_read_lock_info(fd))}") from None
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                # a file system without flock: the lock file still records the writer, unenforced
            info = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, info, 0)
            st, dst = os.fstat(fd), os.stat(path)
            return cls(path, fd, (dst.st_dev, dst.st_ino), (st.st_dev, st.st_ino))
        except BaseException:
            os.close(fd)
            raise

    def problem(self) -> str | None:
        """Why ``path`` is no longer the directory this lock was taken on, or None while it is."""
        if self._fd is None:
            return f"the lock on {self.path} was released"
        try:
            st = os.stat(self.path)
        except OSError:
            return f"{self.path} vanished while this run was writing it (moved or deleted by another process)"
        if (st.st_dev, st.st_ino) != self._identity:
            return f"{self.path} was replaced by another directory while this run was writing it"
        try:
            lock = os.stat(os.path.join(self.path, LOCK), follow_symlinks=False)
        except OSError:
            return f"{os.path.join(self.path, LOCK)} was removed while this run was writing {self.path}"
        if (lock.st_dev, lock.st_ino) != self._lock_identity:
            return f"{os.path.join(self.path, LOCK)} was replaced while this run was writing {self.path}"
        return None

    def check(self) -> None:
        """Raises `DirectoryLost` unless ``path`` is still the directory this lock was taken on."""
        problem = self.problem()
        if problem is not None:
            raise DirectoryLost(problem)

    def release(self) -> None:
        """Removes the lock file if it is still ours and unlocks. Idempotent."""
        if self._fd is None:
            return
        try:
            if self.problem() is None:
                os.remove(os.path.join(self.path, LOCK))
        except OSError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
