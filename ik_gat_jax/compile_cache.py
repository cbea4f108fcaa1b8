"""The command line's persistent caches: a second run of a command skips compiling and orbax.

`enable()` is called by the command-line entry points only (`python -m ik_gat_jax.solve`,
`ik-gat`), before their first compilation; importing the library never calls it, so a program
that uses `IKSolver` keeps JAX's own settings. It

- does nothing when `IK_GAT_NO_COMPILE_CACHE` is 1 (or true / yes / on): no default cache
  (JAX's own settings, such as `JAX_COMPILATION_CACHE_DIR`, still apply);
- leaves a cache directory set by the user alone (`JAX_COMPILATION_CACHE_DIR`, or
  `jax.config.update('jax_compilation_cache_dir', ...)` before the call);
- otherwise points JAX's persistent cache at `$XDG_CACHE_HOME/ik_gat_jax/jax` (default
  `~/.cache/ik_gat_jax/jax`) and, unless `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` is set,
  caches every compilation (`MIN_COMPILE_SECS` = 0). Delete the folder to clear it; JAX
  keys entries by the program, JAX version, backend and flags, so stale ones are never used;
- and turns on the parameter cache, `$XDG_CACHE_HOME/ik_gat_jax/params` (`params_dir()`): a
  restored checkpoint as one npz named by the hash of the checkpoint's files, which the next
  run loads with numpy instead of importing and running orbax (checkpointing.py). It follows
  `IK_GAT_NO_COMPILE_CACHE` and XDG_CACHE_HOME, not a user's JAX cache directory.

Concurrent runs. JAX 0.10.2's file cache (`jax._src.lru_cache.LRUCache`, no size limit) writes
an entry with `Path.write_bytes` in place: a run reading while another writes can see half an
entry, and two runs writing one key can interleave. So `enable()` installs `_AtomicFileCache`,
the same cache whose `put` writes a temp file beside the entry and renames it over the name
(`io.atomic`): a reader sees no entry or a whole one; concurrent writers of one key each rename
a whole file. Reads are JAX's own. Where JAX's internals differ (another JAX version) it falls
back to JAX's own cache and says so in `status()`; a bad entry is then only a warning and a
recompile (JAX catches read errors).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import platform
import re
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax.experimental import serialize_executable

from ik_gat_jax.io import atomic

ENV_OFF = 'IK_GAT_NO_COMPILE_CACHE'
# Cache every compilation: a solve writes about 50 entries (0.4 MB, mostly small eager ops that
# would otherwise be recompiled every run), and with a threshold a compilation near it would be
# cached in one run and not in the next.
MIN_COMPILE_SECS = 0.0
_TRUE = ('1', 'true', 'yes', 'on')

_status: dict = {'enabled': False, 'reason': 'enable() not called'}
_params_dir: Path | None = None
_executables_dir: Path | None = None
_fingerprint: str | None = None
EXECUTABLE_FORMAT = 1  # bump when an entry's layout changes


def default_dir(environ: Mapping[str, str] = os.environ) -> Path:
  """`$XDG_CACHE_HOME/ik_gat_jax/jax`, else `~/.cache/ik_gat_jax/jax`."""
  base = environ.get('XDG_CACHE_HOME') or ''
  root = Path(base) if os.path.isabs(base) else Path(environ.get('HOME') or Path.home()) / '.cache'
  return root / 'ik_gat_jax' / 'jax'


def disabled(environ: Mapping[str, str] = os.environ) -> bool:
  return environ.get(ENV_OFF, '').strip().lower() in _TRUE


def enable(environ: Mapping[str, str] = os.environ) -> Path | None:
  """Turns the persistent compilation cache on for this process (see the module docstring).

  Returns the cache directory in effect (the user's own, or the default), None when off.
  """
  global _status, _params_dir, _executables_dir
  if disabled(environ):
    _status = {'enabled': False, 'reason': f'{ENV_OFF}={environ.get(ENV_OFF)}'}
    _params_dir = _executables_dir = None
    return None
  _params_dir = default_dir(environ).parent / 'params'
  _executables_dir = default_dir(environ).parent / 'executables'
  own = jax.config.jax_compilation_cache_dir
  if own:
    _status = {'enabled': True, 'dir': str(own), 'source': 'user', 'atomic_writes': False}
    return Path(own)
  path = default_dir(environ)
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:  # a read-only home: run without the cache
    _status = {'enabled': False, 'reason': f'cannot create {path}: {e}'}
    return None
  if 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS' not in environ:
    jax.config.update('jax_persistent_cache_min_compile_time_secs', MIN_COMPILE_SECS)
  jax.config.update('jax_compilation_cache_dir', str(path))
  _status = {'enabled': True, 'dir': str(path), 'source': 'default',
             'atomic_writes': _install_atomic_cache(path)}
  return path


def params_dir() -> Path | None:
  """The parameter cache's folder once `enable()` turned it on (created on first write), else
  None: library use restores checkpoints with orbax alone."""
  return _params_dir


def executables_dir() -> Path | None:
  """The executable cache's folder once `enable()` turned it on (created on first write), else
  None: library use compiles (through JAX's own cache, if the program set one)."""
  return _executables_dir


def _cpu_description() -> str:
  """The CPU's model and feature flags (Linux: the first processor of /proc/cpuinfo)."""
  try:
    text = Path('/proc/cpuinfo').read_text(errors='replace')
  except OSError:  # not Linux: the little the standard library says
    return f'{platform.machine()} {platform.processor()}'
  keep = ('model name', 'flags', 'vendor_id', 'cpu family', 'model', 'Features', 'CPU part')
  first = text.split('\n\n')[0]
  return '\n'.join(line for line in first.splitlines() if line.split(':')[0].strip() in keep)


def environment_fingerprint() -> str:
  """SHA-256 (hex) of everything besides the caller's own description that a compiled
  executable depends on (module docstring). The package source, versions, devices and CPU are
  read once per process; JAX's configuration and `XLA_FLAGS` at every call."""
  global _fingerprint
  if _fingerprint is None:
    h = hashlib.sha256(f'ik_gat_jax executable {EXECUTABLE_FORMAT}'.encode())
    package = Path(__file__).resolve().parent
    for f in sorted(package.rglob('*.py')):
      data = f.read_bytes()
      h.update(f'\0{f.relative_to(package).as_posix()}\0{len(data)}\0'.encode())
      h.update(data)
    devices = jax.devices()
    backend = devices[0].client
    flax = sys.modules.get('flax')  # traces the models; imported by their modules, not here
    for part in (jax.__version__, jax.lib.__version__, getattr(flax, '__version__', None),
                 np.__version__, backend.platform, backend.platform_version, len(devices),
                 sorted({d.device_kind for d in devices}), _cpu_description()):
      h.update(f'\0{part}'.encode())
    _fingerprint = h.hexdigest()
  config = re.sub(r' at 0x[0-9a-f]+', '', repr(sorted(jax.config.values.items())))
  now = f'{_fingerprint}\0{os.environ.get("XLA_FLAGS", "")}\0{config}'
  return hashlib.sha256(now.encode()).hexdigest()


def executable_key(description: str) -> str:
  """The entry name for an executable described by `description` (the caller's static
  description: what it computes and on which argument shapes) in this environment."""
  h = hashlib.sha256(environment_fingerprint().encode())
  h.update(re.sub(r' at 0x[0-9a-f]+', '', description).encode())
  return h.hexdigest()


def _executable_file(key: str) -> Path | None:
  return None if _executables_dir is None else _executables_dir / f'{key}.jaxexe'


def _register_lapack() -> None:
  """Registers jaxlib's LAPACK kernels (SVD, LU, eigh...) with XLA's CPU client. JAX does so
  when it first lowers one of them; an executable loaded from the cache by a process that has
  lowered none (the subject calibration's live frame, an SVD) would otherwise call a kernel
  that is not there and crash the process (a segmentation fault, jaxlib 0.10). `jax.export`
  does the same before it deserialises a module."""
  try:
    from jax._src.lax import linalg  # pylint: disable=g-import-not-at-top
    linalg.initialize_lapack()
  except Exception:  # another JAX layout: its loading is then its own business
    pass


def load_executable(key: str) -> Any | None:
  """The executable stored under `key`, loaded onto the backend, or None (cache off, no entry,
  or one that cannot be read or loaded)."""
  path = _executable_file(key)
  if path is None or not path.is_file():
    return None
  try:
    fmt, payload, in_tree, out_tree = pickle.loads(path.read_bytes())
    if fmt != EXECUTABLE_FORMAT:
      return None
    _register_lapack()
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
  except Exception:  # truncated, another layout, a backend that refuses it: a miss
    return None


def store_executable(key: str, compiled: Any, args: tuple) -> bool:
  """Writes `compiled` (a `jax.stages.Compiled`) under `key`, atomically, once its serialised
  form, loaded back, gives bit for bit the outputs of `compiled` on `args` (two executions,
  on a cache miss only). False, nothing written, when the cache is off, the backend cannot
  serialise it, the check fails or the folder cannot be written. The check is not a
  formality: jaxlib 0.10.2's CPU client serialises an executable that JAX's own persistent
  cache served (rather than compiled) into one that loads but fails to run ('Function ...
  not found'), so an executable that came from JAX's cache gets no entry (`compile_for_entry`
  compiles one that does)."""
  path = _executable_file(key)
  if path is None:
    return False
  try:
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    loaded = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    want, got = jax.tree.leaves(compiled(*args)), jax.tree.leaves(loaded(*args))
    if len(want) != len(got) or not all(
        np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True) for a, b in zip(want, got)):
      return False
    data = pickle.dumps((EXECUTABLE_FORMAT, payload, in_tree, out_tree))
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_path(path) as tmp:
      Path(tmp).write_bytes(data)
  except Exception:  # no serialisation on this backend, a failed load or run, a full folder
    return False
  return True


# An XLA option that does not change the program (how many buffers XLA's verbose
# buffer-assignment text lists) and that JAX's cache key includes (its dump options it leaves
# out): `compile_for_entry` sets it to a number drawn from the entry's name, so JAX's key
# differs and the executable is compiled, not served from JAX's cache.
_FRESH_OPTION = 'xla_debug_buffer_assignment_show_max'


def _no_jax_cache_write():
  """A context in which JAX's persistent cache writes no entry (its minimum compile time set to
  infinity, in this thread); a null context where JAX's internals differ."""
  try:
    from jax._src import config as jax_config  # internals: guarded
    return jax_config.persistent_cache_min_compile_time_secs(float('inf'))
  except Exception:  # another JAX: the entry may be written (and, keyed by this option, unused)
    return contextlib.nullcontext()


def _unstorable_file(key: str) -> Path | None:
  return None if _executables_dir is None else _executables_dir / f'{key}.unstorable'


def compile_for_entry(key: str | None, lower: Callable[[], Any], args: tuple,
                      options: dict | None = None) -> Any:
  """`lower().compile(compiler_options=options)` on an executable cache miss for `key` (None:
  the cache is off), and the result stored under `key` (`store_executable` with `args`; the
  options must be part of the key).

  An executable that JAX's own persistent cache served cannot be stored (`store_executable`),
  and JAX's cache keys a program by its HLO, not by this package's code: after an update of the
  package that leaves the HLO alone, or an entry lost, every later run would miss here, trace,
  lower and fail to store again (0.8 s of a 1,918-frame solve; BENCHMARKS.md issue N session
  30). So the miss compiles with an option that names the entry (`_FRESH_OPTION`, which changes
  nothing in the program but JAX's key), a real compilation that stores. Where even that cannot
  be stored (a backend without serialisation) a marker `KEY.unstorable` makes later runs
  compile as without this cache, through JAX's. JAX's cache writes no entry for the option's
  compilation, which nothing would read."""
  marker = None if key is None else _unstorable_file(key)
  if marker is None or marker.exists():
    return lower().compile(compiler_options=options)
  with _no_jax_cache_write():  # nor is it written there: no entry that a later miss would hit
    exe = lower().compile(compiler_options={**(options or {}),
                                            _FRESH_OPTION: 1_000_000 + int(key[:12], 16)})
  if not store_executable(key, exe, args):
    try:
      marker.parent.mkdir(parents=True, exist_ok=True)
      marker.touch()
    except OSError:
      pass
  return exe


def status() -> dict:
  """What `enable()` did: enabled, dir, source ('default' | 'user'), atomic_writes, or reason."""
  return dict(_status)


def _install_atomic_cache(path: Path) -> bool:
  """Makes JAX use `_AtomicFileCache` at `path`; False (JAX's own cache) where JAX's internals
  are not those of 0.10.2 or the cache was already initialised."""
  try:
    from jax._src import compilation_cache as cc  # internals: guarded (falls back to JAX's)
    cls = _atomic_cache_class()
    if cc._cache is not None or cc._cache_initialized:
      return False
    if _config('jax_compilation_cache_max_size') != -1 or \
        _config('jax_compilation_cache_check_contents'):
      return False  # JAX's eviction (file locks) or verification: leave them to JAX
    with cc._cache_initialized_mutex:
      cc._cache = cls(str(path), max_size=-1)
      cc._cache_initialized = True
    return True
  except (ImportError, AttributeError, TypeError):
    return False


def _config(name: str):
  return jax.config.values.get(name)


def _atomic_cache_class():
  from jax._src import lru_cache  # JAX internals: only under _install_atomic_cache's guard

  class _AtomicFileCache(lru_cache.LRUCache):
    """JAX's file cache without eviction, each entry written to a temp file and renamed."""

    def put(self, key: str, value: bytes) -> None:
      if not key:
        raise ValueError('key cannot be empty')
      target = self.path / f'{key}{lru_cache._CACHE_SUFFIX}'
      if target.exists():
        return
      with atomic.atomic_path(target) as tmp:
        Path(tmp).write_bytes(value)

  return _AtomicFileCache
