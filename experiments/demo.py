"""The main job (`make demo`): solve a motion clip with IK-GAT and with iterative IK, side by side.

  python -m experiments.demo [--input=CLIP.bvh] [--output_dir=outputs/demo] [--iters=100]

- Input: `--input` (a BVH the cmu_body joint map reads, e.g. any file of ../shared/data/cmu),
  else the CMU test clip 07_05 (unseen subject) when ../shared/data/cmu is present, else motion
  generated from the shipped pose prior (said in the output: it favours the prior-based solver).
- Solves it with the shipped IK-GAT (checkpoints/ikgat_base), the iterative solver with the
  shipped prior (cold and warm start), and swing-only IK; prints errors and frames/s side by side
  (DESIGN section 7 metrics against the clip's true rotations).
- Writes under --output_dir the IK-GAT solution as BVH (cm) and GLB (glTF 2.0 binary with the
  box body; both open in Blender), a PNG of frames 0, 30, 60 and a GIF of a few frames: the
  box body of io/gltf.py posed by the ground truth, IK-GAT and the cold iterative solver side
  by side, each box coloured by its joint's local rotation error (degrees), so a twisted
  forearm shows.
"""

from pathlib import Path
import tempfile

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from data_prep import conversion
from experiments.common import fail_on_user_error, run_main
from ik_gat_jax import (bone_frames, checkpointing, data, evaluation, inference, input_pipeline,
                        iterative_ik, kinematics, plots, prior_task, rotations, skeleton, solve)
from ik_gat_jax import solver as solver_lib
from ik_gat_jax.io import retarget

CMU_DIR = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'cmu'
_INPUT = flags.DEFINE_string('input', None, 'A BVH clip (cmu_body joint map); default: CMU 07_05.')
_OUT = flags.DEFINE_string('output_dir', 'outputs/demo', 'Where the BVH, GLB, PNG and GIF go.')
_ITERS = flags.DEFINE_integer('iters', 100, 'Iterations of the iterative solver (cold start).')
_FRAMES = flags.DEFINE_integer('synthetic_frames', 240, 'Frames of generated motion (no data).')


def clip_dataset(bvh_path: Path, workdir: Path):
  """A one-clip shard directory (verified conversion) and its split 'all'."""
  # One clip, one subject, whatever its file is called (the joint map's regex wants CMU's
  # '07_05' names).
  conversion.convert(bvh_path, 'cmu_body', workdir, split='all', subject_regex=r'^.',
                     log=lambda m: None)
  ds = data.load_shards(workdir, 'all')
  check_cmu_format(bvh_path, ds)
  return ds


def check_cmu_format(bvh_path: Path, ds) -> None:
  """Refuses, before anything is solved, a clip the demo cannot compare: CMU's joint names in
  other units (bones 4x off the template's) or another bind (rest bones a median 20 degrees or
  more from the template's: its true rotations are not the model's kind). Both solve with
  `ik_gat_jax.solve` (--units, --reference_pose)."""
  offsets = np.asarray(ds.offsets[0], np.float64)
  problem = solver_lib.units_problem(np.asarray(ds.positions, np.float64), ds.rig,
                                     retarget.load_joint_map('cmu_body').units)
  angles = solver_lib.rest_pose_angles(offsets, ds.rig)
  median = float(np.nanmedian(angles)) if np.isfinite(angles).any() else 0.0
  if problem is None and median < solver_lib.REST_POSE_WARN_DEG:
    return
  why = problem or (f'its rest bones point a median {median:.0f} degrees from the template\'s '
                    '(another bind)')
  raise ValueError(f'{bvh_path} is not a CMU-format BVH the demo can compare ({why}); solve it '
                   'with python -m ik_gat_jax.solve (--units, --reference_pose)')


