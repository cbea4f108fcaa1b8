"""ik_gat_jax: amortized inverse kinematics of the human body (IK-GAT) in JAX/Flax.

`import ik_gat_jax` stays light: `ik_gat_jax.IKSolver` (and `InputError`) import the solver,
and with it JAX and Flax, on first use. `ik_gat_jax.start_live_backend()`, called before any
JAX computation, sets a process up for live frames (`inference.start_live_backend`).

Importing the package applies one XLA workaround before JAX starts its backend: XLA's CPU
"YNN" fusions are switched off (`--xla_cpu_experimental_ynn_fusion_type=`). On jaxlib 0.10.2
the reduce fusion miscompiles `r - sum(r * x, -1, keepdims=True) * x` for more than 512 outer
rows (rows past the first thread's partition read the wrong data: errors of order 1), which
corrupted batched bone frames of mixed subjects. Switching it off cost no measurable speed
at first (IK-GAT base at batch 256, 2-core CPU), but without YNN XLA splits every mean over more
than 32 numbers into five kernels, which made the LayerNorms slow (session 23, Zen 4: 1.5x for
an ELU, residual and LayerNorm); `model.layer_norm` computes their row statistics as a
matrix-vector product instead. Set the flag yourself in XLA_FLAGS to override.
tests/xla_workaround_test.py guards it.

And one setting for speed, the same way: `--xla_cpu_prefer_vector_width=512` (XLA's CPU
backend otherwise emits 256-bit vector code even where the CPU has AVX-512). On session 10's
2-core Intel Xeon VM (AVX-512 and AMX) it made the IK-GAT base network 1.3x faster for a single
frame on one core and 1.1x batched (BENCHMARKS.md "Vector width"); on a CPU without AVX-512 it changes nothing. Set
the flag yourself (for example `=256`, XLA's default, on an older Intel CPU that lowers its
clock for 512-bit code) to override; `IK_GAT_NO_XLA_TUNING=1` leaves it out.
"""

import os as _os
import sys as _sys
import warnings as _warnings

_YNN_FLAG = '--xla_cpu_experimental_ynn_fusion_type='
_VECTOR_FLAG = '--xla_cpu_prefer_vector_width=512'


def _apply_xla_workarounds() -> None:
  flags = _os.environ.get('XLA_FLAGS', '')
  add = [] if 'xla_cpu_experimental_ynn_fusion_type' in flags else [_YNN_FLAG]
  tuning = _os.environ.get('IK_GAT_NO_XLA_TUNING', '').strip().lower() not in ('1', 'true',
                                                                               'yes', 'on')
  if tuning and 'xla_cpu_prefer_vector_width' not in flags:
    add.append(_VECTOR_FLAG)
  if not add:
    return
  started = False
  if 'jax' in _sys.modules:  # else JAX cannot have started a backend yet
    try:
      from jax._src import xla_bridge
      started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
      pass
  if started:
    if _YNN_FLAG not in add:  # only the speed setting is missing: nothing to warn about
      return
    _warnings.warn('ik_gat_jax was imported after JAX started its backend, so the XLA CPU '
                   'workaround could not be applied: set XLA_FLAGS="' + _YNN_FLAG + '" before '
                   'starting Python (see ik_gat_jax/__init__.py)')
    return
  _os.environ['XLA_FLAGS'] = ' '.join([flags] + add).strip()


_apply_xla_workarounds()


_LAZY = {'IKSolver': 'ik_gat_jax.solver', 'InputError': 'ik_gat_jax.solver',
         'Solution': 'ik_gat_jax.solver', 'start_live_backend': 'ik_gat_jax.inference'}


def __getattr__(name):
  if name in _LAZY:
    import importlib
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
  return sorted(list(globals()) + list(_LAZY))
