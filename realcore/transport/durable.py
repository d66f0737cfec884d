"""Replace a folder so that a crash at any moment leaves the old one or the new one, never neither.

The recipe (recover checkpoints, HF exports): write the new folder aside, fsync every file and
folder in it, swap it in, fsync the parent, then delete the old one.

The swap: Linux's renameat2(RENAME_EXCHANGE) exchanges the two names in one step (no moment
without `final`). Where the filesystem or libc lacks it (NFS, other systems), rename(2) cannot
replace a non-empty folder, so the old one is first renamed to `aside` and the new one renamed in:
a crash between the two leaves the old checkpoint whole under `aside`, which the reader must look
for (recover.latest does).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _load_renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


_renameat2 = _load_renameat2()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """Every file and folder under `path`, `path` included, on disk."""
    for folder, _, files in os.walk(path, topdown=False):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)


def exchange(a: str, b: str) -> bool:
    """Swap the names `a` and `b` atomically; False where this filesystem or libc cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), a)


def replace_dir(tmp: str, final: str, aside: str) -> None:
    """Make the complete folder `tmp` be `final` (see the module's docstring): fsynced first, the
    old `final` (if any) deleted only once the new one is in place. `aside`: where the old one
    waits while it is swapped out (a name its readers know, in the same folder)."""
    fsync_tree(tmp)
    parent = os.path.dirname(final)
    old = None
    if not os.path.exists(final):
        os.rename(tmp, final)
    elif exchange(tmp, final):
        old = tmp  # `tmp` now names the old folder
    else:
        os.rename(final, aside)
        os.rename(tmp, final)
        old = aside
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