def synthetic_dataset(n: int, seed: int = 0):
  """Motion decoded from the shipped prior along a smooth latent path, on the template body."""
  prior, _ = inference.load_model(inference.SHIPPED_PRIOR, task=prior_task.PRIOR_TASK)
  rig = prior_task_rig(inference.SHIPPED_PRIOR)
  keys = jax.random.normal(jax.random.key(seed), (n // 60 + 2, prior.config.latent))
  t = np.linspace(0, len(keys) - 1.001, n)
  i, f = t.astype(int), (t % 1)[:, None]
  z = (1 - f) * keys[i] + f * keys[i + 1]
  off = rig.template().astype(np.float32)
  B = np.asarray(bone_frames.bone_frames(jnp.asarray(off), rig))[None]
  local = np.asarray(prior.decode(jnp.asarray(z), jnp.asarray(B)))  # B: a bone-chart prior's
  yaw = rotations.axis_rotation('y', jnp.linspace(0, np.pi, n))
  local = np.concatenate([np.asarray(yaw)[:, None], local], axis=1).astype(np.float32)
  root = np.stack([np.linspace(0, 1, n), np.full(n, 0.95), np.zeros(n)], -1).astype(np.float32)
  G, p = kinematics.forward_kinematics(jnp.asarray(local), jnp.asarray(off), rig.parents, root)
  zeros = np.zeros(n, np.int32)
  return data.Dataset(
      path=Path('synthetic'), split='all', rig=rig, positions=np.asarray(p), local_rot=local,
      global_rot=np.asarray(G), subject_id=zeros, file_id=zeros, frame_index=np.arange(n),
      offsets=off[None], bone_frames=B, files=({'file': 'prior_samples', 'split': 'all'},),
      subjects=({'name': 'template'},), summary={'fps': 30.0})


def prior_task_rig(path):
  meta = checkpointing.Checkpointer(path, create=False).restore_meta()
  return skeleton.Rig.from_json(meta['rig'])


def compare(ds, iters: int) -> tuple[list[dict], list]:
  """The result rows and the methods (IK-GAT, cold iterative, warm iterative, swing)."""
  solver = iterative_ik.SolverConfig(iters=iters)
  methods = [('IK-GAT (base)', evaluation.make_method('ikgat', ds.rig)),
             (f'iterative + prior, {iters} it, cold',
              evaluation.make_method('iterative', ds.rig, solver=solver)),
             (f'iterative + prior, {iters} it cold / {solver.warm_iters} warm',
              evaluation.make_method('iterative', ds.rig, solver=solver, warm_start=True)),
             ('swing-only IK', evaluation.make_method('swing', ds.rig))]
  rows = []
  for label, m in methods:
    print(f'solving with {label} ...', flush=True)
    rows.append({'label': label, **evaluation.evaluate(m, ds, ds.rig)})
  return rows, [m for _, m in methods]


def posed_bodies(ds, rows: list[dict], methods: list) -> list:
  """`plots.Body` of the ground truth, IK-GAT and the cold iterative solver over the whole clip:
  world rotations and FK positions (each method's local rotations on the clip's offsets, from
  the true root position), per-joint local rotation error in degrees."""
  batch = input_pipeline.gather_batch(ds, np.arange(len(ds.positions)))
  true_local = jnp.asarray(batch['local_rot'])
  offsets, root = jnp.asarray(batch['offsets']), jnp.asarray(batch['positions'][:, 0])
  G, p = kinematics.forward_kinematics(true_local, offsets, ds.rig.parents, root)
  bodies = [plots.Body('ground truth', np.asarray(G), np.asarray(p))]
  for row, method in zip(rows[:2], methods[:2]):
    local, _, _ = evaluation.run_chunked(method.solve, batch['positions'], batch['offsets'],
                                         method.chunk)  # the shapes evaluate compiled
    G, p = kinematics.forward_kinematics(jnp.asarray(local), offsets, ds.rig.parents, root)
    err = np.degrees(np.asarray(rotations.geodesic_angle(jnp.asarray(local), true_local)))
    label = f"{row['label']}: clip mean {row['local_rot_err_deg']:.1f} deg"
    bodies.append(plots.Body(label, np.asarray(G), np.asarray(p), err))
  return bodies


def print_table(rows: list[dict]) -> None:
  print('\n| method | local (deg) | twist (deg) | swing (deg) | root (deg) | MPJPE (mm) | frames/s |')
  print('|---|---:|---:|---:|---:|---:|---:|')
  for r in rows:
    print(f"| {r['label']} | {r['local_rot_err_deg']:.2f} | {r['twist_err_deg']:.2f} | "
          f"{r['swing_err_deg']:.2f} | {r['root_rot_err_deg']:.2f} | {r['mpjpe_mm']:.2f} | "
          f"{r['frames_per_s']:,.0f} |")
  ik, it = rows[0], rows[1]
  print(f"\nIK-GAT: {it['local_rot_err_deg'] / ik['local_rot_err_deg']:.1f}x lower local error "
        f"and {ik['frames_per_s'] / it['frames_per_s']:.2g}x the frames/s of the cold iterative "
        'solver (batched, compile excluded, this machine).')


@fail_on_user_error
def main(argv):
  del argv
  out = Path(_OUT.value)
  src = Path(_INPUT.value) if _INPUT.value else (CMU_DIR / '07_05.bvh')
  if _INPUT.value and src.exists() and not src.is_file():
    raise ValueError(f'--input {src} is not a file: the demo takes one BVH clip')
  if out.exists() and not out.is_dir():  # refused before a minute of solving, not after it
    raise ValueError(f'--output_dir {out} is a file: give a folder')
  with tempfile.TemporaryDirectory() as tmp:
    if src.exists():
      ds = clip_dataset(src, Path(tmp) / 'shards')
      print(f'clip: {src} (true rotations from its verified conversion)')
      solve_input = src
    else:
      if _INPUT.value:
        raise FileNotFoundError(f'input {src} does not exist')
      print(f'no CMU data at {CMU_DIR}: using {_FRAMES.value} frames generated from the shipped '
            'pose prior. NOTE: this motion comes from the prior itself, which favours the '
            'prior-based iterative solver.')
      ds = synthetic_dataset(_FRAMES.value)
      solve_input = Path(tmp) / 'synthetic_positions.npz'
      np.savez(solve_input, positions=np.asarray(ds.positions),
               joint_names=np.asarray(ds.rig.joint_names))
    print(f'{len(ds.positions)} frames, rig {ds.rig.name}')
    rows, methods = compare(ds, _ITERS.value)
    print_table(rows)
    stem = src.stem if src.exists() else 'synthetic'
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f'{stem}_ikgat.{ext}' for ext in ('bvh', 'glb')]
    for path in paths:
      solve.solve_file(solve_input, path, overwrite=True, bvh_units='cm',  # as said below
                       offsets_from=str(src) if src.exists() else None, log=lambda m: None)
    write_pictures(out, stem, ds, posed_bodies(ds, rows, methods))  # ds lives in tmp
  print(f"\nwrote {paths[0]} (IK-GAT solution, cm), {paths[1]} (the same as glTF with the box "
        f"body), {out / f'{stem}_frames.png'} and {out / f'{stem}_clip.gif'} (box bodies "
        'coloured by local rotation error)')


def write_pictures(out: Path, stem: str, ds, bodies: list) -> None:
  """The PNG (frames 0, 30, 60) and the GIF (every 6th frame of the first 90)."""
  T = len(ds.positions)
  offsets = np.asarray(ds.offsets[int(ds.subject_id[0])])
  shown = sorted({min(t, T - 1) for t in (0, 30, 60)})
  plots.plot_error_bodies(out / f'{stem}_frames.png', offsets, ds.rig, bodies, shown)
  plots.save_error_bodies_clip(out / f'{stem}_clip.gif', offsets, ds.rig, bodies,
                               range(0, min(T, 90), 6), fps=float(ds.fps))


if __name__ == '__main__':
  run_main(main)
