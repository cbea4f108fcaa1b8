r"""Evaluate one method on a shard split (DESIGN section 9).

  python -m experiments.evaluate --data=DIR --split=test \
      --method=ikgat|iterative|iterative_noprior|swing|mean_pose [--checkpoint=DIR] [--prior=DIR] \
      [--iters=N] [--warm_start] [--noise_mm=S] [--max_frames=N] [--refine_iters=N] \
      [--[no]refine_prior] [--mirror] [--subject_calibration] [--offsets=template] \
      [--size_normalization] [--subject_scale=K] \
      [--matmul_precision=float32|bfloat16] \
      [--filter=none|one_euro --filter_min_cutoff=HZ --filter_beta=B] \
      [--trackers=full|6|10|A,B,C] [--joint_dropout=P] [--orientations=A,B,C] [--end_sites] \
      [--output_json=FILE]

Prints a markdown table (overall and per test part) and, with --output_json, writes one JSON
object (fields of DESIGN section 9 plus per_subject, per_file, per_part, settings,
provenance, and the jitter of the output and the ground truth: jitter_deg_s2,
gt_jitter_deg_s2, jitter_ratio, per_joint_jitter). Without
--checkpoint / --prior the shipped checkpoints under checkpoints/ are used. Sparse inputs
(issue G2; ikgat checkpoints trained for them only, the other methods refuse): --trackers keeps
only a tracker subset (ik_gat_jax/trackers.py), --joint_dropout drops each remaining joint with
probability P (seeded by --seed), --orientations gives those joints' true world rotations,
--end_sites gives every end site the shards have (head top, hand and toe tips; shards converted
with end sites);
the result's `sparse` entry records them and `local_rot_err_deg_by_class.leaf` is the error of
the joints positions cannot show (head, hands, toes). --filter filters any
method's output causally per file (temporal.py); ikgat defaults to its checkpoint's `temporal`
config (none for the shipped one), the other methods to none; the other --filter_* flags override
single fields. --offsets=template gives every method (and --subject_calibration) the rig's
template offsets instead of each subject's own, as the solver has for positions alone; the
errors stay against the subject's own rotations. --subject_scale=K evaluates every body K times
its size (a subject smaller or larger than the data's; the rotations are the same), and
--size_normalization shows ikgat each body at the rig template's size, as IKSolver does by
default (BENCHMARKS.md "Subject size").
"""

from pathlib import Path

from absl import flags

from experiments.common import fail_on_user_error, run_main
from ik_gat_jax import data, evaluation, iterative_ik, provenance, temporal
from ik_gat_jax.io import atomic

# The flags, defined only when the main runs (`define_flags`): importing this module claims no
# flag names another absl main in the same process may own.
(_DATA, _SPLIT, _METHOD, _CHECKPOINT, _PRIOR, _ITERS, _WARM_ITERS, _WINDOW, _LR, _W_Z,
 _INIT_ROOT, _OPTIMIZER, _REFINE, _REFINE_LR, _W_ANCHOR, _ANCHOR_RELATIVE, _REFINE_PRIOR,
 _W_PRIOR, _PRECISION, _MIRROR, _FIT_TRANSLATION, _SUBJECT_CAL, _SIZE, _SUBJECT_SCALE, _OFFSETS,
 _WARM, _NOISE, _MAX_FRAMES, _BATCH, _SEED, _OUTPUT, _TRACKERS, _JOINT_DROPOUT, _ORIENTATIONS,
 _END_SITES, _FILTER, _FILTER_MIN_CUTOFF, _FILTER_BETA, _FILTER_D_CUTOFF) = (None,) * 39


