"""Shared test set-up: CPU JAX, a persistent compilation cache, the CMU data location."""

import os
from pathlib import Path

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', str(REPO / '.jax_cache'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.5')
# The command line's parameter cache (compile_cache.py) of the CLI runs the tests start: in the
# checkout's ignored .jax_cache, not the user's ~/.cache.
os.environ.setdefault('XDG_CACHE_HOME', str(REPO / '.jax_cache' / 'xdg'))
# XLA's CPU backend at LLVM optimisation level 0 in the tests (their subprocesses inherit it),
# unless XLA_FLAGS names a level: the suite compiles hundreds of small programs and runs most of
# them a few times, and LLVM's passes were most of its compile time (fresh clones on 2 cores,
# back to back: 437 s against 663 s at XLA's default 3; BENCHMARKS.md "Suite time").
# The programs compute the same functions, up to float32 rounding (so two programs are compared
# within a tolerance, as tests/end_sites_test.py's ULP_TOL). A test that runs one program for
# long asks for XLA's default back (train_test's overfit test: `jax.jit(...,
# compiler_options={'xla_backend_optimization_level': 3})`).
# And XLA:CPU's elemental emitters for fusions instead of its newer fusion emitters
# (`--xla_cpu_use_fusion_emitters=false`, XLA's own switch between its two code paths), unless
# XLA_FLAGS names it: at level 0 they compile the same functions (to float32 rounding) faster,
# the suite's backend compilation 651 -> 359 s of test time (BENCHMARKS.md "Suite time",
# session 42; tests/shipped_test.py compares the command line under XLA's defaults).
TEST_XLA_FLAGS = {'xla_backend_optimization_level': '0', 'xla_cpu_use_fusion_emitters': 'false'}
for _name, _value in TEST_XLA_FLAGS.items():
  if _name not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + f' --{_name}={_value}').strip()
LEVEL_FLAGS = [f for f in os.environ['XLA_FLAGS'].split()
               if f.lstrip('-').split('=')[0] in TEST_XLA_FLAGS]

import ik_gat_jax  # noqa: E402,F401  (XLA workaround before any computation)
import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update('jax_compilation_cache_dir', os.environ['JAX_COMPILATION_CACHE_DIR'])

CMU_DIR = REPO.parent / 'shared' / 'data' / 'cmu'
IN_CI = os.environ.get('CI', '').lower() in ('1', 'true', 'yes')


@pytest.fixture(scope='session')
def xla_level_flags() -> list[str]:
  """The suite's compile-time flags (`TEST_XLA_FLAGS`), for subprocess tests that set their own
  XLA_FLAGS."""
  return list(LEVEL_FLAGS)


# IK_GAT_COMPILE_REPORT=DIR: each test process writes DIR/<pid>.json, the seconds of JAX's
# monitoring events (compiles: /jax/core/compile/*) per test id (BENCHMARKS.md "Suite time").
if os.environ.get('IK_GAT_COMPILE_REPORT'):
  import atexit
  import collections
  import json
  from jax import monitoring
  _current = ['<collection>']
  _seconds = collections.defaultdict(lambda: collections.defaultdict(float))
  monitoring.register_event_duration_secs_listener(
      lambda event, secs, **_: _seconds[_current[0]].__setitem__(
          event, _seconds[_current[0]][event] + secs))

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(item, nextitem):
    del nextitem
    _current[0] = item.nodeid
    yield

  def _write_report(folder=Path(os.environ['IK_GAT_COMPILE_REPORT'])):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f'{os.getpid()}.json').write_text(json.dumps(_seconds))

  atexit.register(_write_report)


def require_cmu() -> Path:
  """../shared/data/cmu. Absent on a user's clone: skip with the reason. Absent in CI
  (`CI=true`): fail, naming the folder, so the real-data tests cannot silently vanish."""
  if not (CMU_DIR / '07_01.bvh').exists():
    msg = f'CMU data not found at {CMU_DIR} (../shared/data/cmu beside the checkout)'
    if IN_CI:
      pytest.fail(f'{msg}; CI=true requires it', pytrace=False)
    pytest.skip(msg)
  return CMU_DIR


@pytest.fixture(scope='session')
def cmu_dir() -> Path:
  return require_cmu()


