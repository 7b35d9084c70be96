"""Writing output directories without ever losing a user's files.

One home for what every jaxkv writer of a directory needs (`jaxkv convert`, the VAE / text-encoder converters,
`jaxkv generate`'s output, `wan.save`):

* `atomic_directory(path)`: the directory is built in a hidden temporary sibling ``.NAME.tmp-XXXXXXXX`` and renamed
  onto ``path`` only when complete; an exception, Ctrl-C, SIGTERM or SIGHUP removes it. Directories get the
  user's umask (not ``mkdtemp``'s 0700).
* After a SIGKILL (or a power cut) nothing can clean up at once; the temporary directory holds a marker file
  naming the process that wrote it, and the next `atomic_directory` for the same ``path`` removes such leftovers
  once that process is gone (`remove_stale`), and says so.
* `check_destination(dst, sources=..., force=..., replaceable=...)`: refuses a destination that is, contains or
  lies inside a source, the current directory, or an existing path that the caller's `replaceable` test (usually
  `directory_problem` with the caller's own file names) does not recognise as one of its own outputs.
* `signals_as_exceptions()` (`jaxkv.signals`, re-exported here): SIGTERM / SIGHUP raise `Terminated` (like SIGINT
  raises KeyboardInterrupt), so ``finally`` blocks run and a command can exit 143 / 129 with one line instead of
  leaving debris.
* `DirectoryLock`: a directory written in place by a long run (``jaxkv generate --out``) is *live* while its
  writer holds an exclusive ``fcntl.flock`` on its `LOCK` file; another writer refuses it (`live_writer`), and
  the holder notices (`DirectoryLock.check`) when the directory was moved, deleted or replaced under it.
* `write_file(path, data)`: one file written under ``PATH.tmp`` and renamed; a failure (disk full, file-size
  limit) removes the temporary and raises `WriteError` naming the file and the cause.

The destination rules live in `jaxkv.destination` and the live-directory lock in `jaxkv.dirlock`; both are
re-exported here, the one place writers import them from.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import socket
import time
from typing import Callable, Collection, Iterator

from jaxkv.destination import DestinationError as DestinationError  # re-exported, as jaxkv.files.X
from jaxkv.destination import check_destination as check_destination  # re-exported, as jaxkv.files.X
from jaxkv.destination import directory_problem, replace_problem
from jaxkv.dirlock import LOCK as LOCK  # re-exported, as jaxkv.files.X
from jaxkv.dirlock import DirectoryLock as DirectoryLock  # re-exported, as jaxkv.files.X
from jaxkv.dirlock import DirectoryLost as DirectoryLost  # re-exported, as jaxkv.files.X
from jaxkv.dirlock import LockedError as LockedError  # re-exported, as jaxkv.files.X
from jaxkv.dirlock import live_writer as live_writer  # re-exported, as jaxkv.files.X
from jaxkv.signals import Terminated as Terminated  # re-exported: callers read it as jaxkv.files.Terminated
from jaxkv.signals import _deferred_signals, check_signals
from jaxkv.signals import keeping_lost_signals as keeping_lost_signals  # re-exported, as jaxkv.files.X
from jaxkv.signals import raise_stop as raise_stop  # re-exported, as jaxkv.files.X
from jaxkv.signals import signals_as_exceptions as signals_as_exceptions  # re-exported, as jaxkv.files.X

MARKER = ".jaxkv-partial"  # inside every temporary directory while it is written: {"pid", "start", "host", ...}
_NEW, _OLD = "new", "old"  # the directory being built / the replaced one, both inside the marked temporary dir


# ------------------------------------------------------------------------------------------------ single files

_SPACE_ERRNOS = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}


class WriteError(OSError):
    """Writing a file failed; the message names the file and the cause (``errno`` is the underlying one)."""


def write_error(path: str, error: BaseException) -> WriteError:
    """A `WriteError` for ``error`` (an OSError) raised while writing ``path``: "writing PATH failed: CAUSE", with
    "(disk full or file-size limit)" for the errors that mean it (ENOSPC, EFBIG, EDQUOT)."""
    if isinstance(error, WriteError):
        return error
    code = getattr(error, "errno", None)
    cause = getattr(error, "strerror", None) or str(error) or type(error).__name__
    hint = " (disk full or file-size limit)" if code in _SPACE_ERRNOS else ""
    result = WriteError(f"writing {path} failed: {cause}{hint}")
    result.errno = code
    return result


def write_file(path: str, data: bytes | str) -> None:
    """Writes ``data`` to ``path`` atomically (``PATH.tmp``, then a rename: a reader sees the old or the new file).
    On failure the temporary is removed and `WriteError` names ``path`` and the cause."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise write_error(path, e) from e


# ------------------------------------------------------------------------------------------------ temporaries


def _prefix(path: str) -> str:
    return f".{os.path.basename(path)}.tmp-"


