"""The main job (`make demo`): CMU mocap -> shards -> bone-frame check -> a short IK-GAT run.

  python -m experiments.demo [--bvh_dir=../shared/data/cmu] [--output_dir=outputs/demo]
      [--steps=300]

1. Converts the CMU BVH files to training shards (every file verified against a naive FK).
2. Prints each subject's largest bone-frame angle to the rig template and writes PNGs of the
   rest pose with its bone frames.
3. Trains a small IK-GAT for `--steps` steps (resumable) and prints validation errors.
Outputs go to --output_dir (ignored by git); rerunning reuses what is there.
"""

from pathlib import Path

from absl import app, flags

from experiments.common import fail_on_user_error

_BVH = flags.DEFINE_string('bvh_dir', str(Path(__file__).resolve().parents[2] / 'shared' /
                                          'data' / 'cmu'), 'Directory of CMU BVH files.')
_OUT = flags.DEFINE_string('output_dir', 'outputs/demo', 'Where shards, plots and runs go.')
_STEPS = flags.DEFINE_integer('steps', 300, 'Training steps of the short IK-GAT run.')


def _section(title: str) -> None:
  print(f'\n== {title} ==', flush=True)


@fail_on_user_error
def main(argv):
  del argv
  from data_prep import conversion
  from experiments import bone_frames_report
  from experiments.configs import default
  from ik_gat_jax import data, train
  bvh_dir, out = Path(_BVH.value), Path(_OUT.value)
  if not bvh_dir.is_dir():
    raise FileNotFoundError(f'no BVH directory at {bvh_dir}: pass --bvh_dir=DIR (the CMU files '
                            'of ../shared/data/cmu, or your own with a joint map)')
  shards = out / 'cmu_shards'
  _section(f'1. BVH -> shards ({bvh_dir} -> {shards})')
  if (shards / 'summary.json').exists():
    print('shards already there; reusing them')
  else:
    s = conversion.convert(bvh_dir, 'cmu_body', shards, log=lambda m: print(m, flush=True))
    print(f"frames per split {s['frames']}, FK max error {s['fk_max_error_m']:.2e} m")
  _section('2. Bone frames per subject vs the rig template')
  for r in bone_frames_report.subject_report(shards):
    print(f"subject {r['subject']}: largest angle {r['max_angle_deg']:.1f} deg at "
          f"{r['joint']}, mean {r['mean_angle_deg']:.1f} deg")
  from ik_gat_jax import plots
  ds = data.load_shards(shards, 'train')
  plots.plot_rest_bone_frames(ds.rig.template(), ds.rig, out / 'rest_template.png')
  print(f'wrote {out / "rest_template.png"}')
  _section(f'3. IK-GAT (small), {_STEPS.value} steps')
  config = default.get_config()
  config.data = str(shards)
  config.model.update(size='small', output_space='mixed')
  config.train.update(steps=_STEPS.value, eval_every=max(_STEPS.value // 3, 1),
                      log_every=max(_STEPS.value // 10, 1), warmup_steps=50,
                      checkpoint_every=100, lr=2e-3)
  val = train.train_and_evaluate(config, out / 'run_small')
  print('validation: ' + ', '.join(f'{k} {v:.2f}' for k, v in sorted(val.items())))


if __name__ == '__main__':
  app.run(main)
