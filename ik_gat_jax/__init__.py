"""ik_gat_jax: amortized inverse kinematics of the human body with a graph-attention network.

`import ik_gat_jax` stays light: `ik_gat_jax.IKSolver` (and `InputError`) import the solver,
and with it JAX and Flax, on first use.
"""

_LAZY = {'IKSolver': 'ik_gat_jax.solver', 'InputError': 'ik_gat_jax.solver',
         'Solution': 'ik_gat_jax.solver'}


def __getattr__(name):
  if name in _LAZY:
    import importlib
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
  return sorted(list(globals()) + list(_LAZY))
