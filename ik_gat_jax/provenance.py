"""Provenance carried by every result JSON and checkpoint (DESIGN section 7)."""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import flax
import jax
import optax

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
  """HEAD of the checkout the code runs from ('+dirty' when it has uncommitted changes)."""
  try:
    sha = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=REPO, capture_output=True, text=True,
                         timeout=10, check=True).stdout.strip()
    dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'], cwd=REPO,
                           capture_output=True, text=True, timeout=10).stdout.strip()
    return sha + ('+dirty' if dirty else '')
  except (OSError, subprocess.SubprocessError):
    return 'unknown'


def cpu_model() -> str:
  try:
    for line in Path('/proc/cpuinfo').read_text().splitlines():
      if line.startswith('model name'):
        return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or 'unknown'


def file_sha256(path: str | os.PathLike) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


def provenance(**extra) -> dict:
  """git commit, versions, backend, devices, CPU model, threads, time; plus `extra` fields."""
  return {
      'git_commit': git_commit(),
      'jax_version': jax.__version__,
      'flax_version': flax.__version__,
      'optax_version': optax.__version__,
      'backend': jax.default_backend(),
      'devices': [str(d) for d in jax.devices()],
      'device_count': jax.device_count(),
      'process_count': jax.process_count(),
      'cpu_model': cpu_model(),
      'cpu_threads': os.cpu_count(),
      'python': platform.python_version(),
      'time_utc': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
      **extra,
  }


def command_line() -> str:
  """The running command as a user would type it (`python -m pkg.mod ...` for our mains)."""
  prog = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
  if prog is not None and prog.suffix == '.py' and REPO in prog.parents:
    module = '.'.join(prog.relative_to(REPO).with_suffix('').parts)
    return ' '.join(['python -m', module] + sys.argv[1:])
  return ' '.join(sys.argv)


def data_provenance(data) -> dict:
  """Which data a run used: shard directory, rig and split hashes, frames per split."""
  s = data.summary
  return {'data_dir': str(Path(data.path).absolute()), 'rig_sha256': s.get('rig_sha256'),
          'split_sha256': s.get('split_sha256'), 'frames': s.get('frames')}
