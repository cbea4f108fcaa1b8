"""Fixed causal smoothers of the input against the learned window model (issue K's reading).

  python -m experiments.causal_fit --data=/tmp/cmu --split=val [--noise_mm=0,20] \
      [--fits=1:0,4:1,8:1,12:1,16:1,16:2,24:2] [--oracle=8,16,32] [--output_json=FILE]

Each noisy frame is replaced by the endpoint of a least-squares polynomial fit (degree d) to it
and its k-1 predecessors (the same causal windows at 30 fps as the window model, the first
frames of a clip repeating the first; windows.py), then solved by the per-frame shipped model;
scored like every method (`evaluation.evaluate`: i.i.d. Gaussian noise per coordinate, seed 0;
local error, MPJPE, jitter / ground truth). `k:d` = 1:0 is the per-frame model itself. What it
shows: how far a causal smoother of the input alone gets (noise down by the fit's endpoint
variance, (4k-2)/(k(k+1)) of sigma^2 for a line, but lag wherever the motion is not a
polynomial of degree d over k frames), i.e. what the window model has to beat.

`--oracle=k,...` adds a bound for every linear causal smoother of the input: the k taps (shared
by all joints and coordinates) fit by least squares to the evaluated split's own truth, on the
same noisy frames and windows (the taps see the answers, so no causal linear filter of k frames
does better on these frames). Its rows give the smoothed points' own error (`points MPJPE`,
root excluded, as the input's) and, like the fits, the per-frame model's solution of them.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import common
from experiments.common import fail_on_user_error, run_main
from ik_gat_jax import data, evaluation, windows
from ik_gat_jax.io import atomic

_DATA = _SPLIT = _CKPT = _NOISE = _FITS = _ORACLE = _OUTPUT = None  # set by define_flags()


def define_flags() -> None:
  """The main's flags, defined only when it runs (tests import the functions beside other
  mains that claim --data)."""
  global _DATA, _SPLIT, _CKPT, _NOISE, _FITS, _ORACLE, _OUTPUT
  _DATA = flags.DEFINE_string('data', None, 'Shard directory.')
  _SPLIT = flags.DEFINE_string('split', 'val', 'Split (choose on val).')
  _CKPT = flags.DEFINE_string('checkpoint', None, 'Per-frame IK-GAT (default: shipped).')
  _NOISE = flags.DEFINE_list('noise_mm', ['0', '20'], 'Input noise levels (mm).')
  _FITS = flags.DEFINE_list('fits', ['1:0', '4:1', '8:1', '12:1', '16:1', '16:2', '24:2'],
                            'Window frames k : polynomial degree d.')
  _ORACLE = flags.DEFINE_list('oracle', [], 'Window frames k of the oracle linear smoother (taps '
                              'fit to the split\'s own truth: a bound, module docstring).')
  _OUTPUT = flags.DEFINE_string('output_json', None, 'Write the rows here too.')


def endpoint_weights(k: int, degree: int) -> np.ndarray:
  """`[k]` weights (oldest first) giving the value at the newest frame of the least-squares
  polynomial of `degree` through k equally spaced samples."""
  t = np.arange(k, dtype=np.float64) - (k - 1)
  return np.linalg.pinv(np.vander(t, degree + 1, increasing=True))[0]


def noisy_windows(ds, k: int, noise_mm: float) -> tuple[np.ndarray, np.ndarray]:
  """The split's clean points `[N, J, 3]` and the noisy windows `[N, k, J, 3]` (oldest first)
  that `evaluation.evaluate` gives a 30 fps window method (seed 0, every frame)."""
  clean = np.asarray(ds.positions, np.float32)
  noisy = evaluation.add_noise(clean, noise_mm, 0)
  starts = windows.run_starts(np.asarray(ds.file_id), np.asarray(ds.frame_index))
  i0, i1, w = windows.history_sources(np.arange(len(clean)), starts, k, ds.fps / 30.0)
  return clean, np.concatenate([windows.interpolate(noisy, i0, i1, w), noisy[:, None]], axis=1)


def oracle_weights(clean: np.ndarray, win: np.ndarray) -> np.ndarray:
  """`[k]` taps minimising the squared error of `sum_i w_i win[:, i]` to `clean` (all joints
  and coordinates together; float64 normal equations)."""
  A = np.moveaxis(win.astype(np.float64), 1, -1).reshape(-1, win.shape[1])
  return np.linalg.lstsq(A, clean.astype(np.float64).reshape(-1), rcond=None)[0]


def fitted_method(base: evaluation.Method, k: int, degree: int,
                  weights: np.ndarray | None = None) -> evaluation.Method:
  w = jnp.asarray(endpoint_weights(k, degree) if weights is None else weights, jnp.float32)

  def solve(positions, offsets):  # [N, k, J, 3] windows (k > 1) or [N, J, 3]
    if positions.ndim == 4:
      positions = jnp.einsum('t,ntjc->njc', w, positions)
    return base.solve(positions, offsets)

  info = dict(base.info, input_window=k, input_window_fps=30.0)
  name = f'fit k={k} degree={degree}' if weights is None else f'oracle k={k}'
  return dataclasses.replace(base, name=name, solve=solve, info=info)


def _fit_spec(spec: str) -> tuple[int, int]:
  """'K:DEGREE' -> (K, DEGREE): K >= 1 frames, a polynomial of degree < K (a higher one is
  underdetermined: the fit passes through the newest frame, the per-frame model's row)."""
  try:
    k, degree = (int(x) for x in spec.split(':'))
  except ValueError:
    raise ValueError(f'--fits: expected K:DEGREE (e.g. 8:1), got {spec!r}') from None
  if not 0 <= degree < k:
    raise ValueError(f'--fits {spec}: a degree from 0 to K - 1 ({k - 1}) fits K frames')
  return k, degree


@fail_on_user_error
def main(argv):
  del argv
  fits = [_fit_spec(spec) for spec in _FITS.value]  # before any work
  noise_levels = common.noise_levels(_NOISE.value)
  ds = data.load_shards(_DATA.value, _SPLIT.value)
  base = evaluation.make_method('ikgat', ds.rig, checkpoint=_CKPT.value)
  rows = []
  print('| k | degree | noise (mm) | local (deg) | MPJPE (mm) | jitter / GT |')
  print('|---:|---:|---:|---:|---:|---:|')
  for k, degree in fits:
    method = fitted_method(base, k, degree)
    for noise in noise_levels:
      r = evaluation.evaluate(method, ds, ds.rig, noise_mm=noise)
      rows.append({'k': k, 'degree': degree, 'noise_mm': noise,
                   'local_rot_err_deg': r['local_rot_err_deg'], 'mpjpe_mm': r['mpjpe_mm'],
                   'jitter_ratio': r['jitter_ratio']})
      print(f"| {k} | {degree} | {noise:g} | {r['local_rot_err_deg']:.2f} | "
            f"{r['mpjpe_mm']:.1f} | {r['jitter_ratio']:.2f} |", flush=True)
  if _ORACLE.value:
    print('\n| oracle k | noise (mm) | points MPJPE (mm) | local (deg) | MPJPE (mm) | jitter / GT |')
    print('|---:|---:|---:|---:|---:|---:|')
  for k in (int(x) for x in _ORACLE.value):
    for noise in noise_levels:
      clean, win = noisy_windows(ds, k, noise)
      w = oracle_weights(clean, win)
      points = np.einsum('t,ntjc->njc', w, win)
      points_mm = float(1e3 * np.linalg.norm(points - clean, axis=-1)[:, 1:].mean())
      r = evaluation.evaluate(fitted_method(base, k, 0, w), ds, ds.rig, noise_mm=noise)
      rows.append({'oracle_k': k, 'noise_mm': noise, 'weights': w.tolist(),
                   'points_mpjpe_mm': points_mm, 'local_rot_err_deg': r['local_rot_err_deg'],
                   'mpjpe_mm': r['mpjpe_mm'], 'jitter_ratio': r['jitter_ratio']})
      print(f"| {k} | {noise:g} | {points_mm:.1f} | {r['local_rot_err_deg']:.2f} | "
            f"{r['mpjpe_mm']:.1f} | {r['jitter_ratio']:.2f} |", flush=True)
  if _OUTPUT.value:
    atomic.write_json(_OUTPUT.value, {'split': _SPLIT.value, 'rows': rows})


if __name__ == '__main__':
  define_flags()
  flags.mark_flags_as_required(['data'])
  run_main(main)