# The modules that take longest (a CI run's --durations, 2-core CPU, session 9), longest
# first. `make test` gives each module to one of two workers as they free up (pytest-xdist
# --dist=loadfile, in collection order), so the longest ones go first and the short ones fill
# in at the end: in alphabetical order train_test and train_rig_test came last and one worker
# ran them alone for minutes. Only the order changes; an unknown or renamed module runs after.
LONGEST_FIRST = ('train_test', 'benchmark_test', 'train_rig_test', 'iterative_ik_test',
                 'device_check_test', 'model_test', 'scale_test', 'evaluation_test',
                 'distributed_test', 'multihost_test', 'window_model_test', 'shipped_test',
                 'masking_test')


CLIENT_FPS, CLIENT_FRAMES = 30.0, 45


@pytest.fixture(scope='session')
def solved_07_05(cmu_dir):
  """(Solution, rig): the first 45 frames of 07_05 (the unseen subject) at 30 fps solved by the
  shipped checkpoint, full; the clip the client tests (assimp, three.js) write and read."""
  from ik_gat_jax import solver as solver_lib  # pylint: disable=import-outside-toplevel
  from ik_gat_jax.io import exports  # pylint: disable=import-outside-toplevel
  solver = solver_lib.IKSolver.from_checkpoint()
  clip = exports.read_bvh_clip(cmu_dir / '07_05.bvh', solver.rig, fps=CLIENT_FPS,
                               max_frames=4 * CLIENT_FRAMES)
  sol = solver.solve(clip.positions[:CLIENT_FRAMES], offsets=clip.offsets, full=True)
  return sol, solver.rig


