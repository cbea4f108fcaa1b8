"""Tune the iterative solvers' learning rate and latent weight on val (issue C).

  python -m experiments.sweep_iterative --data=/tmp/cmu --prior=runs/prior \
      [--max_frames=256] [--iters=100] --output=outputs/sweep_iterative.md

Adam is invariant to the overall scale of the loss, so with w_data fixed at 10 only the ratio
w_z / w_data matters: the sweep covers lr x w_z for the prior-based solver and lr for the
no-prior solver, cold start with the analytic root, and writes a markdown table (and JSON beside
it) of val local-rotation error and MPJPE per setting, best first.
"""

from pathlib import Path

from absl import flags

from experiments.common import fail_on_user_error, run_main
from ik_gat_jax import data, evaluation, iterative_ik
from ik_gat_jax.io import atomic

_DATA = flags.DEFINE_string('data', None, 'Shard directory.')
_PRIOR = flags.DEFINE_string('prior', None, 'Pose-prior run directory.')
_SPLIT = flags.DEFINE_string('split', 'val', 'Split to tune on.')
_MAX_FRAMES = flags.DEFINE_integer('max_frames', 256, 'Frames per setting.')
_ITERS = flags.DEFINE_integer('iters', 100, 'Iterations per frame.')
_LRS = flags.DEFINE_list('lrs', ['0.03', '0.1', '0.3'], 'Learning rates.')
_WZS = flags.DEFINE_list('w_zs', ['0.001', '0.01', '0.1'], 'Latent penalty weights.')
_OUT = flags.DEFINE_string('output', 'outputs/sweep_iterative.md', 'Markdown table path.')


@fail_on_user_error
def main(argv):
  del argv
  out = Path(_OUT.value)
  if out.suffix.lower() == '.json':  # the rows' JSON goes beside the table, as OUT.json
    raise ValueError(f'--output names the markdown table (its rows go to the same name .json): '
                     f'give one ending .md, not {out}')
  for flag in (_LRS, _WZS):
    if not flag.value:
      raise ValueError(f'--{flag.name} is empty: give one value or more')
  ds = data.load_shards(_DATA.value, _SPLIT.value)
  rows = []
  grid = [('iterative_noprior', float(lr), None) for lr in _LRS.value]
  grid += [('iterative', float(lr), float(wz)) for lr in _LRS.value for wz in _WZS.value]
  for name, lr, wz in grid:
    cfg = iterative_ik.SolverConfig(iters=_ITERS.value, lr=lr,
                                    **({'w_z': wz} if wz is not None else {}))
    method = evaluation.make_method(name, ds.rig, prior=_PRIOR.value, solver=cfg)
    r = evaluation.evaluate(method, ds, ds.rig, max_frames=_MAX_FRAMES.value)
    rows.append({'method': name, 'lr': lr, 'w_z': wz, 'local_rot_err_deg': r['local_rot_err_deg'],
                 'mpjpe_mm': r['mpjpe_mm'], 'frames': r['frames'],
                 'frames_per_s': r['frames_per_s']})
    print(f"{name:18s} lr {lr:<6g} w_z {wz if wz is not None else '-':<6} local "
          f"{r['local_rot_err_deg']:6.2f} deg  MPJPE {r['mpjpe_mm']:7.2f} mm", flush=True)
  rows.sort(key=lambda r: (r['method'], r['local_rot_err_deg']))
  lines = [f'Sweep on {_SPLIT.value} ({rows[0]["frames"]} frames, {_ITERS.value} Adam '
           'iterations, cold start, analytic root, w_data = 10).', '',
           '| method | lr | w_z | local (deg) | MPJPE (mm) |', '|---|---:|---:|---:|---:|']
  lines += [f"| {r['method']} | {r['lr']:g} | {r['w_z'] if r['w_z'] is not None else '-'} | "
            f"{r['local_rot_err_deg']:.2f} | {r['mpjpe_mm']:.2f} |" for r in rows]
  out.parent.mkdir(parents=True, exist_ok=True)
  atomic.write_text(out, '\n'.join(lines) + '\n')
  atomic.write_json(out.with_suffix('.json'), rows)
  print('\n'.join(lines))


if __name__ == '__main__':
  # Marked here, not at import: importing a main (tests do) must not make its flags
  # required for every other absl program in the same process.
  flags.mark_flags_as_required(['data'])
  run_main(main)
