"""Per-frame vs temporal IK-GAT on noisy input, side by side (issue K).

  python -m experiments.temporal_compare --data=/tmp/cmu --split=test \
      [--per_frame=checkpoints/ikgat_base] [--temporal=checkpoints/ikgat_temporal] \
      [--noise_mm=0,10,20,30] [--noiterative] [--latency_calls=2000] [--refine_iters=50] \
      [--temporal_filters=MIN_CUTOFF:BETA[:D_CUTOFF],...] --output_dir=DIR

Methods, every one on the same noisy frames (`evaluation.evaluate`, i.i.d. Gaussian noise per
coordinate, seed 0): the per-frame IK-GAT, the same with the causal One-Euro filter at its val
choice (docs/benchmarks/temporal.md: 1.5 Hz, beta 0.5, d_cutoff 1 Hz), the temporal (window)
IK-GAT, and the iterative solver (+ prior, 100 iterations, cold); with `refine_iters` > 0 (the
default, 50) also both IK-GAT models at their most accurate, mirror-averaged and refined with the
pose prior (`--mirror --refine_iters=50` in `experiments.evaluate`: each frame's solution refined
against that frame's points, so the window model's stays causal); each `--temporal_filters`
setting adds the temporal model's most accurate row again behind that causal One-Euro filter
(choose it on val). Columns: local rotation error, MPJPE (FK of the output on the true
offsets), jitter / ground truth's, and the input's own MPJPE. Then `IKSolver.step` latency (median and p99 ms over `latency_calls` calls, one stream) of
every IK-GAT variant. Pin the process to one core for the latency the issue asks for:
`taskset -c 0 python -m experiments.temporal_compare ...` (the JSON records the cores it had).
Writes DIR/temporal_compare.json and DIR/temporal_compare.md (atomically).
"""

import os
from pathlib import Path

import numpy as np
from absl import flags

from experiments import common
from experiments.common import fail_on_user_error, run_main
from ik_gat_jax import data, evaluation, inference, iterative_ik, provenance, temporal
from ik_gat_jax.io import atomic
from ik_gat_jax.solver import IKSolver

_DATA = flags.DEFINE_string('data', None, 'Shard directory.')
_SPLIT = flags.DEFINE_string('split', 'test', 'Split to evaluate (choose on val).')
_PER_FRAME = flags.DEFINE_string('per_frame', None, 'Per-frame IK-GAT (default: shipped).')
_TEMPORAL = flags.DEFINE_string('temporal', None, 'Window IK-GAT (default: '
                                'checkpoints/ikgat_temporal).')
_PRIOR = flags.DEFINE_string('prior', None, 'Pose prior of the iterative solver (default: '
                             'shipped).')
_NOISE = flags.DEFINE_list('noise_mm', ['0', '10', '20', '30'], 'Input noise levels (mm).')
_ITERATIVE = flags.DEFINE_boolean('iterative', True, 'Include the iterative solver.')
_MAX_FRAMES = flags.DEFINE_integer('max_frames', None, 'Evaluate about this many frames: each '
                                   'file its share, rounded up (up to one more per file; '
                                   'evaluation.select_frames); 0: all.')
_CALLS = flags.DEFINE_integer('latency_calls', 2000, 'step() calls per latency measurement.')
_REFINE = flags.DEFINE_integer('refine_iters', 50, 'Also both IK-GAT models mirror-averaged and '
                               'refined with this many iterations and the pose prior (0: not).')
_FILTERS = flags.DEFINE_list('temporal_filters', [], 'One-Euro settings MIN_CUTOFF:BETA[:D_CUTOFF] '
                             '(Hz, Hz per rad/s, Hz; d_cutoff 1 by default) on the temporal '
                             'model\'s most accurate row (mirror + refine), each its own row.')
_OUTPUT = flags.DEFINE_string('output_dir', None, 'Output directory.')

ONE_EURO = temporal.FilterConfig(kind='one_euro', min_cutoff=1.5, beta=0.5, d_cutoff=1.0)
SHIPPED_TEMPORAL = Path(inference.SHIPPED_IKGAT).parent / 'ikgat_temporal'


def input_mpjpe_mm(ds, idx: np.ndarray, noise_mm: float) -> float:
  """Mean joint distance (mm) of the noisy input from the truth (what a solution's MPJPE must
  beat): the frames and noise `evaluation.evaluate` uses (seed 0), root excluded."""
  clean = np.asarray(ds.positions[idx])
  noisy = evaluation.add_noise(clean, noise_mm, 0)
  return float(1e3 * np.linalg.norm(noisy - clean, axis=-1)[:, 1:].mean())


def parse_filter(spec: str) -> temporal.FilterConfig:
  """`'3:0.5'` or `'3:0.5:2'` -> the One-Euro `FilterConfig` (min_cutoff, beta, d_cutoff)."""
  parts = spec.split(':')
  try:
    values = [float(x) for x in parts]
  except ValueError:
    values = []
  if len(values) not in (2, 3):
    raise ValueError(f'--temporal_filters: expected MIN_CUTOFF:BETA[:D_CUTOFF], got {spec!r}')
  return temporal.FilterConfig('one_euro', *values)


def markdown(rows: list[dict], latency: dict) -> str:
  out = ['| input noise (mm) | method | local rot err (deg) | MPJPE (mm) | input MPJPE (mm) | '
         'jitter / GT |', '|---:|---|---:|---:|---:|---:|']
  for r in rows:
    out.append(f"| {r['noise_mm']:g} | {r['method']} | {r['local_rot_err_deg']:.2f} | "
               f"{r['mpjpe_mm']:.1f} | {r['input_mpjpe_mm']:.1f} | {r['jitter_ratio']:.2f} |")
  out += ['', '| `step` latency | median (ms) | p99 (ms) |', '|---|---:|---:|']
  for name, s in latency.items():
    out.append(f"| {name} | {s['median_ms']:.3f} | {s['p99_ms']:.3f} |")
  return '\n'.join(out) + '\n'