def define_flags() -> None:
  """Defines the main's flags (once; the module-level holders above)."""
  global _DATA, _SPLIT, _METHOD, _CHECKPOINT, _PRIOR, _ITERS, _WARM_ITERS, _WINDOW, _LR, _W_Z
  global _INIT_ROOT, _OPTIMIZER, _REFINE, _REFINE_LR, _W_ANCHOR, _ANCHOR_RELATIVE, _REFINE_PRIOR
  global _W_PRIOR, _PRECISION, _MIRROR, _FIT_TRANSLATION, _SUBJECT_CAL, _SIZE, _SUBJECT_SCALE
  global _OFFSETS, _WARM, _NOISE, _MAX_FRAMES, _BATCH, _SEED, _OUTPUT, _TRACKERS, _JOINT_DROPOUT
  global _ORIENTATIONS, _END_SITES, _FILTER, _FILTER_MIN_CUTOFF, _FILTER_BETA, _FILTER_D_CUTOFF
  if _DATA is not None:
    return
  _DATA = flags.DEFINE_string('data', None, 'Shard directory.')
  _SPLIT = flags.DEFINE_string('split', 'test', 'Split to evaluate.')
  _METHOD = flags.DEFINE_enum('method', None, ['ikgat', 'iterative', 'iterative_noprior', 'swing',
                                               'mean_pose'], 'Method.')
  _CHECKPOINT = flags.DEFINE_string('checkpoint', None, 'IK-GAT run or checkpoint directory.')
  _PRIOR = flags.DEFINE_string('prior', None, 'Pose-prior run or checkpoint directory.')
  _ITERS = flags.DEFINE_integer('iters', 100, 'Iterations per frame (iterative methods; cold).')
  _WARM_ITERS = flags.DEFINE_integer('warm_iters', None, 'Iterations of warm-started frames.')
  _WINDOW = flags.DEFINE_integer('window', None, 'Warm-start window length (frames).')
  _LR = flags.DEFINE_float('lr', None, 'Solver learning rate (default: SolverConfig).')
  _W_Z = flags.DEFINE_float('w_z', None, 'Latent penalty weight.')
  _INIT_ROOT = flags.DEFINE_enum('init_root', 'analytic', ['analytic', 'identity'],
                                 'Cold-start root rotation.')
  _OPTIMIZER = flags.DEFINE_enum('optimizer', 'adam', ['adam', 'lbfgs'], 'Solver optimizer.')
  _REFINE = flags.DEFINE_integer('refine_iters', 0, 'ikgat only: refine its output with this many '
                                 'anchored iterations (0: off; --refine_prior).', lower_bound=0)
  _REFINE_LR = flags.DEFINE_float('refine_lr', None, 'Learning rate of the refinement (default: '
                                   'iterative_ik.REFINE_DEFAULTS).')
  _W_ANCHOR = flags.DEFINE_float('w_anchor', None, 'Refinement: weight pulling toward IK-GAT '
                                 '(default: iterative_ik.REFINE_DEFAULTS).')
  _ANCHOR_RELATIVE = flags.DEFINE_boolean('anchor_relative', None, 'Refinement: --w_anchor '
                                          'relative to the initial residual (default: on).')
  _REFINE_PRIOR = flags.DEFINE_boolean('refine_prior', True, 'Refinement: with the pose prior '
                                       '(--prior, default the shipped one; '
                                       'iterative_ik.PRIOR_REFINE_DEFAULTS); --norefine_prior: '
                                       'anchored to IK-GAT only (REFINE_DEFAULTS).')
  _W_PRIOR = flags.DEFINE_float('w_prior', None, 'Refinement: weight of the prior term (default: '
                                'iterative_ik.PRIOR_REFINE_DEFAULTS).')
  _PRECISION = flags.DEFINE_enum('matmul_precision', 'float32', ['float32', 'bfloat16'],
                                 'ikgat only: the network\'s large products in float32, or with '
                                 'bfloat16 inputs and float32 sums (model.set_matmul_precision).')
  _MIRROR = flags.DEFINE_boolean('mirror', False, 'ikgat only: test-time mirror averaging (the '
                                 'network also solves the mirror-image input; the geodesic '
                                 'midpoint of both, before any refinement; twice the network).')
  _FIT_TRANSLATION = flags.DEFINE_boolean('fit_translation', None, 'Fit the root translation '
                                          '(least squares) instead of taking the input root '
                                          'joint\'s: iterative solvers (default: off) and the '
                                          'refinement (default: on).')
  _SUBJECT_CAL = flags.DEFINE_boolean('subject_calibration', False, 'Turn the joints whose '
                                      'children branch (the root, the chest) by each file\'s '
                                      'subject\'s biases there, measured on the file\'s input '
                                      'frames (ik_gat_jax/subject_calibration.py).')
  _SIZE = flags.DEFINE_boolean('size_normalization', False, 'ikgat only: the network sees each '
                               'body at the rig template\'s size, as IKSolver does by default.')
  _SUBJECT_SCALE = flags.DEFINE_float('subject_scale', 1.0, 'Every body this many times its size '
                                      '(positions and offsets; the rotations are the same).')
  _OFFSETS = flags.DEFINE_enum('offsets', 'subject', list(evaluation.OFFSETS), 'Rest offsets '
                               'given to the method: each subject\'s own, or the rig\'s template '
                               '(what the solver takes for positions alone); errors stay against '
                               'the subject\'s own rotations.')
  _WARM = flags.DEFINE_boolean('warm_start', False, 'Warm start over windows of each clip.')
  _NOISE = flags.DEFINE_float('noise_mm', 0.0, 'Gaussian input noise per coordinate (mm).',
                               lower_bound=0.0)
  _MAX_FRAMES = flags.DEFINE_integer('max_frames', None, 'Evaluate about this many frames: each '
                                     'file its share, rounded up (up to one more per file; '
                                     'evaluation.select_frames); 0: all.')
  _BATCH = flags.DEFINE_integer('batch_size', None, 'Frames per solver call.')
  _SEED = flags.DEFINE_integer('seed', 0, 'Noise seed.')
  _OUTPUT = flags.DEFINE_string('output_json', None, 'Result file (written atomically); without '
                                 'it only the table is printed.')
  _TRACKERS = flags.DEFINE_string('trackers', 'full', 'Observed joints: full, a named subset '
                                  '(6, 10) or joint names A,B,C (ikgat with joint masks only).')
  _JOINT_DROPOUT = flags.DEFINE_float('joint_dropout', 0.0, 'Drop each observed joint with this '
                                      'probability (seeded by --seed).', lower_bound=0.0,
                                      upper_bound=1.0)
  _ORIENTATIONS = flags.DEFINE_list('orientations', [], 'Joints whose true world rotation is '
                                    'given (ikgat with orientation_inputs only).')
  _END_SITES = flags.DEFINE_boolean('end_sites', False, 'Give the true end sites of the leaves '
                                    '(ikgat with end_sites only; shards with end sites).')
  _FILTER = flags.DEFINE_enum('filter', None, ['none', 'one_euro'], 'Causal temporal filter of the '
                              'output rotations, per file (default: the checkpoint\'s, else none).')
  _FILTER_MIN_CUTOFF = flags.DEFINE_float('filter_min_cutoff', None,
                                          'One-Euro cutoff at rest (Hz).')
  _FILTER_BETA = flags.DEFINE_float('filter_beta', None, 'One-Euro cutoff slope (Hz per rad/s).')
  _FILTER_D_CUTOFF = flags.DEFINE_float('filter_d_cutoff', None, 'One-Euro velocity cutoff (Hz).')


