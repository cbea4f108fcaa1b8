"""The command line's persistent compilation cache (ik_gat_jax/compile_cache.py).

`python -m ik_gat_jax.solve` on a 4-frame clip in subprocesses with a temporary HOME: the first
run fills `~/.cache/ik_gat_jax/jax`, the second finds every compilation there (no new entry),
two runs at once on an empty cache both succeed and leave whole entries only, and
`IK_GAT_NO_COMPILE_CACHE=1` writes nothing. The parameter cache beside it (checkpointing.py):
the first run writes one entry, the next loads it without importing orbax, a hit gives the
checkpoint's own arrays, and a changed or broken checkpoint is never hidden. The executable
cache (the solver's compiled forward): a second solver loads it without tracing and gives the
same bits, a broken entry is a miss, the weights are part of the entry's name, an entry lost
while JAX's cache holds the program is written again, one that cannot be stored is marked and
not retried, and the entry's name follows the environment and the description but not object
addresses. No timing is asserted.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from ik_gat_jax import checkpointing, compile_cache, inference, skeleton, temporal
from ik_gat_jax import solver as solver_lib

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def tiny_npz(tmp_path_factory):
  """4 frames near the cmu_body template's rest pose (FK of the rest offsets, mm noise)."""
  rig = skeleton.cmu_body()
  rest = skeleton.rest_positions_np(rig.template(), rig.parents)
  noise = 0.005 * np.random.default_rng(0).normal(size=(4, rig.num_joints, 3))
  path = tmp_path_factory.mktemp('cc_input') / 'clip.npz'
  np.savez(path, positions=(rest[None] + noise).astype(np.float32), fps=np.float32(30))
  return path


def _env(home: Path, **extra) -> dict:
  env = {k: v for k, v in os.environ.items()
         if k not in ('JAX_COMPILATION_CACHE_DIR', 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS',
                      'XDG_CACHE_HOME', compile_cache.ENV_OFF)}  # conftest sets the first two
  env.update(HOME=str(home), JAX_PLATFORMS='cpu', **extra)
  return env


def _solve_cmd(inp: Path, out: Path) -> list[str]:
  return [sys.executable, '-m', 'ik_gat_jax.solve', f'--input={inp}', f'--output={out}']


_BAD_ENTRY = 'Error reading persistent compilation cache'  # JAX's warning for a bad entry


