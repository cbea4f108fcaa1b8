"""What solving without the subject's rest offsets costs, and what fitting them gives.

  python -m experiments.offsets_check --data=/tmp/cmu --split=val [--checkpoint=DIR] \
      [--noise_mm=0,10,20] [--output_json=FILE]

Each file of the split (one subject) is solved as one clip (`IKSolver.solve`, i.i.d. Gaussian
noise per coordinate, seed 0, as `experiments.evaluate`) with four sets of rest offsets:
`subject` (its own), `template` (the rig's, what the solver takes for positions alone),
`lengths` (the template's directions, the input's bone lengths: `estimate_lengths`) and
`fitted` (the template, then the offsets the solved rotations imply: `fit_offsets`). Reported
per set: the local rotation error against the subject's own rotations (DESIGN section 7; the
rotations are relative to the offsets' rest pose, so this is what a rest pose unlike the
subject's costs), and how far the output skeleton (FK of the solution on its offsets, the
positions a written BVH or GLB plays) is from the input and from the clean truth (mm, MPJPE's
joints).
"""

from __future__ import annotations

import numpy as np
from absl import flags

from experiments import common
from experiments.common import (checkpoint_noise_main, define_checkpoint_noise_flags,
                                fail_on_user_error, run_main)
from ik_gat_jax import evaluation, input_pipeline, metrics
from ik_gat_jax.solver import IKSolver


def define_flags() -> None:
  """Defines the flags (read as `flags.FLAGS.<name>` by `main`) only when the main runs: the
  tests import `run` beside other mains that claim --data."""
  define_checkpoint_noise_flags()
  flags.adopt_module_key_flags(common)


OFFSETS = ('subject', 'template', 'lengths', 'fitted')
FIELDS = ('local_rot_err_deg', 'skeleton_to_input_mm', 'skeleton_to_truth_mm')


def run(ds, solver: IKSolver, noise_levels: list[float]) -> dict:
  """`{noise: {offsets: {field: value}}}` over the split's frames (module docstring)."""
  files = [np.flatnonzero(np.asarray(ds.file_id) == f) for f in np.unique(ds.file_id)]
  files = [rows[np.argsort(np.asarray(ds.frame_index)[rows], kind='stable')] for rows in files]
  idx = np.concatenate(files)
  batch = {k: np.asarray(v) for k, v in input_pipeline.gather_batch(ds, idx).items()}
  bounds = np.cumsum([0] + [len(rows) for rows in files])
  template = solver.rig.template()
  out = {}
  for noise in noise_levels:
    noisy = evaluation.add_noise(batch['positions'], noise, 0)
    local = {k: np.empty_like(batch['local_rot']) for k in OFFSETS}
    skeleton = {k: np.empty_like(batch['positions']) for k in OFFSETS}
    for a, b in zip(bounds[:-1], bounds[1:]):
      given = {'subject': dict(offsets=batch['offsets'][a]),
               'template': dict(offsets=template),
               'lengths': dict(offsets=template, estimate_lengths=True),
               'fitted': dict(offsets=template, fit_offsets=True)}
      for k, kwargs in given.items():
        sol = solver.solve(noisy[a:b], full=True, progress=False, **kwargs)
        local[k][a:b], skeleton[k][a:b] = sol.local_rot, sol.positions_fk
    out[noise] = {}
    for k in OFFSETS:
      err = metrics.compute_errors_batched(local[k], batch['local_rot'], batch['offsets'],
                                           batch['bone_frames'], batch['positions'], solver.rig)
      out[noise][k] = {
          'local_rot_err_deg': metrics.summarize(err, solver.rig)['local_rot_err_deg'],
          'skeleton_to_input_mm': metrics.position_error_mm(skeleton[k], noisy, solver.rig),
          'skeleton_to_truth_mm': metrics.position_error_mm(skeleton[k], batch['positions'],
                                                            solver.rig)}
  return out


def table(results: dict) -> str:
  rows = [[f'{noise:g}', k] + [f'{v[f]:.3f}' if f.endswith('deg') else f'{v[f]:.2f}'
                               for f in FIELDS]
          for noise, sets in results.items() for k, v in sets.items()]
  return evaluation.markdown_grid(['noise (mm)', 'offsets', 'local error (deg)',
                                   'skeleton to input (mm)', 'skeleton to truth (mm)'], rows)


@fail_on_user_error
def main(argv):
  del argv
  # The network as trained, as experiments.evaluate measures it (its rows are compared).
  checkpoint_noise_main(run, table, 'the rest offsets the solver is given',
                        size_normalization=False)


if __name__ == '__main__':
  define_flags()
  flags.mark_flags_as_required(['data'])
  run_main(main)