def solver_config():
  overrides = {'iters': _ITERS.value, 'init_root': _INIT_ROOT.value,
               'optimizer': _OPTIMIZER.value, 'warm_iters': _WARM_ITERS.value,
               'window': _WINDOW.value, 'lr': _LR.value, 'w_z': _W_Z.value,
               'fit_translation': _FIT_TRANSLATION.value}
  return iterative_ik.SolverConfig(**{k: v for k, v in overrides.items() if v is not None})


def refine_config():
  if _REFINE.value <= 0:
    return None
  if _METHOD.value != 'ikgat':
    raise ValueError('--refine_iters applies to --method=ikgat only')
  return iterative_ik.refine_config(_REFINE.value, prior=_REFINE_PRIOR.value,
                                    lr=_REFINE_LR.value, w_anchor=_W_ANCHOR.value,
                                    anchor_relative=_ANCHOR_RELATIVE.value,
                                    fit_translation=_FIT_TRANSLATION.value,
                                    w_prior=_W_PRIOR.value)


def _check_method_flags() -> None:
  """A model flag its method does not use is refused (it was ignored: `--method=swing
  --checkpoint=RUN` measured swing IK and said nothing)."""
  method = _METHOD.value
  if _CHECKPOINT.value is not None and method != 'ikgat':
    raise ValueError(f'--checkpoint applies to --method=ikgat only, not {method}')
  if _PRIOR.value is not None and method not in ('ikgat', 'iterative'):
    raise ValueError(f'--prior applies to --method=iterative (and ikgat\'s refinement) only, '
                     f'not {method}')
  given = lambda names: [f'--{n}' for n in names if flags.FLAGS[n].present]  # noqa: E731
  iterative = method in ('iterative', 'iterative_noprior')
  solver_flags = given(('iters', 'warm_iters', 'window', 'lr', 'w_z', 'init_root', 'optimizer',
                        'warm_start'))
  if solver_flags and not iterative:
    raise ValueError(f'{", ".join(solver_flags)} set the iterative solver: they apply to '
                     f'--method=iterative|iterative_noprior only, not {method}')
  windowed = given(('warm_iters', 'window'))
  if windowed and not _WARM.value:
    raise ValueError(f'{", ".join(windowed)} set the warm start: give --warm_start too')
  refinement = given(('refine_lr', 'w_anchor', 'anchor_relative', 'refine_prior', 'w_prior'))
  if refinement and _REFINE.value <= 0:
    raise ValueError(f'{", ".join(refinement)} set the refinement: give --refine_iters > 0 too')
  if _PRIOR.value is not None and method == 'ikgat' and _REFINE.value <= 0:
    raise ValueError('--prior serves ikgat\'s refinement: give --refine_iters > 0 too')
  if _FIT_TRANSLATION.value is not None and not (iterative or _REFINE.value > 0):
    raise ValueError('--fit_translation applies to the iterative solvers and the refinement '
                     '(--refine_iters > 0)')


