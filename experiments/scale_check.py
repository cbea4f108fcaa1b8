"""Scale check (DESIGN section 8): N devices train like 1, checkpoints move between meshes,
hosts read disjoint slices, and the prefetched memory-mapped loader covers each epoch once.

  python -m experiments.scale_check --data=DIR --cpu_devices=8 [--steps=20] [--json=out.json]

--cpu_devices=N simulates N CPU devices (it sets JAX_PLATFORMS=cpu and
XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts its backend: importing
JAX does not, the first `jax.devices()` does); without it the check
uses the machine's own devices (e.g. all GPUs of a host). Three runs of the test config (tiny
model, dropout and augmentation on, batch 32) on the train split of DIR:
  all:     N devices for --steps steps (interrupted half way and resumed on N devices);
  one:     1 device for --steps steps;
  resumed: a copy of `all` at the half-way checkpoint, resumed on 1 device.
The three loss curves must agree (rtol 1e-4: only float summation order differs), the half-way
checkpoint must restore bit-identically on N devices and on 1. Prints one JSON object on the
last line (`ok` says whether every check passed). About a minute on a 2-core CPU.

--processes=P (with --cpu_devices=N) adds a fourth run, `multi`: P local processes joined by
`jax.distributed` (coordinator on localhost), N/P CPU devices each, one global mesh of N devices,
each process reading its own rows of every batch; its curve must match too (about 30 s more).
"""

import json
import os
from pathlib import Path
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from absl import app, flags, logging
import jax
import ml_collections
import numpy as np

from experiments.common import run_main
from experiments.configs import test as test_config
from ik_gat_jax import checkpointing, data, inference
from ik_gat_jax.absl_main import terminate_as_interrupt
from ik_gat_jax import input_pipeline as ip
from ik_gat_jax import train
from ik_gat_jax.io import atomic

