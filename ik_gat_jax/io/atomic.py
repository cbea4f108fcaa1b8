"""Atomic file writes, the one way every output of the library and the mains is written.

A file is written to a temporary name in its own directory (so the final rename is atomic on
the same file system) and renamed over the target only when complete; on any error the
temporary file is removed and the target is untouched. New files get the usual permissions
(0o666 masked by the umask), not mkstemp's private 0o600.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np


def temp_beside(path: str | os.PathLike, suffix: str = '') -> Path:
  """A new empty file beside `path` named `.NAME.XXXX.tmp{suffix}` (the suffix lets writers
  that look at extensions, like savefig or PIL, see the right one)."""
  path = Path(path)
  fd, tmp = tempfile.mkstemp(dir=path.absolute().parent, prefix=f'.{path.name}.',
                             suffix='.tmp' + suffix)
  os.close(fd)
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(tmp, 0o666 & ~umask)
  return Path(tmp)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = '') -> Iterator[Path]:
  """Yields a temporary path beside `path`; when the block ends without an error it replaces
  `path`, otherwise it is removed."""
  tmp = temp_beside(path, suffix)
  try:
    yield tmp
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> None:
  """UTF-8 text with '\\n' line ends."""
  with atomic_path(path) as tmp, open(tmp, 'w', encoding='utf-8', newline='\n') as f:
    f.write(text)


def write_json(path: str | os.PathLike, obj: Any, **dumps_kw) -> None:
  """`json.dumps(obj, indent=1, **dumps_kw)` (indent overridable) plus a final newline."""
  write_text(path, json.dumps(obj, **{'indent': 1, **dumps_kw}) + '\n')


def write_npz(path: str | os.PathLike, arrays: dict[str, Any]) -> None:
  """`np.savez` of `arrays` (uncompressed, memory-mappable members)."""
  with atomic_path(path) as tmp, open(tmp, 'wb') as f:
    np.savez(f, **arrays)