def _solve(inp: Path, out: Path, env: dict) -> None:
  done = subprocess.run(_solve_cmd(inp, out), cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert _BAD_ENTRY not in done.stderr, done.stderr[-2000:]
  assert out.is_file()


def _entries(cache: Path) -> set[str]:
  return {p.name for p in cache.glob('*-cache')} if cache.is_dir() else set()


def test_default_dir_respects_xdg_cache_home(tmp_path):
  assert compile_cache.default_dir({'HOME': '/h'}) == Path('/h/.cache/ik_gat_jax/jax')
  assert compile_cache.default_dir({'HOME': '/h', 'XDG_CACHE_HOME': str(tmp_path)}) == \
      tmp_path / 'ik_gat_jax' / 'jax'
  # The XDG spec: a relative XDG_CACHE_HOME is ignored.
  assert compile_cache.default_dir({'HOME': '/h', 'XDG_CACHE_HOME': 'rel'}) == \
      Path('/h/.cache/ik_gat_jax/jax')
  assert compile_cache.disabled({compile_cache.ENV_OFF: '1'})
  assert not compile_cache.disabled({compile_cache.ENV_OFF: '0'})


def test_importing_the_library_changes_nothing(tmp_path):
  code = ('import jax, ik_gat_jax.solve, ik_gat_jax.cli; '
          'print(jax.config.jax_compilation_cache_dir)')
  done = subprocess.run([sys.executable, '-c', code], cwd=REPO, env=_env(tmp_path / 'home'),
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == 'None'
  assert not (tmp_path / 'home').exists()


def test_atomic_put_writes_whole_entries_once(tmp_path):
  cache = compile_cache._atomic_cache_class()(str(tmp_path), max_size=-1)
  cache.put('k', b'first')
  cache.put('k', b'second')  # an existing entry is kept, as JAX's own put does
  assert cache.get('k') == b'first'
  assert sorted(p.name for p in tmp_path.iterdir()) == ['k-cache']  # no temp file left


_HITS = """
import jax, jax.numpy as jnp
from jax import monitoring
from ik_gat_jax import compile_cache
events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
compile_cache.enable()
assert compile_cache.status()['atomic_writes'], compile_cache.status()
jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(5)).block_until_ready()
print(sum(e.endswith('/cache_hits') for e in events),
      sum(e.endswith('/cache_misses') for e in events))
"""


def test_enable_gives_hits_in_the_next_process(tmp_path):
  """The atomic cache is installed, and a new process reads what the last one wrote."""
  env = _env(tmp_path / 'home')
  run = lambda: subprocess.run([sys.executable, '-c', _HITS], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=300)
  first, second = run(), run()
  assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
  hits, misses = map(int, first.stdout.split())
  assert hits == 0 and misses > 0
  hits, misses = map(int, second.stdout.split())
  assert hits > 0 and misses == 0


_CALIBRATED_STEPS = """
import warnings
import numpy as np
from ik_gat_jax import compile_cache, skeleton, solver
compile_cache.enable()
warnings.simplefilter('ignore')  # the template's offsets: warned, not what is under test
s = solver.IKSolver.from_checkpoint(subject_calibration=True)
rest = skeleton.rest_positions_np(s.offsets, s.rig.parents)
noise = 0.01 * np.random.default_rng(0).normal(size=(3,) + rest.shape)
out = np.stack([s.step(rest + n) for n in noise])
print(repr(out.tobytes().hex()[:64]), len(list(compile_cache.executables_dir().iterdir())))
"""


def test_an_executable_with_lapack_kernels_loads_in_a_fresh_process(tmp_path):
  """The subject calibration's live frame (an SVD: a LAPACK kernel) from the executable cache
  in a process that has lowered no LAPACK call: the same bits, no crash (it crashed with a
  segmentation fault before `compile_cache` registered the kernels)."""
  env = _env(tmp_path / 'home')
  run = lambda: subprocess.run([sys.executable, '-c', _CALIBRATED_STEPS], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=300)
  first, second = run(), run()
  assert first.returncode == 0 and second.returncode == 0, first.stderr[-2000:] + second.stderr[
      -2000:]
  assert first.stdout == second.stdout  # the same outputs, no new entry
  assert int(first.stdout.split()[-1]) == 2  # the network's frame and the calibration's


def test_xdg_cache_home_concurrent_runs_and_second_run_hits(tiny_npz, tmp_path):
  xdg = tmp_path / 'xdg'
  cache = xdg / 'ik_gat_jax' / 'jax'
  env = _env(tmp_path / 'home', XDG_CACHE_HOME=str(xdg))
  procs = [subprocess.Popen(_solve_cmd(tiny_npz, tmp_path / f'c{i}.npz'), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  for p in procs:
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-2000:]
    assert _BAD_ENTRY not in err, err[-2000:]
  entries = _entries(cache)
  assert entries and not [p for p in cache.iterdir() if p.name.endswith('.tmp')]
  assert not (tmp_path / 'home' / '.cache').exists()
  # The solver's forward is in the executable cache below (compile_cache.compile_for_entry),
  # the rest of the run's compilations here.
  params = sorted(p.name for p in (xdg / 'ik_gat_jax' / 'params').iterdir())
  assert len(params) == 1 and params[0].endswith('.npz'), params  # one whole entry
  executables = sorted(p.name for p in (xdg / 'ik_gat_jax' / 'executables').iterdir())
  assert len(executables) == 1 and executables[0].endswith('.jaxexe'), executables
  # A second run is a cache hit: every compilation comes from the entries the two wrote (each
  # read back whole), none is added, the parameters come from the cache (orbax is never
  # imported) and the output is the same.
  second = subprocess.run([sys.executable, '-X', 'importtime'] + _solve_cmd(
      tiny_npz, tmp_path / 'd.npz')[1:], cwd=REPO, env=env, capture_output=True, text=True,
      timeout=300)
  assert second.returncode == 0, second.stderr[-2000:]
  assert 'orbax' not in second.stderr and _BAD_ENTRY not in second.stderr
  assert _entries(cache) == entries
  a, b = np.load(tmp_path / 'c0.npz'), np.load(tmp_path / 'd.npz')
  np.testing.assert_array_equal(a['local_rot'], b['local_rot'])


def test_a_lost_executable_entry_is_written_again_while_jax_cache_is_warm(tiny_npz, tmp_path):
  """An executable entry lost (deleted, or keyed anew by an update of the package whose
  programs JAX's cache still holds) is compiled and written again by the next run, not left
  to a JAX-cache copy that cannot be stored (every later run then traced and lowered again)."""
  xdg = tmp_path / 'xdg'
  env = _env(tmp_path / 'home', XDG_CACHE_HOME=str(xdg))
  folder = xdg / 'ik_gat_jax' / 'executables'
  _solve(tiny_npz, tmp_path / 'a.npz', env)
  first = sorted(p.name for p in folder.iterdir())
  assert len(first) == 1 and first[0].endswith('.jaxexe'), first
  shutil.rmtree(folder)
  _solve(tiny_npz, tmp_path / 'b.npz', env)
  assert sorted(p.name for p in folder.iterdir()) == first  # written again, no marker
  np.testing.assert_array_equal(np.load(tmp_path / 'a.npz')['local_rot'],
                                np.load(tmp_path / 'b.npz')['local_rot'])


def test_an_entry_that_cannot_be_stored_is_marked_and_not_retried(tmp_path, monkeypatch):
  """Where an executable cannot be stored (a backend without serialisation), the miss leaves a
  marker and later misses compile without trying to store again (each try runs it twice)."""
  monkeypatch.setattr(compile_cache, '_executables_dir', tmp_path)
  tries = []
  monkeypatch.setattr(compile_cache, 'store_executable', lambda *a: tries.append(a) or False)
  f = jax.jit(lambda x: x * 2)
  x = np.arange(3.0, dtype=np.float32)
  for _ in range(2):
    exe = compile_cache.compile_for_entry('ab' * 32, lambda: f.lower(x), (x,))
    np.testing.assert_array_equal(exe(x), 2 * x)
  assert len(tries) == 1 and (tmp_path / f'{"ab" * 32}.unstorable').is_file()
  exe = compile_cache.compile_for_entry(None, lambda: f.lower(x), (x,))  # the cache off
  assert len(tries) == 1 and len(list(tmp_path.iterdir())) == 1


def test_env_var_turns_it_off(tiny_npz, tmp_path):
  home = tmp_path / 'home'
  _solve(tiny_npz, tmp_path / 'a.npz', _env(home, **{compile_cache.ENV_OFF: '1'}))
  assert not (home / '.cache').exists()


# -- the parameter cache (checkpointing.py; turned on by enable()) ---------------------------


@pytest.fixture
def params_cache(tmp_path, monkeypatch):
  """The parameter cache on, in a temporary folder; a copy of the shipped checkpoint."""
  cache = tmp_path / 'params'
  monkeypatch.setattr(compile_cache, '_params_dir', cache)
  ckpt = tmp_path / 'ckpt'
  shutil.copytree(inference.SHIPPED_IKGAT, ckpt)
  return cache, ckpt


def _arrays(model) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_params_cache_hit_is_the_checkpoint_without_orbax(params_cache, monkeypatch):
  cache, ckpt = params_cache
  model, meta = inference.load_model(ckpt)  # a miss: orbax restores, the entry is written
  entries = sorted(cache.iterdir())
  assert [p.suffix for p in entries] == ['.npz'], entries  # one whole entry, no temp file
  assert entries[0].stem == checkpointing.content_key(ckpt)
  real = checkpointing.Checkpointer

  def no_orbax(*a, **k):
    raise AssertionError('a cache hit must not open the checkpoint with orbax')

  monkeypatch.setattr(checkpointing, 'Checkpointer', no_orbax)
  again, meta2 = inference.load_model(ckpt)
  assert meta2 == meta
  for a, b in zip(_arrays(model), _arrays(again), strict=True):  # one process: the same bits
    np.testing.assert_array_equal(a, b)
  with pytest.raises(checkpointing.CheckpointError, match='is for rig'):  # checks still run
    inference.load_model(ckpt, expected_rig=skeleton.get_rig('smpl22'))
  # A truncated entry is a miss: orbax restores and writes it whole again.
  monkeypatch.setattr(checkpointing, 'Checkpointer', real)
  entries[0].write_bytes(entries[0].read_bytes()[:1000])
  inference.load_model(ckpt)
  key, meta3, cached = checkpointing.cache_lookup(cache, ckpt)
  assert meta3 == meta and len(cached) == len(_arrays(model))
  # Any change to the checkpoint's files is a new key (the old entry is never read for it).
  (ckpt / 'note.txt').write_text('changed')
  assert checkpointing.content_key(ckpt) != key
  inference.load_model(ckpt)
  assert len(list(cache.glob('*.npz'))) == 2


def test_params_cache_refuses_an_entry_for_another_tree():
  want = {'w': jax.ShapeDtypeStruct((2, 3), np.float32), 'b': jax.ShapeDtypeStruct((3,),
                                                                                  np.float32)}
  good = {"['w']": np.ones((2, 3), np.float32), "['b']": np.zeros(3, np.float32)}
  tree = checkpointing.cache_tree(good, want)
  np.testing.assert_array_equal(tree['w'], good["['w']"])
  assert checkpointing.cache_tree({**good, "['b']": np.zeros(4, np.float32)}, want) is None
  assert checkpointing.cache_tree({**good, "['b']": np.zeros(3, np.float64)}, want) is None
  assert checkpointing.cache_tree({"['w']": good["['w']"]}, want) is None
  assert checkpointing.cache_tree({**good, "['x']": good["['b']"]}, want) is None


def test_params_cache_does_not_hide_a_broken_checkpoint(params_cache):
  cache, ckpt = params_cache
  inference.load_model(ckpt)
  # Corrupt metadata: a new key, so orbax reads the checkpoint and refuses it. (Not a truncated
  # array file: on this many arrays orbax's abandoned reads outlive the error and warn later.)
  meta, = [p for p in ckpt.rglob('metadata') if p.parent.name == 'meta']
  meta.write_text('{not json')
  with pytest.raises(checkpointing.CheckpointError) as e:
    inference.load_model(ckpt)
  assert '\n' not in str(e.value) and str(ckpt) in str(e.value)


# -- the executable cache (compile_cache.py; the solver's forward) ----------------------------


def test_executable_cache_skips_tracing_and_gives_the_same_bits(tmp_path, monkeypatch):
  folder = tmp_path / 'executables'
  monkeypatch.setattr(compile_cache, '_executables_dir', folder)
  rig = skeleton.cmu_body()
  rest = skeleton.rest_positions_np(rig.template(), rig.parents)
  clip = rest[None] + 0.01 * np.random.default_rng(1).normal(size=(5, rig.num_joints, 3))
  solver_lib.clear_executables()  # each new solver below: only this cache (a new process's)
  first = solver_lib.IKSolver.from_checkpoint()
  want = first.solve(clip, full=True)
  assert first.trace_count == 1
  entries = sorted(folder.iterdir())
  assert [p.suffix for p in entries] == ['.jaxexe'], entries  # one whole entry, no temp file
  solver_lib.clear_executables()
  second = solver_lib.IKSolver.from_checkpoint()
  got = second.solve(clip, full=True)
  assert second.trace_count == 0  # loaded: neither traced nor lowered
  for name in ('local_rot', 'global_rot', 'positions_fk'):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
  second.step(clip[0])  # another signature (one frame, rotations only): its own entry
  assert second.trace_count == 1 and len(list(folder.iterdir())) == 2
  # A broken entry is a miss: compiled again (same bits) and written whole again.
  for p in folder.iterdir():
    p.write_bytes(p.read_bytes()[:100])
  solver_lib.clear_executables()
  third = solver_lib.IKSolver.from_checkpoint()
  np.testing.assert_array_equal(third.solve(clip, full=True).local_rot, want.local_rot)
  assert third.trace_count == 1
  assert compile_cache.load_executable(entries[0].stem) is not None
  # The same architecture with other weights (a fine-tuned copy): a clip takes the weights as
  # an argument (the entry may be shared, the answer is its own); `step` compiles them in, so
  # its entry is another one, never the shipped model's.
  model, meta = inference.load_model(inference.SHIPPED_IKGAT)
  nnx.update(model, jax.tree.map(lambda x: x * 1.01, nnx.state(model, nnx.Param)))
  tuned = solver_lib.IKSolver(model, meta)
  assert np.abs(tuned.solve(clip, full=True).local_rot - want.local_rot).max() > 1e-4
  before = tuned.trace_count
  step = tuned.step(clip[0])
  assert tuned.trace_count == before + 1
  assert np.abs(step - second.step(clip[0])).max() > 1e-4
  np.testing.assert_allclose(step, tuned.solve(clip[:1])[0], atol=2e-5)
  # bfloat16 products: an entry of their own (compiled with their XLA options: YNNPACK dots on
  # the CPU), stored and loaded like any other.
  count = len(list(folder.iterdir()))
  b16 = solver_lib.IKSolver.from_checkpoint(matmul_precision='bfloat16')
  got16 = b16.solve(clip, full=True).local_rot
  assert b16.trace_count == 1 and len(list(folder.iterdir())) == count + 1
  assert 0 < np.abs(got16 - want.local_rot).max() < 5e-2
  solver_lib.clear_executables()
  again = solver_lib.IKSolver.from_checkpoint(matmul_precision='bfloat16')
  np.testing.assert_array_equal(again.solve(clip, full=True).local_rot, got16)
  assert again.trace_count == 0
  # Names: the description and the environment count, object addresses do not.
  key = compile_cache.executable_key('f <function g at 0x7f00aa>')
  assert compile_cache.executable_key('f <function g at 0x7f11bb>') == key
  assert compile_cache.executable_key('f <function h at 0x7f00aa>') != key
  monkeypatch.setenv('XLA_FLAGS', os.environ.get('XLA_FLAGS', '') + ' --xla_dump_to=/dev/null')
  assert compile_cache.executable_key('f <function g at 0x7f00aa>') != key


def test_solvers_of_a_process_share_their_executables(monkeypatch):
  """A second solver of the same model and options runs without tracing (the first's
  executables, the same bits), as does one of another block size (the same programs); another
  option or subject does not share; other
  weights of the same architecture share the clip's executables (the weights an argument: its
  own answer) but not `step`'s (compiled in). Without the executable cache (library use)."""
  monkeypatch.setattr(compile_cache, '_executables_dir', None)
  rig = skeleton.cmu_body()
  rest = skeleton.rest_positions_np(rig.template(), rig.parents)
  clip = rest[None] + 0.01 * np.random.default_rng(2).normal(size=(3, rig.num_joints, 3))
  solver_lib.clear_executables()
  first = solver_lib.IKSolver.from_checkpoint(block_size=4)
  want, want_step = first.solve(clip, full=True), first.step(clip[0])
  assert first.trace_count == 2  # bucket 4 (full) and `step`
  second = solver_lib.IKSolver.from_checkpoint(block_size=4)
  got = second.solve(clip, full=True)
  np.testing.assert_array_equal(second.step(clip[0]), want_step)
  assert second.trace_count == 0
  for name in ('local_rot', 'global_rot', 'positions_fk'):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
  for kw in ({'size_normalization': False}, {'mirror': True},
             {'offsets': rig.template() * 1.02}):
    other = solver_lib.IKSolver.from_checkpoint(**{'block_size': 4, **kw})
    other.step(clip[0] * (1.02 if 'offsets' in kw else 1.0))
    assert other.trace_count == 1, kw  # its own `step` (another program or subject)
  # Another block size whose ladder holds this clip's bucket and `step`: the same programs.
  longer = solver_lib.IKSolver.from_checkpoint(block_size=8)
  np.testing.assert_array_equal(longer.solve(clip, full=True).local_rot, want.local_rot)
  np.testing.assert_array_equal(longer.step(clip[0]), want_step)
  assert longer.trace_count == 0
  model, meta = inference.load_model(inference.SHIPPED_IKGAT)
  nnx.update(model, jax.tree.map(lambda x: x * 1.01, nnx.state(model, nnx.Param)))
  tuned = solver_lib.IKSolver(model, meta, block_size=4)
  assert np.abs(tuned.solve(clip, full=True).local_rot - want.local_rot).max() > 1e-4
  assert tuned.trace_count == 0
  assert np.abs(tuned.step(clip[0]) - want_step).max() > 1e-4 and tuned.trace_count == 1
  # A temporal filter: `step`'s program (network and filter) is shared too, per filter and
  # subject, also for a frame of another subject (`offsets=`, the subject an argument).
  one_euro, other = temporal.FilterConfig(kind='one_euro'), rig.template() * 1.02
  filtered = []
  for config in (one_euro, one_euro, temporal.FilterConfig(kind='one_euro', beta=0.05)):
    f = solver_lib.IKSolver.from_checkpoint(block_size=4, temporal_filter=config)
    filtered.append((np.stack([f.step(x) for x in clip]), f.step(clip[0] * 1.02, offsets=other),
                     f.trace_count))
  assert [t for *_, t in filtered] == [2, 0, 2]
  np.testing.assert_array_equal(filtered[1][0], filtered[0][0])
  np.testing.assert_array_equal(filtered[1][1], filtered[0][1])
  assert np.abs(filtered[2][0] - filtered[0][0]).max() > 0  # another filter: its own answer
  solver_lib.clear_executables()
  fresh = solver_lib.IKSolver.from_checkpoint(block_size=4)
  np.testing.assert_array_equal(fresh.solve(clip, full=True).local_rot, want.local_rot)
  assert fresh.trace_count == 1


def test_the_shared_executables_keep_the_most_recently_used():
  cache = solver_lib._ExecutableCache(max_entries=2, max_bytes=100)
  for k in 'abc':
    cache.put(k, k.upper())
  assert (len(cache), cache.get('a'), cache.get('b'), cache.get('c')) == (2, None, 'B', 'C')
  cache.get('b')  # used last: 'c' goes first
  cache.put('d', 'D', held=60)
  assert (cache.get('c'), cache.get('b'), cache.get('d')) == (None, 'B', 'D')
  cache.put('e', 'E', held=60)  # 120 bytes compiled in, over 100: the older ones go
  assert (len(cache), cache.get('d'), cache.get('e')) == (1, None, 'E')
  cache.put('f', 'F', held=500)  # one entry over the bound alone is still kept (the newest)
  assert (len(cache), cache.get('f')) == (1, 'F')


def test_executable_cache_is_off_without_enable_and_with_the_switch(monkeypatch):
  for name in ('_status', '_params_dir', '_executables_dir'):  # restored after the test
    monkeypatch.setattr(compile_cache, name, getattr(compile_cache, name))
  monkeypatch.setattr(compile_cache, '_executables_dir', None)  # library use: no enable()
  assert compile_cache.load_executable('0' * 64) is None
  assert not compile_cache.store_executable('0' * 64, object(), ())
  assert compile_cache.enable({compile_cache.ENV_OFF: '1'}) is None
  assert compile_cache.executables_dir() is None and compile_cache.params_dir() is None