_DATA = flags.DEFINE_string('data', None, 'Shard directory with a train split.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 0, 'Simulate this many CPU devices (0: the '
                                    "machine's devices).")
_STEPS = flags.DEFINE_integer('steps', 20, 'Training steps per run (even).')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Where the runs go (default: a temporary '
                               'directory, removed after).')
_JSON = flags.DEFINE_string('json', None, 'Also write the result JSON here.')
_PROCESSES = flags.DEFINE_integer('processes', 1, 'Also train on this many local processes '
                                  '(needs --cpu_devices).')
_WORKER = flags.DEFINE_bool('worker', False, 'Internal: one process of the --processes run.')

RTOL = 1e-4


def check_process_slices(dataset, batch_size: int, seed: int, processes: int = 2,
                         steps: int = 3) -> dict:
  """Simulated hosts read disjoint rows whose concatenation is the global batch, every step."""
  ok = True
  for step in range(steps):
    full = ip.batch_indices(step, batch_size, len(dataset), seed)
    parts = [next(ip.host_batches(dataset, batch_size, seed, step, step + 1, p, processes))
             for p in range(processes)]
    idx = [part[1] for part in parts]
    ok &= all(len(set(a) & set(b)) == 0 for i, a in enumerate(idx) for b in idx[i + 1:])
    ok &= bool((np.concatenate(idx) == full).all())
    ok &= bool((np.concatenate([part[2]['positions'] for part in parts])
                == np.asarray(dataset.positions)[full]).all())
  return {'processes': processes, 'steps': steps, 'ok': bool(ok)}


def check_epoch_once(dataset, batch_size: int, seed: int) -> dict:
  """The prefetched loader yields each frame exactly once per epoch, in the stateless order."""
  n = len(dataset)
  steps = -(-n // batch_size)
  with ip.Prefetcher(ip.host_batches(dataset, batch_size, seed, 0, steps), depth=3) as batches:
    got = list(batches)
  idx = np.concatenate([g[1] for g in got])[:n]
  rows_match = all((g[2]['positions'] == np.asarray(dataset.positions)[g[1]]).all() for g in got)
  in_order = [g[0] for g in got] == list(range(steps))
  once = sorted(idx.tolist()) == list(range(n))
  return {'frames': n, 'steps': steps, 'ok': bool(once and rows_match and in_order)}


def _train_log(workdir: Path) -> list[dict]:
  rows = [json.loads(line) for line in (workdir / 'log.jsonl').read_text().splitlines()]
  return [r for r in rows if r['kind'] == 'train']


def _losses(workdir: Path) -> dict[int, float]:
  return {r['step']: r['loss'] for r in _train_log(workdir)}


def check_indivisible_batch(config, mesh, workdir: Path) -> str:
  """The error a batch that does not split over the devices gets (before any work; '' if
  there is none, as on one device)."""
  bad = ml_collections.ConfigDict(config.to_dict())
  bad.train.batch_size = mesh.size * 4 + 1  # divisible by no mesh of 2 or more (+2 was, by 2)
  try:
    train.train_and_evaluate(bad, workdir, log=lambda msg: None, mesh=mesh)
  except ValueError as e:
    return str(e)
  return ''


class _PlannedStop(KeyboardInterrupt):
  """The check's own stop half way (the trainer saves, as for Ctrl-C); a user's Ctrl-C or
  SIGTERM is not one, and ends the check (it was taken for the planned stop)."""


def _stop_at(step: int):
  def log(msg: str) -> None:
    if msg.startswith(f'step {step}/'):
      raise _PlannedStop
  return log


def _train(config, workdir: Path, mesh, stop_at: int | None = None) -> None:
  log = _stop_at(stop_at) if stop_at else (lambda msg: None)
  try:
    train.train_and_evaluate(config, workdir, log=log, mesh=mesh)
  except _PlannedStop:
    assert stop_at is not None


def check_restore(config, checkpoint_dir: Path, meshes: dict) -> dict:
  """Restores one checkpoint onto each mesh; the arrays must be identical and on that mesh."""
  ds = data.load_shards(config.data, 'train')
  _, state = train.init_state(inference.IKGAT_TASK, config, ds.rig, ds)
  ckpt = checkpointing.Checkpointer(checkpoint_dir, create=False)
  trees, devices = {}, {}
  for name, mesh in meshes.items():
    abstract = checkpointing.abstract_like(train.saved_part(train.place_state(state, mesh)))
    trees[name], _ = ckpt.restore(abstract)
    devices[name] = sorted({len(x.sharding.device_set) for x in jax.tree.leaves(trees[name])})
  leaves = [jax.tree.leaves(t) for t in trees.values()]
  same = all(len(a) == len(leaves[0]) and all((np.asarray(x) == np.asarray(y)).all()
                                               for x, y in zip(a, leaves[0])) for a in leaves)
  on_mesh = all(devices[name] == [meshes[name].size] for name in meshes)
  return {'step': ckpt.latest_step(), 'same_params': bool(same), 'devices_per_leaf': devices,
          'ok': bool(same and on_mesh)}


def _compare(a: dict, b: dict) -> float:
  steps = sorted(a)
  assert steps == sorted(b), (steps, sorted(b))
  x, y = np.array([a[s] for s in steps]), np.array([b[s] for s in steps])
  return float(np.max(np.abs(x - y) / np.abs(y)))


def _config(data_dir: str, steps: int):
  c = test_config.get_config()
  c.data = data_dir
  c.train.update(steps=steps, batch_size=32, log_every=1, eval_every=steps,
                 checkpoint_every=10 * steps, val_frames=64, eval_batch_size=64)
  c.augment.noise_mm = 5.0  # every random stream on: dropout, mirror, scale, yaw, noise
  return c


def run_processes(data_dir: str, workdir: Path, steps: int, processes: int, devices: int,
                  timeout: float = 600) -> float:
  """Trains run `multi` on `processes` local processes of `devices / processes` CPU devices."""
  with socket.socket() as s:  # a free port for the coordinator
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  t = time.time()
  children = []
  for p in range(processes):
    env = {**os.environ, 'JAX_COORDINATOR_ADDRESS': f'localhost:{port}',
           'JAX_NUM_PROCESSES': str(processes), 'JAX_PROCESS_ID': str(p)}
    cmd = [sys.executable, '-m', 'experiments.scale_check', f'--data={data_dir}',
           f'--workdir={workdir}', f'--steps={steps}', f'--cpu_devices={devices // processes}',
           '--worker']
    children.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True))
  try:
    for child in children:
      _, err = child.communicate(timeout=max(timeout - (time.time() - t), 1))
      if child.returncode:
        raise RuntimeError(f'process {children.index(child)} failed:\n{err[-3000:]}')
  finally:
    for child in children:  # one failed: the others would wait on it for ever
      if child.poll() is None:
        child.kill()
  return time.time() - t