def _process_start(pid: int) -> str | None:
    """The kernel's start time of process ``pid`` (Linux; tells a live writer from a reused pid), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _writer_alive(info: dict) -> bool:
    if info.get("host") != socket.gethostname():
        return True  # another machine's writer (a shared disk): cannot tell, keep it
    pid = info.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    start = info.get("start")
    return start is None or _process_start(pid) in (None, start)


_UNREADABLE_MARKER_AGE_S = 60.0


def remove_stale(path: str) -> list[str]:
    """Removes the temporary directories an interrupted (killed) `atomic_directory` for ``path`` left beside it.

    Only directories named ``.NAME.tmp-*`` holding our marker whose writing process no longer runs on this host are
    touched. If one holds the previous ``path`` (killed between the two renames of a replacement) and ``path`` is
    gone, that previous directory is moved back to ``path`` first. Returns one sentence per action taken.
    """
    path = os.path.abspath(path)
    parent, prefix = os.path.dirname(path), _prefix(path)
    done = []
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return done
    for name in names:
        tmp = os.path.join(parent, name)
        if not name.startswith(prefix) or os.path.islink(tmp) or not os.path.isdir(tmp):
            continue
        marker = os.path.join(tmp, MARKER)
        try:
            with open(marker) as f:
                info = json.load(f)
            if not isinstance(info, dict):
                continue
        except ValueError:
            # our marker by name but unreadable (a write cut short by a kill, before markers were written
            # atomically): stale once older than any live writer needs to finish writing it
            try:
                if time.time() - os.path.getmtime(marker) < _UNREADABLE_MARKER_AGE_S:
                    continue
            except OSError:
                continue
            info = {}
        except OSError:
            continue  # not recognisably ours: leave it
        if info and _writer_alive(info):
            continue
        old = os.path.join(tmp, _OLD)
        if os.path.isdir(old) and not os.path.lexists(path):
            os.rename(old, path)
            done.append(f"restored {path} from {tmp} (a replacement was interrupted)")
        shutil.rmtree(tmp)
        done.append(f"removed {tmp}, left by an interrupted write (pid {info.get('pid')})")
    return done


def _mkdir_unique(parent: str, prefix: str) -> str:
    for _ in range(100):
        candidate = os.path.join(parent, prefix + secrets.token_hex(4))
        try:
            os.mkdir(candidate, 0o777)  # the umask applies, as for any other tool's output
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a temporary directory {prefix}* in {parent}")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(
    path: str, *, replace: Callable[[str], str | None] | None = None, log: Callable[[str], None] | None = None
) -> Iterator[str]:
    """Yields an empty directory to fill; on normal exit it becomes ``path``, on any exception it is removed.

    ``path`` must not exist, unless ``replace`` is given: then an existing ``path`` is replaced (only after the new
    directory is complete) if it is empty or ``replace(path)`` returns None, and DestinationError with its reason
    is raised before anything is created otherwise. SIGTERM / SIGHUP at their default disposition raise `Terminated`
    while
    the block runs, so they clean up as Ctrl-C does. Stale temporaries of ``path`` left by killed writers are
    removed first, each action reported through ``log``. The yielded directory lies inside a hidden
    ``.NAME.tmp-*`` sibling that holds a `MARKER`; directories are created with the user's umask.
    """
    path = os.path.abspath(path)
    for message in remove_stale(path):
        if log is not None:
            log(message)
    if os.path.lexists(path):
        if replace is None:
            raise FileExistsError(f"{path} already exists")
        problem = replace_problem(path, replace)
        if problem is not None:
            raise DestinationError(f"refusing to replace {path}: {problem}")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    with signals_as_exceptions():
        tmp = None
        try:
            with _deferred_signals():  # the marker must exist as soon as the directory does
                tmp = _mkdir_unique(parent, _prefix(path))
                marker = os.path.join(tmp, MARKER)
                with open(marker + ".partial", "w") as f:
                    json.dump(
                        {
                            "pid": os.getpid(),
                            "start": _process_start(os.getpid()),
                            "host": socket.gethostname(),
                            "created": time.time(),
                            "target": path,
                        },
                        f,
                    )
                os.replace(marker + ".partial", marker)  # a kill never leaves a partial marker under its name
                new = os.path.join(tmp, _NEW)
                os.mkdir(new, 0o777)
            yield new
            check_signals()  # a stop signal whose exception was lost: never rename an interrupted write into place
            _fsync_dir(new)
            with _deferred_signals():
                if os.path.lexists(path):
                    # rename cannot replace a non-empty directory: move the old one into our marked directory
                    # first, so that even a SIGKILL between the two renames leaves something remove_stale repairs.
                    os.rename(path, os.path.join(tmp, _OLD))
                os.rename(new, path)
                _fsync_dir(parent)
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            if tmp is not None:
                with _deferred_signals():
                    old = os.path.join(tmp, _OLD)
                    if os.path.isdir(old) and not os.path.lexists(path):
                        os.rename(old, path)  # the replacement failed half way: put the previous one back
                    shutil.rmtree(tmp, ignore_errors=True)
            raise


def atomic_checkpoint_directory(
    path: str,
    *,
    force: bool,
    formats: Collection[str],
    required: Collection[str] = ("config.json", "params.safetensors"),
    optional: Collection[str] = (),
    log: Callable[[str], None] | None = None,
):
    """`atomic_directory` for a jaxkv checkpoint directory: with ``force`` an existing ``path`` is replaced only if
    it is a checkpoint of one of ``formats`` (``config.json`` marker) holding ``required`` and nothing beyond
    ``optional`` (see `directory_problem`); without ``force`` an existing ``path`` is an error."""

    def ours(p: str) -> str | None:
        return directory_problem(p, required=required, optional=optional, formats=formats)

    return atomic_directory(path, replace=ours if force else None, log=log)