def _mirror() -> bool:
  if _MIRROR.value and _METHOD.value != 'ikgat':
    raise ValueError('--mirror applies to --method=ikgat only')
  return _MIRROR.value


def temporal_filter(method_info: dict):
  """The method's default filter (an ikgat checkpoint's `temporal` config) under the flags; a
  filter parameter for no filter is refused (it did nothing)."""
  base = temporal.FilterConfig(**method_info.get('temporal', {}))
  config = temporal.with_overrides(base, _FILTER.value, _FILTER_MIN_CUTOFF.value,
                                   _FILTER_BETA.value, _FILTER_D_CUTOFF.value)
  params = [f'--{n}' for n in ('filter_min_cutoff', 'filter_beta', 'filter_d_cutoff')
            if flags.FLAGS[n].present]
  if params and not config.active:
    raise ValueError(f'{", ".join(params)} set the One-Euro filter, and there is none (the '
                     'checkpoint\'s is none): give --filter=one_euro too')
  return config


@fail_on_user_error
def main(argv):
  del argv
  out = Path(_OUTPUT.value) if _OUTPUT.value else None
  if out is not None and out.parent and not out.parent.exists():
    raise FileNotFoundError(f'output directory {out.parent} does not exist')
  _check_method_flags()
  ds = data.load_shards(_DATA.value, _SPLIT.value)
  train_data = (data.load_shards(_DATA.value, 'train') if _METHOD.value == 'mean_pose' else None)
  method = evaluation.make_method(_METHOD.value, ds.rig, train_data=train_data,
                                  checkpoint=_CHECKPOINT.value, prior=_PRIOR.value,
                                  solver=solver_config(), warm_start=_WARM.value,
                                  chunk=_BATCH.value, refine=refine_config(),
                                  mirror=_mirror(), matmul_precision=_PRECISION.value,
                                  size_normalization=_SIZE.value)
  result = evaluation.evaluate(method, ds, ds.rig, max_frames=_MAX_FRAMES.value,
                               noise_mm=_NOISE.value, seed=_SEED.value,
                               temporal_filter=temporal_filter(method.info),
                               sparse=evaluation.SparseInputs(
                                   _TRACKERS.value, _JOINT_DROPOUT.value,
                                   tuple(_ORIENTATIONS.value), _SEED.value,
                                   end_sites=_END_SITES.value),
                               subject_calibration=_SUBJECT_CAL.value,
                               offsets=_OFFSETS.value, subject_scale=_SUBJECT_SCALE.value)

  result['command'] = provenance.command_line()
  print(evaluation.markdown_table(result))
  if out is None:
    print('(no --output_json: the JSON with per-subject, per-file and per-joint errors was not '
          'written)')
    return
  atomic.write_json(out, result)
  print(f'wrote {out}')


if __name__ == '__main__':
  # Marked here, not at import: importing a main (tests do) must not make its flags
  # required for every other absl program in the same process.
  run_main(main, define_flags, required=['data', 'method'])