@fail_on_user_error
def main(argv):
  del argv
  out_dir = Path(_OUTPUT.value)
  noise_levels = common.noise_levels(_NOISE.value)
  ds = data.load_shards(_DATA.value, _SPLIT.value)
  rig = ds.rig
  per_frame = _PER_FRAME.value or str(inference.SHIPPED_IKGAT)
  temporal_ckpt = _TEMPORAL.value or str(SHIPPED_TEMPORAL)
  if _TEMPORAL.value is None and not SHIPPED_TEMPORAL.exists():
    raise ValueError(f'no window model at {SHIPPED_TEMPORAL} (none is shipped): pass '
                     '--temporal=RUN, a run of experiments/configs/temporal.py')
  methods = {
      'IK-GAT per-frame': (evaluation.make_method('ikgat', rig, checkpoint=per_frame),
                           temporal.FilterConfig()),
      'IK-GAT per-frame + One-Euro': (evaluation.make_method('ikgat', rig, checkpoint=per_frame),
                                      ONE_EURO),
      'IK-GAT temporal': (evaluation.make_method('ikgat', rig, checkpoint=temporal_ckpt),
                          temporal.FilterConfig()),
  }
  n = _REFINE.value
  best = {}  # name -> (checkpoint, solver keywords) of the mirrored and refined rows
  if n > 0:
    refine = iterative_ik.refine_config(n, prior=True)
    for label, path in (('per-frame', per_frame), ('temporal', temporal_ckpt)):
      name = f'IK-GAT {label} + mirror + refine{n}'
      methods[name] = (evaluation.make_method('ikgat', rig, checkpoint=path, refine=refine,
                                              mirror=True), temporal.FilterConfig())
      best[name] = (path, {'mirror': True, 'refine_iters': n})
  for filt in (parse_filter(f) for f in _FILTERS.value):
    base_name = f'IK-GAT temporal + mirror + refine{n}' if n > 0 else 'IK-GAT temporal'
    name = (f'{base_name} + One-Euro {filt.min_cutoff:g} Hz, beta {filt.beta:g}, '
            f'd {filt.d_cutoff:g} Hz')
    methods[name] = (methods[base_name][0], filt)
    best[name] = (temporal_ckpt, {**best.get(base_name, (None, {}))[1], 'temporal_filter': filt})
  if _ITERATIVE.value:
    methods['iterative + prior, 100 it, cold'] = (
        evaluation.make_method('iterative', rig, prior=_PRIOR.value), temporal.FilterConfig())
  idx = evaluation.select_frames(ds, _MAX_FRAMES.value)
  rows, results = [], {}
  for noise in noise_levels:
    base = input_mpjpe_mm(ds, idx, noise)
    for name, (method, filt) in methods.items():
      r = evaluation.evaluate(method, ds, rig, max_frames=_MAX_FRAMES.value, noise_mm=noise,
                              temporal_filter=filt)
      row = {'noise_mm': noise, 'method': name, 'input_mpjpe_mm': base,
             **{k: r[k] for k in ('local_rot_err_deg', 'mpjpe_mm', 'jitter_ratio',
                                  'jitter_deg_s2', 'gt_jitter_deg_s2', 'frames_per_s')},
             'per_part': {p: v['local_rot_err_deg'] for p, v in r['per_part'].items()}}
      rows.append(row)
      results[f'{name} @ {noise:g} mm'] = r
      print(f"{noise:4g} mm  {name:36s} {row['local_rot_err_deg']:6.2f} deg  "
            f"{row['mpjpe_mm']:6.1f} mm (input {base:.1f})  jitter x{row['jitter_ratio']:.2f}",
            flush=True)
  latency = {}
  timed = [('IK-GAT per-frame', per_frame, {'temporal_filter': temporal.FilterConfig()}),
           ('IK-GAT per-frame + One-Euro', per_frame, {'temporal_filter': ONE_EURO}),
           ('IK-GAT temporal', temporal_ckpt, {'temporal_filter': temporal.FilterConfig()})]
  timed += [(name, path, kw) for name, (path, kw) in best.items()]
  for name, path, kw in timed:
    solver = IKSolver.from_checkpoint(path, fps=ds.fps, **kw)
    latency[name] = solver.latency_stats(n=_CALLS.value)
    print(f"step {name}: median {latency[name]['median_ms']:.3f} ms, p99 "
          f"{latency[name]['p99_ms']:.3f} ms", flush=True)
  summary = {'rows': rows, 'latency': latency, 'cores': sorted(os.sched_getaffinity(0)),
             'split': ds.split, 'per_frame': per_frame, 'temporal': temporal_ckpt,
             'one_euro': ONE_EURO.to_dict(), 'command': provenance.command_line(),
             'provenance': provenance.provenance(**provenance.data_provenance(ds))}
  out_dir.mkdir(parents=True, exist_ok=True)  # now, not before a refusal (left it empty)
  atomic.write_json(out_dir / 'temporal_compare.json', {**summary, 'results': results})
  atomic.write_text(out_dir / 'temporal_compare.md', markdown(rows, latency))
  print(markdown(rows, latency))
  print(f'wrote {out_dir}/temporal_compare.json and .md')


if __name__ == '__main__':
  flags.mark_flags_as_required(['data', 'output_dir'])
  run_main(main)
