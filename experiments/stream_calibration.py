"""A stream's subject calibration as it warms up: the error by the time into each clip.

  python -m experiments.stream_calibration --data=/tmp/cmu --split=val \
      [--checkpoint=DIR] [--noise_mm=0,10,20] [--windows=0:30,30:300,0:] [--subject=NAME] \
      [--output_json=FILE]

Each file of the split is solved as one clip by the plain network (`IKSolver.solve`, i.i.d.
Gaussian noise per coordinate, seed 0, as `experiments.evaluate`), then calibrated three ways
(ik_gat_jax/subject_calibration.py): not at all, as a stream (`SubjectBias`: frame t by the
mean bias of frames 0..t, what `step` and `solve_stream` give) and as a clip (`calibrate_clip`:
every frame by the mean over the whole file). The local rotation error (DESIGN section 7) is
reported over frame windows counted from each file's first frame (`START:STOP` at the data's
frame rate; an empty STOP runs to the end), so the first rows show what a live stream pays
while its calibration has seen few frames. `--subject` keeps one subject's files.
"""

from __future__ import annotations

import numpy as np
from absl import flags

from experiments import common
from experiments.common import (define_checkpoint_noise_flags, fail_on_user_error,
                                noise_levels, run_main, write_noise_results)
from ik_gat_jax import data, evaluation, input_pipeline, metrics
from ik_gat_jax import subject_calibration as sc
from ik_gat_jax.solver import IKSolver

def define_flags() -> None:
  """Defines the flags (read as `flags.FLAGS.<name>` by `main`) only when the main runs: the
  tests import `run` beside other mains that claim --data."""
  define_checkpoint_noise_flags()
  flags.adopt_module_key_flags(common)
  flags.DEFINE_list('windows', ['0:30', '30:300', '0:'],
                    'Frame windows START:STOP from each file\'s first frame.')
  flags.DEFINE_string('subject', None, 'Only this subject\'s files.')


WAYS = ('none', 'stream', 'clip')


def parse_windows(specs: list[str]) -> list[tuple[int, int | None]]:
  out = []
  for spec in specs:
    start, sep, stop = spec.partition(':')
    try:
      w = (int(start), int(stop) if stop else None)
    except ValueError:
      w = None
    if not sep or w is None or w[0] < 0 or (w[1] is not None and w[1] <= w[0]):
      raise ValueError(f'--windows: {spec!r} is not START:STOP with 0 <= START < STOP '
                       '(STOP may be empty)')
    out.append(w)
  return out


def run(ds, solver: IKSolver, noise_levels: list[float], windows, subject: str | None = None
        ) -> dict:
  """`{noise: {way: {window: local error}}}` (module docstring)."""
  files = []  # (rows in time order, subject offsets index)
  for f in np.unique(ds.file_id):
    rows = np.flatnonzero(np.asarray(ds.file_id) == f)
    s = int(ds.subject_id[rows[0]])
    if subject is None or ds.subjects[s]['name'] == subject:
      files.append(rows[np.argsort(np.asarray(ds.frame_index)[rows], kind='stable')])
  if not files:
    raise ValueError(f'no file of subject {subject!r} in the {ds.split} split')
  idx = np.concatenate(files)
  batch = {k: np.asarray(v) for k, v in input_pipeline.gather_batch(ds, idx).items()}
  # Each frame's place in its file, for the windows.
  since_start = np.concatenate([np.arange(len(rows)) for rows in files])
  bounds = np.cumsum([0] + [len(rows) for rows in files])
  out = {}
  for noise in noise_levels:
    noisy = evaluation.add_noise(batch['positions'], noise, 0)
    preds = {w: np.empty_like(batch['local_rot']) for w in WAYS}
    for a, b in zip(bounds[:-1], bounds[1:]):
      off = batch['offsets'][a]
      plain = solver.solve(noisy[a:b], offsets=off, progress=False)
      preds['none'][a:b] = plain
      preds['stream'][a:b] = sc.SubjectBias().calibrate(plain, noisy[a:b], off, solver.rig)
      preds['clip'][a:b] = sc.calibrate_clip(plain, noisy[a:b], off, solver.rig)[0]
    out[noise] = {}
    for way, pred in preds.items():
      err = metrics.compute_errors_batched(pred, batch['local_rot'], batch['offsets'],
                                           batch['bone_frames'], batch['positions'], solver.rig)
      out[noise][way] = {}
      for start, stop in windows:
        keep = (since_start >= start) & (since_start < (stop if stop is not None else np.inf))
        name = f'{start}:{"" if stop is None else stop}'
        out[noise][way][name] = (metrics.summarize({k: v[keep] for k, v in err.items()},
                                                   solver.rig)['local_rot_err_deg']
                                 if keep.any() else None)
  return out


def table(results: dict, windows: list[str]) -> str:
  rows = []
  for noise, ways in results.items():
    for way, errs in ways.items():
      rows.append([f'{noise:g}', way] + ['' if errs[w] is None else f'{errs[w]:.3f}'
                                         for w in windows])
  return evaluation.markdown_grid(['noise (mm)', 'calibration'] + [f'frames {w}'
                                                                 for w in windows], rows)


@fail_on_user_error
def main(argv):
  del argv
  F = flags.FLAGS
  noise = noise_levels(F.noise_mm)
  windows = parse_windows(F.windows)
  ds = data.load_shards(F.data, F.split)
  # The network as trained, as experiments.evaluate measures it (its rows are compared).
  solver = IKSolver.from_checkpoint(F.checkpoint, expected_rig=ds.rig, size_normalization=False)
  results = run(ds, solver, noise, windows, F.subject)
  names = list(next(iter(next(iter(results.values())).values())))
  print(f'{ds.split} split{" subject " + F.subject if F.subject else ""}, '
        f'{solver.source}: local rotation error (deg)')
  print(table(results, names))
  if F.output_json:
    write_noise_results(F.output_json, ds, solver, results, subject=F.subject)


if __name__ == '__main__':
  define_flags()
  flags.mark_flags_as_required(['data'])
  run_main(main)
