"""Wrong checkpoints are refused with one line naming the path (issue I, item 5).

Corrupt metadata, a truncated array file, a shape (or tree) mismatch on restore, and resuming a
workdir with another model config each raise `checkpointing.CheckpointError` whose message is
one line and names the checkpoint directory. Each failure is made twice where it is cheap: on a
small pytree saved with `Checkpointer` (no data needed) and on a copy of the session's tiny
trained run (`tiny_ikgat_run`, real CMU shards; copied so the fixture stays intact).
"""

import json
import os
import shutil
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from ik_gat_jax import checkpointing, inference, train
from ik_gat_jax.skeleton import Rig


def _assert_refused(excinfo, path) -> str:
  """One line, naming `path`; returns the message."""
  msg = str(excinfo.value)
  assert excinfo.type is checkpointing.CheckpointError
  assert '\n' not in msg, msg
  assert str(Path(path).absolute()) in msg, msg
  assert len(msg) < 700, msg
  return msg


def _step_dir(ckpt_dir: Path) -> Path:
  ckpt = checkpointing.Checkpointer(ckpt_dir, create=False)
  step = ckpt.latest_step()
  ckpt.close()
  assert step is not None
  return ckpt_dir / str(step)


def _truncate_largest_array_file(step_dir: Path) -> Path:
  """Cuts the largest file under the step's `state` item (orbax OCDBT / zarr data) in half."""
  files = [Path(root) / f for root, _, names in os.walk(step_dir / 'state') for f in names]
  largest = max(files, key=lambda p: p.stat().st_size)
  data = largest.read_bytes()
  assert len(data) > 1000, (largest, len(data))  # an array chunk, not a small metadata file
  largest.write_bytes(data[:len(data) // 2])
  return largest


# ----------------------------------------------------------------------------------------------
# A small pytree, saved directly (runs everywhere, no data).


def _small_tree():
  return {'w': jnp.arange(4096.0, dtype=jnp.float32).reshape(64, 64),
          'b': jnp.zeros((3,), jnp.float32)}


@pytest.fixture
def small_ckpt(tmp_path) -> Path:
  path = tmp_path / 'small'
  ckpt = checkpointing.Checkpointer(path, max_to_keep=1)
  ckpt.save(3, _small_tree(), {'note': 'test'})
  ckpt.close()
  return path


def test_small_round_trip(small_ckpt):
  """The baseline the failures below break: the same tree restores."""
  state, meta = checkpointing.Checkpointer(small_ckpt, create=False).restore(
      checkpointing.abstract_like(_small_tree()))
  np.testing.assert_array_equal(np.asarray(state['w']), np.asarray(_small_tree()['w']))
  assert meta['note'] == 'test' and meta['step'] == 3


@pytest.mark.parametrize('garbage', [b'{not json', b'\x00\xff\xfe garbage', b'[1, 2, 3]', b''])
def test_small_corrupt_metadata(small_ckpt, garbage):
  (_step_dir(small_ckpt) / 'meta' / 'metadata').write_bytes(garbage)
  ckpt = checkpointing.Checkpointer(small_ckpt, create=False)
  with pytest.raises(checkpointing.CheckpointError) as e:
    ckpt.restore_meta()
  assert 'metadata' in _assert_refused(e, small_ckpt)
  with pytest.raises(checkpointing.CheckpointError) as e:
    ckpt.restore(checkpointing.abstract_like(_small_tree()))
  _assert_refused(e, small_ckpt)


def test_small_truncated_array_file(small_ckpt):
  _truncate_largest_array_file(_step_dir(small_ckpt))
  with pytest.raises(checkpointing.CheckpointError) as e:
    checkpointing.Checkpointer(small_ckpt, create=False).restore(
        checkpointing.abstract_like(_small_tree()))
  msg = _assert_refused(e, small_ckpt)
  assert 'cannot restore checkpoint' in msg and 'truncated' in msg
  # reads that finish after the settle hit orbax's closed loop: the hook drops those from now on
  assert getattr(sys.unraisablehook, 'closed_loop_filter', False)


def test_closed_loop_filter_drops_only_the_closed_loop_error():
  seen = []
  hook = checkpointing._closed_loop_filter(seen.append)  # pylint: disable=protected-access
  late, other = (types.SimpleNamespace(exc_value=RuntimeError(m), object=None)
                 for m in ('Event loop is closed', 'something else'))
  hook(late)
  hook(other)
  assert seen == [other]


@pytest.mark.parametrize('wanted, expect', [
    ({'w': (64, 32), 'b': (3,)},
     r'w has shape \(64, 64\) in the checkpoint, \(64, 32\) in the model'),
    ({'w': (64, 64), 'b': (3,), 'extra': (2,)}, 'only in the model: extra'),
])
def test_small_shape_mismatch(small_ckpt, wanted, expect):
  abstract = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in wanted.items()}
  with pytest.raises(checkpointing.CheckpointError, match=expect) as e:
    checkpointing.Checkpointer(small_ckpt, create=False).restore(abstract)
  assert 'does not match the model being restored' in _assert_refused(e, small_ckpt)


def test_one_line_keeps_the_innermost_cause():
  try:
    try:
      raise ValueError('OUT_OF_RANGE: the real\nreason')
    except ValueError as inner:
      raise RuntimeError('wrapper\n' + 'x' * 1000) from inner
  except RuntimeError as e:
    text = checkpointing.one_line(e)
  assert text == 'ValueError: OUT_OF_RANGE: the real reason'
  assert len(checkpointing.one_line(RuntimeError('y' * 1000))) == 300


# ----------------------------------------------------------------------------------------------
# A copy of the tiny trained run (real CMU shards).


@pytest.fixture
def run_copy(tiny_ikgat_run, tmp_path) -> Path:
  dst = tmp_path / 'run'
  shutil.copytree(tiny_ikgat_run, dst)
  return dst


def test_trained_run_loads(run_copy):
  """The baseline: the untouched copy loads."""
  model, meta = inference.load_model(run_copy)
  assert meta['task'] == 'ikgat' and model.rig.name == 'cmu_body'


def test_trained_corrupt_metadata(run_copy):
  best = run_copy / 'checkpoints' / 'best'
  (_step_dir(best) / 'meta' / 'metadata').write_text('{"format_version": 1, "task": ')
  with pytest.raises(checkpointing.CheckpointError) as e:
    inference.load_model(run_copy)
  assert 'cannot read checkpoint metadata' in _assert_refused(e, best)


def test_trained_metadata_without_rig(run_copy):
  """Valid JSON, but not what a checkpoint's meta holds."""
  best = run_copy / 'checkpoints' / 'best'
  path = _step_dir(best) / 'meta' / 'metadata'
  meta = json.loads(path.read_text())
  del meta['rig']
  path.write_text(json.dumps(meta))
  with pytest.raises(checkpointing.CheckpointError) as e:
    inference.load_model(run_copy)
  assert 'unusable metadata' in _assert_refused(e, best)


def test_trained_truncated_array_file(run_copy):
  best = run_copy / 'checkpoints' / 'best'
  _truncate_largest_array_file(_step_dir(best))
  with pytest.raises(checkpointing.CheckpointError) as e:
    inference.load_model(run_copy)
  msg = _assert_refused(e, best)
  assert 'cannot restore checkpoint' in msg and 'truncated' in msg


@pytest.mark.parametrize('override, expect', [
    ({'hidden': 32}, r'has shape \(.*\) in the checkpoint, \(.*\) in the model'),  # d 64 -> 32
    ({'size': 'small'}, r'only in the model: params\.backbone\.blocks\.2\.'),  # 2 -> 3 blocks
])
def test_trained_shape_mismatch_on_restore(run_copy, override, expect):
  """The tiny run's parameters restored into a model of another size (as `load_model` does)."""
  best = run_copy / 'checkpoints' / 'best'
  ckpt = checkpointing.Checkpointer(best, create=False)
  meta = ckpt.restore_meta()
  config = ml_collections.ConfigDict(meta['config'])
  config.model.update(override)
  model = inference.IKGAT_TASK.build(config, Rig.from_json(meta['rig']), nnx.Rngs(0), None)
  _, params, _, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
  with pytest.raises(checkpointing.CheckpointError, match=expect) as e:
    ckpt.restore(checkpointing.abstract_like({'params': params, 'rest': rest}))
  assert 'does not match the model being restored' in _assert_refused(e, best)


def test_trained_shape_mismatch_via_load_model(run_copy):
  """A checkpoint whose meta says another size than its arrays: `load_model` refuses."""
  best = run_copy / 'checkpoints' / 'best'
  path = _step_dir(best) / 'meta' / 'metadata'
  meta = json.loads(path.read_text())
  meta['config']['model']['hidden'] = 32
  path.write_text(json.dumps(meta))
  with pytest.raises(checkpointing.CheckpointError, match='in the checkpoint') as e:
    inference.load_model(run_copy)
  _assert_refused(e, best)


def test_resume_with_a_different_model_config_is_refused(run_copy, cmu_shards, tiny_config):
  latest = run_copy / 'checkpoints' / 'latest'
  run_json = (run_copy / 'run.json').read_bytes()
  step_before = checkpointing.Checkpointer(latest, create=False).latest_step()
  with pytest.raises(checkpointing.CheckpointError) as e:
    train.train_and_evaluate(tiny_config(cmu_shards, model=dict(hidden=32)), run_copy,
                             log=lambda m: None)
  msg = _assert_refused(e, latest)
  assert str(run_copy) in msg and 'different model config' in msg
  assert 'hidden: checkpoint None, this config 32' in msg  # the differing key, both values
  # Refused before anything was written: no silent fresh start over the old run.
  assert (run_copy / 'run.json').read_bytes() == run_json
  assert checkpointing.Checkpointer(latest, create=False).all_steps() == [step_before]


def test_resume_names_every_differing_key(run_copy, cmu_shards, tiny_config):
  with pytest.raises(checkpointing.CheckpointError) as e:
    train.train_and_evaluate(tiny_config(cmu_shards, model=dict(hidden=32, num_layers=3)),
                             run_copy, log=lambda m: None)
  msg = _assert_refused(e, run_copy / 'checkpoints' / 'latest')
  assert 'hidden:' in msg and 'num_layers:' in msg


def test_resume_from_a_truncated_checkpoint_is_refused(run_copy, cmu_shards, tiny_config):
  latest = run_copy / 'checkpoints' / 'latest'
  _truncate_largest_array_file(_step_dir(latest))
  config = tiny_config(cmu_shards)
  config.train.steps += 10  # resumed (a rerun of the finished run has nothing to restore)
  with pytest.raises(checkpointing.CheckpointError) as e:
    train.train_and_evaluate(config, run_copy, log=lambda m: None)
  assert 'truncated' in _assert_refused(e, latest)


def test_a_run_whose_latest_checkpoint_is_gone_is_not_trained_over(run_copy, cmu_shards,
                                                                    tiny_config):
  """`checkpoints/latest` deleted (or a save left unfinished) while run.json and the best
  checkpoint remain: a rerun is refused in one line, nothing written (it started a fresh run
  over the finished one, best checkpoint and all, even with another model config); a damaged
  run.json is named."""
  import shutil
  shutil.rmtree(_step_dir(run_copy / 'checkpoints' / 'latest'))
  run_json = (run_copy / 'run.json').read_bytes()
  best = checkpointing.Checkpointer(run_copy / 'checkpoints' / 'best', create=False).all_steps()
  with pytest.raises(checkpointing.CheckpointError, match=r'holds a run \(run.json at step '
                     r'\d+, best checkpoint at step \d+\) but no checkpoint in .*latest to '
                     r'resume from .*: put it back, or use a new --workdir'):
    train.train_and_evaluate(tiny_config(cmu_shards, model=dict(hidden=32)), run_copy,
                             log=lambda m: None)
  assert (run_copy / 'run.json').read_bytes() == run_json
  assert checkpointing.Checkpointer(run_copy / 'checkpoints' / 'best',
                                    create=False).all_steps() == best
  (run_copy / 'run.json').write_text('{"step": 2')
  with pytest.raises(ValueError, match=r'run.json is not JSON .*: a damaged run record'):
    train.train_and_evaluate(tiny_config(cmu_shards), run_copy, log=lambda m: None)


def test_a_run_whose_best_checkpoint_is_gone_is_repaired_by_its_rerun(run_copy, cmu_shards,
                                                                       tiny_config):
  """`checkpoints/best` deleted: loading the run says how to repair it, and rerunning its
  command saves the last step as the best (the rerun said done and left it missing)."""
  import shutil
  latest = checkpointing.Checkpointer(run_copy / 'checkpoints' / 'latest',
                                      create=False).latest_step()
  shutil.rmtree(_step_dir(run_copy / 'checkpoints' / 'best'))
  with pytest.raises(checkpointing.CheckpointError, match=r'no checkpoint found in .*best '
                     r'\(deleted\?\); .*latest holds the run.s last step: rerun its training '
                     'command'):
    inference.load_model(run_copy)
  said = []
  train.train_and_evaluate(tiny_config(cmu_shards), run_copy, log=said.append)
  assert any(f'the last step ({latest}) saved as the best' in m for m in said), said
  assert inference.load_model(run_copy)[1]['step'] == latest


def test_model_config_diff():
  base = {'size': 'tiny', 'hidden': None, 'joint_mask': False}
  assert train.model_config_diff(base, dict(base)) == []
  assert train.model_config_diff(base, {**base, 'hidden': 32, 'size': 'small'}) == \
      ['hidden', 'size']
  # A field missing from an older checkpoint counts as off.
  assert train.model_config_diff({'size': 'tiny'}, {'size': 'tiny', 'joint_mask': False}) == []
  assert train.model_config_diff({'size': 'tiny'}, {'size': 'tiny', 'joint_mask': True}) == \
      ['joint_mask']


def test_a_shipped_checkpoint_loads_by_name_from_anywhere(tmp_path, monkeypatch):
  """`--checkpoint=ikgat_fast` from any working directory: a bare name that is not a directory
  here is the shipped checkpoint of that name; a directory of that name here wins; a name of
  neither is refused, listing the shipped ones."""
  monkeypatch.chdir(tmp_path)
  shipped = inference.SHIPPED / 'ikgat_fast'
  assert inference.checkpoint_path('ikgat_fast') == shipped == inference.resolve_checkpoint(
      'ikgat_fast')
  _, meta = inference.load_model('ikgat_fast')
  assert meta['task'] == 'ikgat'
  with pytest.raises(checkpointing.CheckpointError, match=r"no checkpoint 'no_such_model': "
                     r'neither a directory here nor a shipped checkpoint \(.*ikgat_fast'):
    inference.checkpoint_path('no_such_model')  # a name of nothing: the shipped ones listed
  (tmp_path / 'ikgat_fast').mkdir()
  assert inference.checkpoint_path('ikgat_fast') == Path('ikgat_fast')


def test_reading_the_latest_while_a_trainer_replaces_it(tmp_path):
  """A reader of a run's best while it trains (evaluate, solve on RUN): the trainer saves a
  new step and deletes the one the reader listed (max_to_keep=1); the reader reads the new one
  (it failed, 'a corrupt or truncated array file?')."""
  tree = {'w': np.arange(4.0, dtype=np.float32)}
  writer = checkpointing.Checkpointer(tmp_path / 'best', max_to_keep=1)
  writer.save(1, tree, {'metrics': {'v': 1.0}})
  reader = checkpointing.Checkpointer(tmp_path / 'best', create=False)
  assert reader.latest_step() == 1  # listed
  writer.save(2, {'w': tree['w'] + 1}, {'metrics': {'v': 2.0}})  # step 1 deleted
  assert not (tmp_path / 'best' / '1').exists()
  got, meta = reader.restore(checkpointing.abstract_like(tree))
  assert meta['step'] == 2 and meta['metrics'] == {'v': 2.0}
  np.testing.assert_array_equal(np.asarray(got['w']), tree['w'] + 1)
  writer.save(3, tree, {'metrics': {'v': 3.0}})
  assert reader.restore_meta()['step'] == 3
