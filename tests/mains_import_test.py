"""The experiment mains the tests import define no absl flags at import time: two mains that
both claim --data (most do) would otherwise raise DuplicateFlagError in whichever test process
imports the second one, depending on how pytest-xdist spreads the modules over workers. And
every main's --help exits 0 (each in a process of its own: they claim the same flags)."""

from pathlib import Path
import re
import subprocess
import sys

import pytest

REPO = Path(__file__).resolve().parents[1]


def _mains_tests_import() -> list[str]:
  names = set()
  for f in sorted((REPO / 'tests').glob('*.py')):
    for line in f.read_text().splitlines():
      m = re.match(r'\s*from experiments import (.+)', line)
      if m:
        names.update(n.strip() for n in m.group(1).split('#')[0].split(',') if n.strip())
  return sorted(n.split(' as ')[0].strip() for n in names)


def test_imported_mains_define_no_flags_at_import():
  mains = _mains_tests_import()
  assert 'causal_fit' in mains and 'bone_frames_report' in mains, mains
  code = ('import importlib, sys\n'
          'from absl import flags\n'
          f'mods = {["experiments." + m for m in mains]!r}\n'
          'for m in mods:\n'
          '  importlib.import_module(m)\n'
          'bad = sorted(m for m in flags.FLAGS.flags_by_module_dict() if m in mods)\n'
          'print(bad)\n'
          'sys.exit(1 if bad else 0)\n')
  p = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 0, p.stdout + p.stderr[-3000:]


def _help(mains: list[str]) -> dict[str, subprocess.CompletedProcess]:
  """`python -m MAIN --help` of each main, side by side."""
  procs = {m: subprocess.Popen([sys.executable, '-m', m, '--help'], cwd=REPO, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE) for m in mains}
  done = {}
  for m, p in procs.items():
    try:
      out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
      p.kill()
      raise AssertionError(f'{m} --help: no answer within 120 s') from None
    done[m] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
  return done


# Each main, a flag of its own that its help lists.
MAINS = {'experiments.train': 'workdir', 'experiments.train_prior': 'workdir',
         'experiments.benchmark': 'output_dir', 'experiments.ablations': 'root',
         'experiments.train_rig': 'bvh', 'experiments.export_checkpoint': 'run',
         'data_prep.bvh_to_shards': 'input', 'ik_gat_jax.solve': 'input',
         'experiments.evaluate': 'method', 'experiments.rerig_check': 'root'}


def _check_help(main: str, p: subprocess.CompletedProcess, flag: str) -> None:
  """Exit status 0, the module's usage and its own flags on stdout, nothing on stderr."""
  assert p.returncode == 0, (main, p.returncode, p.stdout[-1000:], p.stderr[-2000:])
  assert f'python -m {main}' in p.stdout and f'\n  --{flag}: ' in p.stdout, (main, p.stdout)
  assert p.stderr == '', (main, p.stderr[-2000:])


def test_every_main_runs_through_run_main():
  """Every absl main starts through `run_main` (--help exits 0, a config override of no field
  is one line), not `app.run` (16 mains' --help exited 1): read from the sources, the --help
  of a few checked below."""
  bare = [str(f.relative_to(REPO)) for d in ('experiments', 'data_prep', 'ik_gat_jax')
          for f in sorted((REPO / d).rglob('*.py')) if re.search(r'\bapp\.run\(', f.read_text())]
  # run_main itself, and solve's `run` (the `ik-gat solve` entry point answers --help first).
  assert bare == ['ik_gat_jax/absl_main.py', 'ik_gat_jax/solve.py'], bare


def test_help_exits_0_with_the_usage_and_flags():
  """--help of every absl main prints its usage and flags and exits 0 (absl's own exits 1)."""
  for main, p in _help(list(MAINS)).items():
    _check_help(main, p, MAINS[main])



def test_every_model_field_the_docs_name_can_be_set_by_a_flag(monkeypatch):
  """`--config.model.num_layers=1` (hidden, num_heads, head_hidden; the tilt limits) under the
  default and robust configs: None fields were ConfigDict fields of no type, which flags cannot
  set (a 30-line UnsupportedOperationError); typed placeholders, still None when unset. The
  overrides are read from sys.argv when the flag is defined, as in every main."""
  from absl import flags as absl_flags
  from ml_collections import config_flags
  overrides = ['--config.model.num_layers=1', '--config.model.hidden=24',
               '--config.model.num_heads=2', '--config.model.head_hidden=16',
               '--config.model.tilt_side_limit_deg=20']
  for name in ('default', 'robust'):
    path = str(REPO / 'experiments' / 'configs' / f'{name}.py')
    for argv in (['prog'] + overrides, ['prog']):
      monkeypatch.setattr(sys, 'argv', argv)
      fv = absl_flags.FlagValues()
      config_flags.DEFINE_config_file('config', path, flag_values=fv)
      fv(argv)
      m = fv.config.model
      got = (m.num_layers, m.hidden, m.num_heads, m.head_hidden, m.tilt_side_limit_deg)
      assert got == ((1, 24, 2, 16, 20.0) if len(argv) > 1 else (None,) * 5), (name, got)


def test_list_flags_of_the_noise_mains_refuse_in_one_line():
  """--noise_mm=-10 (a typo of 10) ran the clean input, labelled -10 mm; causal_fit's --fits=4
  said 'not enough values to unpack', and 2:5 (underdetermined) gave the per-frame row."""
  from experiments import causal_fit, common
  assert common.noise_levels(['0', '10.5']) == [0.0, 10.5]
  for bad in (['-10'], ['nan'], ['ten']):
    with pytest.raises(ValueError, match='--noise_mm: '):
      common.noise_levels(bad)
  assert causal_fit._fit_spec('8:1') == (8, 1) and causal_fit._fit_spec('1:0') == (1, 0)
  with pytest.raises(ValueError, match=r"--fits: expected K:DEGREE \(e.g. 8:1\), got '4'"):
    causal_fit._fit_spec('4')
  with pytest.raises(ValueError, match=r'--fits 2:5: a degree from 0 to K - 1 \(1\)'):
    causal_fit._fit_spec('2:5')