@pytest.fixture(scope='session')
def z_up_copy():
  """`copy(m: BVHMotion) -> BVHMotion`: `m` (y up, facing +z) in a z-up world facing -y
  (Blender's): every offset, End Site and root translation turned by V (+90 degrees about x),
  every local rotation conjugated, V R V^T, so that every joint lands at V p. For files with
  CMU's channels (rotations ZYX, last)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from scipy.spatial.transform import Rotation  # pylint: disable=import-outside-toplevel
  from ik_gat_jax.io import bvh  # pylint: disable=import-outside-toplevel
  V = Rotation.from_euler('x', 90, degrees=True).as_matrix()  # y up -> z up, z fwd -> -y fwd

  def copy(m):
    columns, joints = [], []
    for j, joint in enumerate(m.joints):
      R = V @ bvh.euler_to_matrix_np(m.rotation_degrees(j), m.euler_order(j)) @ V.T
      euler = Rotation.from_matrix(R).as_euler('ZYX', degrees=True)
      pc = m.position_channels(j)
      columns.append(euler if pc is None else np.concatenate([pc @ V.T, euler], axis=1))
      joints.append(bvh.BVHJoint(joint.name, joint.parent, V @ joint.offset, joint.channels,
                                 None if joint.end_site is None else V @ joint.end_site))
    return bvh.BVHMotion(joints, m.frame_time, np.concatenate(columns, axis=1))

  return copy


@pytest.fixture(scope='session')
def write_bvh_in_orders():
  """`write(path, sol, rig, fps, orders)`: the solution's BVH in centimetres, every joint's
  rotation channels ZYX (`orders='ZYX'`) or joint j's the j-th of the six orders in turn
  (`orders='mixed'`); the client tests read both."""
  from ik_gat_jax.io import exports  # pylint: disable=import-outside-toplevel
  six = ('XYZ', 'XZY', 'YXZ', 'YZX', 'ZXY', 'ZYX')

  def write(path, sol, rig, fps: float, orders: str) -> None:
    per_joint = None if orders == 'ZYX' else [six[j % 6] for j in range(rig.num_joints)]
    exports.write_solution_bvh(path, sol, rig, fps, units='cm', orders=per_joint)

  return write


@pytest.fixture(scope='session')
def write_fbx_or_skip():
  """`write(path, sol, rig, fps)`: the solution's FBX, written by Blender; the test skips where
  Blender is missing or its Python cannot import numpy and ours cannot lend it (io/blender.py's
  one-line error: the machine, not the code; tests/blender_test.py). Any other error fails."""
  from ik_gat_jax.io import blender, exports  # pylint: disable=import-outside-toplevel

  def write(path, sol, rig, fps: float) -> None:
    if blender.find_blender() is None:
      pytest.skip('blender not on PATH (it writes the FBX); apt-get install blender')
    try:
      exports.write_solution_fbx(path, sol, rig, fps)
    except blender.BlenderError as e:
      if 'cannot import numpy' in str(e):
        pytest.skip(str(e))
      raise

  return write


def pytest_collection_modifyitems(session, config, items):
  del session, config
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(Path(str(item.fspath)).stem, len(rank)))  # stable


def pytest_terminal_summary(terminalreporter):
  """One line per skip reason with its count, so a green run shows what it did not test."""
  skipped = terminalreporter.stats.get('skipped', [])
  if not skipped:
    terminalreporter.write_line('skipped: 0 tests')
    return
  reasons: dict[str, int] = {}
  for rep in skipped:
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    reason = reason.removeprefix('Skipped: ')
    reasons[reason] = reasons.get(reason, 0) + 1
  terminalreporter.write_line(f'skipped: {len(skipped)} tests')
  for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
    terminalreporter.write_line(f'  {n} x {reason}')


def _quiet(msg: str) -> None:
  del msg


@pytest.fixture(scope='session')
def cmu_shards(cmu_dir, tmp_path_factory):
  """Small real shards: 07_01 + 09_01 (train), 07_02 (val), at 30 fps. Shared by the session."""
  from data_prep import conversion
  out = tmp_path_factory.mktemp('cmu_shards')
  for name, split in (('07_01', 'train'), ('09_01', 'train'), ('07_02', 'val')):
    conversion.convert(cmu_dir / f'{name}.bvh', 'cmu_body', out, split=split, log=_quiet)
  return out


@pytest.fixture(scope='session')
def overfit_shards(cmu_dir, tmp_path_factory):
  """300+ frames of 07_01 alone (120 fps), train and val the same file."""
  from data_prep import conversion
  out = tmp_path_factory.mktemp('overfit_shards')
  conversion.convert(cmu_dir / '07_01.bvh', 'cmu_body', out, split='train', fps=120, log=_quiet)
  return out


# The shortest file of each CMU subject (01 has no short file: 01_14, 2339 frames at 120 fps).
ONE_FILE_PER_SUBJECT = ('01_14', '03_02', '05_03', '06_09', '07_12', '08_10', '09_03')


@pytest.fixture(scope='session')
def all_subject_shards(cmu_dir, tmp_path_factory):
  """One file per CMU subject (all seven), at 30 fps, in split 'all'."""
  from data_prep import conversion
  out = tmp_path_factory.mktemp('all_subjects')
  for name in ONE_FILE_PER_SUBJECT:
    conversion.convert(cmu_dir / f'{name}.bvh', 'cmu_body', out, split='all', log=_quiet)
  return out


def make_tiny_config(shards, model: dict | None = None, train: dict | None = None):
  """experiments/configs/test.py (the tiny model) on `shards`, with model / train overrides."""
  from experiments.configs import test as test_config
  c = test_config.get_config()
  c.data = str(shards)
  c.model.update(model or {})
  c.train.update(train or {})
  return c


@pytest.fixture(scope='session')
def tiny_config():
  """`make_tiny_config`, for tests that build their own runs."""
  return make_tiny_config


@pytest.fixture(scope='session')
def tiny_ikgat_run(cmu_shards, tmp_path_factory):
  """A tiny IK-GAT trained for 20 steps on `cmu_shards` (a run directory)."""
  from ik_gat_jax import train
  c = make_tiny_config(cmu_shards)
  workdir = tmp_path_factory.mktemp('tiny_ikgat')
  train.train_and_evaluate(c, workdir, log=_quiet)
  return workdir


@pytest.fixture(scope='session')
def tiny_prior_run(cmu_shards, tmp_path_factory):
  """A small pose prior (latent 8, width 64) trained for 20 steps on `cmu_shards`."""
  from experiments.configs import prior as prior_config
  from ik_gat_jax import data, prior_task, train
  c = prior_config.get_config()
  c.data = str(cmu_shards)
  c.model.update(latent=8, hidden=64)
  c.train.update(steps=20, batch_size=32, warmup_steps=5, log_every=10, eval_every=10,
                 checkpoint_every=10, val_frames=128, eval_batch_size=128)
  c.prior_stats = prior_task.standardization_config(data.load_shards(cmu_shards, 'train'))
  workdir = tmp_path_factory.mktemp('tiny_prior')
  train.train_and_evaluate(c, workdir, task=prior_task.PRIOR_TASK, log=_quiet)
  return workdir