def run_check(data_dir: str, workdir: Path, steps: int, processes: int = 1) -> dict:
  """Every check; returns the JSON-able result (see the module docstring)."""
  c = _config(data_dir, steps)
  t0 = time.time()
  ds = data.load_shards(data_dir, 'train')
  out = {'devices': jax.device_count(), 'platform': jax.devices()[0].platform,
         'process_slices': check_process_slices(ds, 32, c.seed),
         'epoch_once': check_epoch_once(ds, 32, c.seed)}
  meshes = {'all': train.make_mesh(), 'one': train.make_mesh(jax.devices()[:1])}
  half, seconds = steps // 2, {'pipeline_checks': round(time.time() - t0, 1)}

  def timed(name, fn, *args, **kwargs):
    t = time.time()
    result = fn(*args, **kwargs)
    seconds[name] = round(time.time() - t, 1)
    return result

  timed('all_first_half', _train, c, workdir / 'all', meshes['all'], stop_at=half)
  out['restore'] = timed('restore', check_restore, c, workdir / 'all' / 'checkpoints' / 'latest',
                         meshes)
  shutil.copytree(workdir / 'all', workdir / 'resumed')
  timed('all_second_half', _train, c, workdir / 'all', meshes['all'])
  timed('resumed_on_one', _train, c, workdir / 'resumed', meshes['one'])
  timed('one', _train, c, workdir / 'one', meshes['one'])
  out['pipeline_frames_per_s'] = _train_log(workdir / 'one')[-1]['pipeline_frames_per_s']
  out['indivisible_batch_error'] = check_indivisible_batch(
      c, meshes['all'], workdir / 'indivisible')
  names = ['all', 'one', 'resumed']
  if processes > 1:
    timed('multi', run_processes, data_dir, workdir, steps, processes, jax.device_count())
    names.append('multi')
  curves = {name: _losses(workdir / name) for name in names}
  out['steps'] = sorted(curves['one'])
  out['loss'] = {name: [curve[s] for s in out['steps']] for name, curve in curves.items()}
  out['max_rel_diff'] = {f'{name}_vs_one': _compare(curves[name], curves['one'])
                         for name in names if name != 'one'}
  out['losses_match'] = all(v <= RTOL for v in out['max_rel_diff'].values())
  out['seconds'] = {**seconds, 'total': round(time.time() - t0, 1)}
  out['ok'] = all((out['process_slices']['ok'], out['epoch_once']['ok'], out['restore']['ok'],
                   out['losses_match'], out['pipeline_frames_per_s'] > 0,
                   meshes['all'].size == 1 or 'not divisible' in out['indivisible_batch_error']))
  return out


def _simulate_cpu_devices(n: int) -> None:
  """Before JAX starts: the CPU platform with `n` devices."""
  os.environ['JAX_PLATFORMS'] = 'cpu'
  flags_ = [f for f in os.environ.get('XLA_FLAGS', '').split()
            if not f.startswith('--xla_force_host_platform_device_count')]
  os.environ['XLA_FLAGS'] = ' '.join(flags_ + [f'--xla_force_host_platform_device_count={n}'])


def main(argv):
  del argv
  if _CPU_DEVICES.value:
    _simulate_cpu_devices(_CPU_DEVICES.value)
  logging.set_verbosity(logging.WARNING)  # orbax's per-save INFO lines
  if _WORKER.value:
    train.initialize_distributed('on')
    _train(_config(_DATA.value, _STEPS.value), Path(_WORKDIR.value) / 'multi', train.make_mesh())
    return
  if _PROCESSES.value > 1 and (not _CPU_DEVICES.value or _CPU_DEVICES.value % _PROCESSES.value):
    raise app.UsageError('--processes needs --cpu_devices, a multiple of it')
  if _STEPS.value < 2 or _STEPS.value % 2:
    raise app.UsageError('--steps must be even and at least 2')
  workdir = Path(_WORKDIR.value or tempfile.mkdtemp(prefix='scale_check_'))
  if workdir.exists() and any(workdir.iterdir()):
    raise app.UsageError(f'--workdir {workdir} is not empty')
  try:
    with terminate_as_interrupt():
      result = run_check(_DATA.value, workdir, _STEPS.value, _PROCESSES.value)
  except KeyboardInterrupt:
    print('interrupted: nothing checked (rerun the command)', file=sys.stderr)
    sys.exit(130)
  finally:
    if _WORKDIR.value is None:
      shutil.rmtree(workdir, ignore_errors=True)
  text = json.dumps(result)
  if _JSON.value:
    atomic.write_text(_JSON.value, text)
  print(text)
  sys.exit(0 if result['ok'] else 1)


if __name__ == '__main__':
  # Marked here, not at import: importing a main (tests do) must not make its flags
  # required for every other absl program in the same process.
  flags.mark_flags_as_required(['data'])
  run_main(main)
