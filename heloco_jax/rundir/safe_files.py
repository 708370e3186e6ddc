"""Files a run writes, never through a symbolic link (docs/DESIGN.md, "What a workdir trusts").

A workdir, a plot's ``--out`` or a corpus's ``--out`` may sit on a shared file
system where others can write. A symlink placed where a run's file belongs
(``metrics.jsonl`` → someone's file) must not make the run append to,
truncate or replace that file. So every file is opened with ``O_NOFOLLOW``,
whole files are written to a temporary file made in the same directory
(``mkstemp``, then given the umask's mode, as every file the run writes) and renamed over
the name (a rename replaces a link, never its
target), and a link where a file or a directory of the run belongs is refused
in one line naming it.
"""

from __future__ import annotations

import errno
import os
import tempfile
from typing import IO, Any, Callable, Union


class LinkError(ValueError):
  """A symbolic link sits where a run writes a file or a directory."""


def _refusal(path: str) -> LinkError:
  return LinkError(f"{path} is a symbolic link; allowed: a regular file or directory, or "
                   "none (a run never writes through a link, which could change a file "
                   "outside its directory): remove the link")


def refuse_link(path: str) -> None:
  """Raises ``LinkError`` if ``path`` is a symbolic link."""
  if os.path.islink(path):
    raise _refusal(path)


def refuse_links_below(directory: str) -> None:
  """Raises ``LinkError`` if ``directory`` or anything below it is a symbolic link."""
  refuse_link(directory)
  for root, dirs, files in os.walk(directory, followlinks=False):
    for name in dirs + files:
      refuse_link(os.path.join(root, name))


def make_dirs(directory: str) -> None:
  """``os.makedirs(directory, exist_ok=True)``; a link in its place is refused (before and
  after, so that a link swapped in meanwhile is caught)."""
  refuse_link(directory)
  os.makedirs(directory, exist_ok=True)
  refuse_link(directory)


def open_fd(path: str, flags: int, mode: int = 0o644, follow_links: bool = False) -> int:
  """``os.open`` with ``O_NOFOLLOW`` (unless ``follow_links``): a link at ``path`` is a
  ``LinkError``."""
  nofollow = 0 if follow_links else os.O_NOFOLLOW
  try:
    return os.open(path, flags | nofollow | getattr(os, "O_CLOEXEC", 0), mode)
  except OSError as error:
    if error.errno == errno.ELOOP:
      raise _refusal(path) from None
    raise


def open_append(path: str) -> IO[str]:
  """``path`` for appending text (created if missing), never through a link."""
  return os.fdopen(open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a")


def truncate(path: str, size: int) -> None:
  """Cuts ``path`` (created if missing) to ``size`` bytes, never through a link."""
  fd = open_fd(path, os.O_WRONLY | os.O_CREAT)
  try:
    os.ftruncate(fd, size)
  finally:
    os.close(fd)


def _replace_with(path: str, write: Callable[[IO[bytes]], None]) -> None:
  """Writes a temporary file beside ``path`` with ``write`` and renames it over ``path``.

  A reader sees the old file or the new one, never half of one; a link at
  ``path`` is refused (and a rename would replace the link, not its target).
  """
  refuse_link(path)
  fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path) or ".",
                                   prefix=f".{os.path.basename(path)}.", suffix=".tmp")
  try:
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 → what open() gives: the umask's mode
    with os.fdopen(fd, "wb") as f:
      write(f)
    os.replace(temporary, path)
  except BaseException:
    if os.path.exists(temporary):
      os.unlink(temporary)
    raise


def _umask() -> int:
  """The process's umask (read by setting it and setting it back)."""
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def write_atomic(path: str, data: Union[str, bytes]) -> None:
  """``data`` as the new content of ``path``, all at once (``_replace_with``)."""
  _replace_with(path, lambda f: f.write(data.encode() if isinstance(data, str) else data))


def save_figure(figure: Any, path: str, **kwargs: Any) -> None:
  """``figure.savefig`` to ``path`` as PNG, all at once (``_replace_with``)."""
  _replace_with(path, lambda f: figure.savefig(f, format="png", **kwargs))
