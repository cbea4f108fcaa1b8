"""ik_gat_jax: amortized inverse kinematics of the human body (IK-GAT) in JAX/Flax.

`import ik_gat_jax` stays light: `ik_gat_jax.IKSolver` (and `InputError`) import the solver,
and with it JAX and Flax, on first use.

Importing the package applies one XLA workaround before JAX starts its backend: XLA's CPU
"YNN" fusions are switched off (`--xla_cpu_experimental_ynn_fusion_type=`). On jaxlib 0.10.2
the reduce fusion miscompiles `r - sum(r * x, -1, keepdims=True) * x` for more than 512 outer
rows (rows past the first thread's partition read the wrong data: errors of order 1), which
corrupted batched bone frames of mixed subjects; switching it off cost no measurable speed
(IK-GAT base at batch 256, 2-core CPU). Set the flag yourself in XLA_FLAGS to override.
tests/xla_workaround_test.py guards it.
"""

import os as _os
import sys as _sys
import warnings as _warnings

_YNN_FLAG = '--xla_cpu_experimental_ynn_fusion_type='


def _apply_xla_workarounds() -> None:
  flags = _os.environ.get('XLA_FLAGS', '')
  if 'xla_cpu_experimental_ynn_fusion_type' in flags:
    return
  started = False
  if 'jax' in _sys.modules:  # else JAX cannot have started a backend yet
    try:
      from jax._src import xla_bridge
      started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
      pass
  if started:
    _warnings.warn('ik_gat_jax was imported after JAX started its backend, so the XLA CPU '
                   'workaround could not be applied: set XLA_FLAGS="' + _YNN_FLAG + '" before '
                   'starting Python (see ik_gat_jax/__init__.py)')
    return
  _os.environ['XLA_FLAGS'] = (flags + ' ' + _YNN_FLAG).strip()


_apply_xla_workarounds()


_LAZY = {'IKSolver': 'ik_gat_jax.solver', 'InputError': 'ik_gat_jax.solver',
         'Solution': 'ik_gat_jax.solver'}


def __getattr__(name):
  if name in _LAZY:
    import importlib
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
  return sorted(list(globals()) + list(_LAZY))
