"""The experiment mains the tests import define no absl flags at import time: two mains that
both claim --data (most do) would otherwise raise DuplicateFlagError in whichever test process
imports the second one, depending on how pytest-xdist spreads the modules over workers."""

from pathlib import Path
import re
import subprocess
import sys

REPO = Path(__file__).resolve().parents[1]


def _mains_tests_import() -> list[str]:
  names = set()
  for f in sorted((REPO / 'tests').glob('*.py')):
    for line in f.read_text().splitlines():
      m = re.match(r'\s*from experiments import (.+)', line)
      if m:
        names.update(n.strip() for n in m.group(1).split(',') if n.strip())
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
