"""Several hosts going wrong, really: `experiments.train` processes on 127.0.0.1 joined by
`jax.distributed` (Gloo CPU collectives, one CPU device each, as tests/distributed_test.py).

A stop signal reaching one process of two stops both after the same step, with a checkpoint a
rerun resumes; processes holding other shards, or workdirs that are not one folder, are refused
in one line on every process; a cluster that does not form, or a launcher environment that
cannot work, is one line, not minutes of silence and a C++ abort.
"""

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ik_gat_jax import checkpointing, train

REPO = Path(__file__).resolve().parents[1]


def _quiet(msg):
  del msg


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _base_env(xla_level_flags) -> dict:
  base = {k: v for k, v in os.environ.items()
          if not k.startswith(('JAX_COORDINATOR', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID'))}
  base.update(JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1', XLA_FLAGS=' '.join(xla_level_flags))
  return base


def _start(args: list[list[str]], xla_level_flags, merge: bool = False
           ) -> list[subprocess.Popen]:
  """`experiments.train` with the tiny config, process p of len(args) with `args[p]`; `merge`:
  stderr into stdout."""
  port, base = _free_port(), _base_env(xla_level_flags)
  procs = []
  for p, extra in enumerate(args):
    env = {**base, 'JAX_COORDINATOR_ADDRESS': f'127.0.0.1:{port}',
           'JAX_NUM_PROCESSES': str(len(args)), 'JAX_PROCESS_ID': str(p),
           'JAX_CPU_COLLECTIVES_IMPLEMENTATION': 'gloo'}
    procs.append(subprocess.Popen(
        [sys.executable, '-m', 'experiments.train', '--config=experiments/configs/test.py',
         *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True,
        stderr=subprocess.STDOUT if merge else subprocess.PIPE))
  return procs


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
  """(exit status, stdout, stderr) of each; kills them all and fails past `timeout`."""
  out = []
  try:
    for p in procs:
      o, e = p.communicate(timeout=max(1.0, timeout))
      out.append((p.returncode, o, e))
  except subprocess.TimeoutExpired:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    pytest.fail(f'a process did not exit within {timeout} s')
  return out


def _errors(err: str) -> list[str]:
  return [x for x in err.splitlines() if x.strip()]


@pytest.fixture(scope='module')
def other_shards(cmu_dir, tmp_path_factory):
  """07_02 alone, as split 'train': other shards than `cmu_shards` (split, frames)."""
  from data_prep import conversion
  out = tmp_path_factory.mktemp('other_shards')
  conversion.convert(cmu_dir / '07_02.bvh', 'cmu_body', out, split='train', log=_quiet)
  return out


def test_a_signal_to_one_process_stops_both_after_one_step_with_a_checkpoint(
    cmu_shards, tmp_path, xla_level_flags):
  """SIGTERM to process 1 alone (the one that does not log) mid-run: both processes stop after
  the same step, save one checkpoint together, exit 130 and leave run.json 'interrupted' (the
  old trainer: process 0 went on into the next all-reduce, process 1 into the save; neither
  ever returned). A rerun resumes from that step and finishes."""
  workdir = tmp_path / 'run'
  cmd = [f'--data={cmu_shards}', f'--workdir={workdir}', '--steps=100000',
         '--config.train.log_every=1', '--config.train.eval_every=100000',
         '--config.train.checkpoint_every=100000']
  procs = _start([cmd, cmd], xla_level_flags, merge=True)
  lines: queue.Queue = queue.Queue()
  threading.Thread(target=lambda: [lines.put(x) for x in procs[0].stdout], daemon=True).start()
  seen, deadline = [], time.time() + 180
  while not any(x.startswith('step 3/') for x in seen) and time.time() < deadline:
    try:
      seen.append(lines.get(timeout=1))
    except queue.Empty:
      pass
  if not any(x.startswith('step 3/') for x in seen):
    for p in procs:
      os.killpg(p.pid, signal.SIGKILL)
    pytest.fail('process 0 printed no "step 3/" within 180 s:\n' + ''.join(seen)[-2000:])
  procs[1].send_signal(signal.SIGTERM)
  try:
    for p in procs:
      p.wait(timeout=60)
  except subprocess.TimeoutExpired:
    for p in procs:
      os.killpg(p.pid, signal.SIGKILL)
    pytest.fail('the processes did not exit within 60 s of SIGTERM to process 1')
  time.sleep(0.5)  # the reader thread's last lines
  out = ''.join(seen) + ''.join(lines.queue)
  assert [p.returncode for p in procs] == [130, 130], out[-2000:] + procs[1].stdout.read()
  run = json.loads((workdir / 'run.json').read_text())
  assert run['status'] == 'interrupted' and run['step'] >= 3, run
  assert checkpointing.Checkpointer(workdir / 'checkpoints' / 'latest',
                                    create=False).latest_step() == run['step']
  assert 'stop requested on another process: all stop here' in out
  assert f'interrupted at step {run["step"]}; checkpoint saved' in out
  rerun = subprocess.run(
      [sys.executable, '-m', 'experiments.train', '--config=experiments/configs/test.py',
       *cmd[:2], f'--steps={run["step"] + 1}'], cwd=REPO, env=_base_env(xla_level_flags),
      capture_output=True, text=True, timeout=300)
  assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
  assert f'resumed from {workdir / "checkpoints" / "latest"} at step {run["step"]}' in \
      rerun.stdout
  assert json.loads((workdir / 'run.json').read_text())['status'] == 'done'


def test_other_shards_or_workdirs_per_process_are_refused_in_one_line_on_each(
    cmu_shards, other_shards, tmp_path, xla_level_flags):
  """Started together, three pairs of processes, each pair refused at the start in one line on
  both processes, exit status 2, nothing trained (the old trainer: a pair with other shards
  trained on mixed batches, one with two workdirs hung in the first checkpoint save, one with
  missing shards on process 1 left process 0 waiting): process 1 with other shards; each
  process with its own workdir (folders that are not one, as on hosts without a shared file
  system); process 1 without shards."""
  (tmp_path / 'a').mkdir()
  (tmp_path / 'b').mkdir()
  pairs = {
      'data': ([f'--data={cmu_shards}', f'--workdir={tmp_path / "one"}'],
               [f'--data={other_shards}', f'--workdir={tmp_path / "one"}']),
      'workdir': ([f'--data={cmu_shards}', f'--workdir={tmp_path / "a" / "run"}'],
                  [f'--data={cmu_shards}', f'--workdir={tmp_path / "b" / "run"}']),
      'missing': ([f'--data={cmu_shards}', f'--workdir={tmp_path / "two"}'],
                  [f'--data={tmp_path / "none"}', f'--workdir={tmp_path / "two"}']),
  }
  started = {k: _start(list(v), xla_level_flags) for k, v in pairs.items()}
  results = {k: _finish(v, 240) for k, v in started.items()}
  for k, res in results.items():
    assert [rc for rc, _, _ in res] == [2, 2], (k, res)
  said = {k: [_errors(e) for _, _, e in res] for k, res in results.items()}
  for k, per_process in said.items():
    assert all(len(x) == 1 for x in per_process), (k, per_process)
  data = said['data']
  assert data[0][0] == ('error: the processes hold different shards: the split, frames of '
                        f"process 1 differ from process 0's (--data here: {cmu_shards}): give "
                        'every host a copy of the same shards')
  assert data[1][0].endswith(f'(--data here: {other_shards}): give every host a copy of the '
                             'same shards')
  for p, here in enumerate('ab'):
    assert said['workdir'][p][0] == (
        f'error: --workdir {tmp_path / here / "run"} is not shared by all 2 processes: process 1 '
        f'cannot see the file process 0 wrote there ({tmp_path / here} here); put it on a file '
        'system every host mounts at the same path (all processes write the checkpoints there '
        'together)')
  assert said['missing'][0][0] == ('error: process 1 could not load the shards (see the error '
                                   'there): every host needs a copy of the same shards')
  assert said['missing'][1][0] == f'error: shard directory {tmp_path / "none"} does not exist'
  # Nothing made or left behind: no workdir, no probe file.
  assert sorted(p.name for p in tmp_path.iterdir()) == ['a', 'b']
  assert not [p for x in 'ab' for p in (tmp_path / x).iterdir()]


def test_a_cluster_that_does_not_form_is_one_line_within_the_timeout(cmu_shards, tmp_path,
                                                                      xla_level_flags):
  """Process 1 of 2 with no coordinator at the address, --distributed_timeout=3: the line
  before connecting, then one line and exit status 2 within seconds (the old trainer: silence
  for 300 s, then JAX's C++ abort). --distributed with no cluster environment: one line."""
  base = _base_env(xla_level_flags)
  cmd = [sys.executable, '-m', 'experiments.train', f'--data={cmu_shards}',
         f'--workdir={tmp_path / "run"}']
  address = f'127.0.0.1:{_free_port()}'
  t = time.time()
  procs = [subprocess.Popen(cmd + ['--distributed_timeout=3'], cwd=REPO, text=True, env={
      **base, 'JAX_COORDINATOR_ADDRESS': address, 'JAX_NUM_PROCESSES': '2',
      'JAX_PROCESS_ID': '1'}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      start_new_session=True),
           subprocess.Popen(cmd + ['--distributed'], cwd=REPO, env=base, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)]
  (rc, out, err), (rc_none, _, err_none) = _finish(procs, 120)
  assert time.time() - t < 60  # start-up included; JAX's default: 300 s, then an abort
  assert rc == 2, (out, err)
  assert out.splitlines()[0] == (f'connecting to the coordinator {address} as process 1 of 2 '
                                 '(timeout 3 s)...')
  assert _errors(err) == [
      f'error: no cluster formed within 3 s connecting to the coordinator {address} as process '
      "1 of 2: check that process 0 runs, that every process has process 0's host and a free "
      'port in JAX_COORDINATOR_ADDRESS, the same JAX_NUM_PROCESSES and its own JAX_PROCESS_ID, '
      'or wait longer with --distributed_timeout']
  assert rc_none == 2 and len(_errors(err_none)) == 1, err_none
  assert _errors(err_none)[0].startswith(
      'error: jax.distributed found no cluster to join: set JAX_COORDINATOR_ADDRESS (host:port '
      'of process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID on every process')
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('environ, message', [
    (dict(JAX_COORDINATOR_ADDRESS='h:1234'), 'JAX_COORDINATOR_ADDRESS is set (h:1234) but '
     'JAX_NUM_PROCESSES and JAX_PROCESS_ID are not: set JAX_NUM_PROCESSES (the process count) '
     "and JAX_PROCESS_ID (this process's index, 0 to count - 1) on every process"),
    (dict(JAX_COORDINATOR_ADDRESS='h:1234', JAX_NUM_PROCESSES='2'), 'JAX_COORDINATOR_ADDRESS is '
     'set (h:1234) but JAX_PROCESS_ID is not: set JAX_NUM_PROCESSES'),
    (dict(JAX_COORDINATOR_ADDRESS='h:1234', JAX_NUM_PROCESSES='2', JAX_PROCESS_ID='x'),
     "JAX_PROCESS_ID must be a whole number, this process's index from 0, got 'x'"),
    (dict(JAX_COORDINATOR_ADDRESS='h:1234', JAX_NUM_PROCESSES='two', JAX_PROCESS_ID='0'),
     "JAX_NUM_PROCESSES must be a positive whole number, the process count, got 'two'"),
    (dict(JAX_COORDINATOR_ADDRESS='h:1234', JAX_NUM_PROCESSES='2', JAX_PROCESS_ID='2'),
     'JAX_PROCESS_ID=2 but JAX_NUM_PROCESSES=2: the ids are 0 to 1'),
    (dict(JAX_COORDINATOR_ADDRESS='h', JAX_NUM_PROCESSES='2', JAX_PROCESS_ID='1'),
     "JAX_COORDINATOR_ADDRESS must be host:port (process 0's host and a free port), got 'h'"),
])
def test_launcher_environments_that_cannot_work_are_one_line(environ, message):
  """Refused before JAX is asked (the old messages: "error: 'JAX_PROCESS_ID'", "invalid literal
  for int()...", "Number of processes must be defined.")."""
  lines = []
  with pytest.raises(ValueError) as e:
    train.initialize_distributed('auto', environ=environ, log=lines.append)
  assert str(e.value).startswith(message) and '\n' not in str(e.value)
  assert not lines
  with pytest.raises(ValueError, match='--distributed_timeout must be a positive number'):
    train.initialize_distributed('auto', environ=environ, timeout_s=0)


def test_a_slurm_launch_with_an_address_leaves_the_count_and_id_to_jax():
  environ = dict(JAX_COORDINATOR_ADDRESS='h:1234', SLURM_NTASKS='2', SLURM_JOB_ID='7')
  assert train._coordinator_from_env(environ) == {}  # pylint: disable=protected-access
