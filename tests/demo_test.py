"""experiments/demo.py, the README's main job (`make demo`), end to end in a subprocess on a
short CMU clip under a name of the user's own (`make demo DEMO_ARGS=--input=PATH.bvh`: it
refused any name but CMU's `07_05` form until session 39): the table, the four files, and a
BVH that reads back."""

import re
import subprocess
import sys
from pathlib import Path

from ik_gat_jax.io import bvh

REPO = Path(__file__).resolve().parents[1]


def test_demo_on_a_clip_of_any_name(cmu_dir, tmp_path):
  m = bvh.read_bvh(cmu_dir / '07_05.bvh')
  m.motion = m.motion[:81]  # 80 frames at 120 fps after the T-pose frame: 20 at 30 fps
  bvh.write_bvh(tmp_path / 'my walk.bvh', m)
  out = tmp_path / 'out'
  p = subprocess.run([sys.executable, '-m', 'experiments.demo',
                      f'--input={tmp_path / "my walk.bvh"}', f'--output_dir={out}', '--iters=5'],
                     cwd=REPO, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
  rows = dict(re.findall(r'^\| (IK-GAT \(base\)|iterative \+ prior, 5 it, cold) \| ([\d.]+) \|',
                         p.stdout, re.M))
  assert len(rows) == 2, p.stdout
  assert float(rows['IK-GAT (base)']) < float(rows['iterative + prior, 5 it, cold'])
  names = sorted(f.name for f in out.iterdir())
  assert names == ['my walk_clip.gif', 'my walk_frames.png', 'my walk_ikgat.bvh',
                   'my walk_ikgat.glb'], names
  solved = bvh.read_bvh(out / 'my walk_ikgat.bvh')
  assert solved.num_frames == 80 and round(solved.fps) == 120  # the file's own rate
  # In centimetres, as the demo says (it wrote CMU's units, 0.056 m: a body 5.6x too small
  # imported as cm): the hips 0.8-1.1 m above the feet of a standing adult.
  hips = solved.position_channels(0)[:, 1].mean()
  assert 80 < hips < 110, hips
  assert (out / 'my walk_ikgat.glb').read_bytes()[:4] == b'glTF'


def test_demo_refuses_what_it_cannot_compare_before_solving(cmu_dir, tmp_path):
  """A CMU-named clip in metres (other units) and a folder: one line, nothing solved or
  written (it printed a table of nonsense first, then named --units, a flag it lacks)."""
  m = bvh.read_bvh(cmu_dir / '09_05.bvh')
  m.motion = m.motion[:11].copy()
  k = 0.056444  # CMU's units -> metres
  for joint in m.joints:
    joint.offset = joint.offset * k
  m.motion[:, :3] *= k
  bvh.write_bvh(tmp_path / 'metres.bvh', m)
  out = tmp_path / 'out'
  for arg, match in ((tmp_path / 'metres.bvh', 'looks like metres'), (tmp_path, 'not a file')):
    p = subprocess.run([sys.executable, '-m', 'experiments.demo', f'--input={arg}',
                        f'--output_dir={out}'], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2 and match in p.stderr, p.stdout[-2000:] + p.stderr[-2000:]
    assert 'IK-GAT' not in p.stdout and not out.exists()
