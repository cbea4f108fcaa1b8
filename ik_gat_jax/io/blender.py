"""Blender run headless as a subprocess: a GLB converted to FBX, and the pose Blender shows.

Nothing here imports Blender: each call writes a small script and runs `blender -b
--factory-startup --python-exit-code 1 --python SCRIPT -- ARGS_JSON` with a timeout (a killed or
failed Blender raises `BlenderError` with the last line of its stderr). Blender is found on
PATH; without it `BlenderMissing` says what to install. Checked with Blender 3.4.1 (Debian).

- numpy for Blender's Python: Blender's glTF importer needs numpy, which Debian's blender package
  lacks (no python3-numpy dependency). When Blender's own `import numpy` fails and its Python has
  our major.minor version, the script appends a folder holding links to our numpy (and
  `numpy.libs`) to its `sys.path`, and nothing else of our environment; otherwise it fails in
  one line: install python3-numpy.
- GLB -> FBX (`glb_to_fbx`): an empty factory scene named `ik_gat` (the FBX take's name) at
  the clip's rate (`render.fps` / `fps_base`); `import_scene.gltf` with `bone_heuristic=
  'BLENDER'` (each bone's axes are its glTF joint node's, so the bones' world frames are the
  rig's joint frames `G_j`, not a prettier guess); the bone names must come back as the joint
  names (Blender truncates names past 63 bytes: refused); then `export_scene.fbx` with the
  armature, the skinned body and any axes empty (`object_types` ARMATURE, MESH, EMPTY), no leaf
  bones (`add_leaf_bones=False`: no `*_end` joints), the animation baked at every frame of the
  clip (`bake_anim_step=1`, `bake_anim_simplify_factor=0`: no key is dropped,
  `bake_anim_use_all_bones`, forced start/end keys, the one action, no NLA), `primary_bone_axis=
  'Y'`, `secondary_bone_axis='X'`, axes `axis_up='Y'`, `axis_forward='-Z'` (Blender +z up, +y
  -> FBX +y up, -z: the glTF axes again, so FBX world = the rig's world mapped by
  `io.gltf.rig_to_gltf`), `apply_scale_options='FBX_SCALE_UNITS'` with `apply_unit_scale`:
  lengths stay in metres and the file says so (`UnitScaleFactor` = 100 cm per unit), so no
  object carries a x100 scale (the default FBX_SCALE_NONE writes centimetres and scales the
  armature node by 100). In the FBX the armature is a Null node rotated -90 degrees about x
  (Blender's z up -> FBX y up); below it every joint's local rotation is the solution's, with
  the root's carrying the inverse +90 degrees.
- Blender's world is +z up: a glTF / FBX point `(x, y, z)` is `(x, -z, y)` in Blender
  (`GLTF_TO_BLENDER`), which both importers apply.
- The pose Blender shows (`blender_pose`, the tests' check): a GLB, FBX or BVH imported into an
  empty scene, then per frame of the armature's action (`scene.frame_set`) every pose bone's
  world head `armature.matrix_world @ pose_bone.head` and world frame `(armature.matrix_world
  @ pose_bone.matrix)[:3, :3]`. BVH: Blender 3.4's importer opens files with mode "rU", which
  Python 3.11 refuses, so the script drops the "U" (a wrapped `builtins.open`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from ik_gat_jax.errors import InputError, check_frame_rate

TAKE_NAME = 'ik_gat'  # the FBX take (animation stack); the GLB animation's name too
GLTF_TO_BLENDER = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
INSTALL_HINT = 'apt-get install blender (Debian) or put blender on PATH'
TIMEOUT_BASE_S = 60.0
TIMEOUT_PER_FRAME_S = 0.02  # measured 0.7 ms per frame: 3,000 frames in 3.8 s, start-up included


class BlenderError(InputError):
  """Blender failed, timed out or is missing; one line with the reason."""


class BlenderMissing(BlenderError):
  """No `blender` on PATH."""


def find_blender() -> str | None:
  """The `blender` executable on PATH, or None."""
  return shutil.which('blender')


def require_blender(what: str = 'FBX output') -> str:
  """The `blender` executable; raises `BlenderMissing` naming `what` needs it."""
  exe = find_blender()
  if exe is None:
    raise BlenderMissing(f'{what} needs Blender: {INSTALL_HINT}')
  return exe


def timeout_s(frames: int) -> float:
  """The subprocess limit for a clip of `frames`: 60 s + 20 ms per frame (about 30 times the
  measured time)."""
  return TIMEOUT_BASE_S + TIMEOUT_PER_FRAME_S * max(int(frames), 0)


def fps_setting(fps: float) -> tuple[int, float]:
  """(render.fps, fps_base) for `fps`: Blender's rate is the integer `render.fps` over
  `fps_base` (29.97 -> (30, 1.001))."""
  fps = check_frame_rate(fps)
  whole = max(1, int(round(fps)))
  return whole, whole / float(fps)


# ----------------------------------------------------------------------------------------------
# The scripts Blender runs (its own Python: bpy, the standard library, numpy as above).

_PRELUDE = r'''
import builtins, json, sys
P = json.loads(sys.argv[-1])

def fail(msg):
  print('error: ' + msg, file=sys.stderr, flush=True)
  sys.exit(1)

try:
  import numpy
except ImportError:
  if P['numpy_dir'] and list(sys.version_info[:2]) == P['python']:
    sys.path.append(P['numpy_dir'])
  try:
    import numpy
  except ImportError:
    fail("Blender's Python %d.%d cannot import numpy (its glTF importer needs it): "
         "apt-get install python3-numpy" % sys.version_info[:2])
import bpy

bpy.ops.wm.read_factory_settings(use_empty=True)
scene = bpy.context.scene

def the_armature():
  arms = [o for o in scene.objects if o.type == 'ARMATURE']
  if len(arms) != 1:
    fail('%s: expected one armature after import, found %d' % (P['input'], len(arms)))
  return arms[0]
'''

_GLB_TO_FBX = _PRELUDE + r'''
scene.name = P['take']
scene.render.fps, scene.render.fps_base = P['fps_int'], 1.0  # glTF keys land on whole frames
bpy.ops.import_scene.gltf(filepath=P['input'], bone_heuristic='BLENDER')
arm = the_armature()
names = [b.name for b in arm.data.bones]
if sorted(names) != sorted(P['names']):
  fail('Blender renamed joints (names up to 63 bytes, unique): %s'
       % sorted(set(P['names']) - set(names))[:5])
scene.frame_start, scene.frame_end = 0, P['frames'] - 1
scene.frame_set(0)
scene.render.fps_base = P['fps_base']  # the clip's true rate for the FBX key times
bpy.ops.export_scene.fbx(
    filepath=P['output'], check_existing=False, object_types={'ARMATURE', 'MESH', 'EMPTY'},
    use_selection=False, apply_unit_scale=True, apply_scale_options='FBX_SCALE_UNITS',
    global_scale=1.0, axis_forward='-Z', axis_up='Y', add_leaf_bones=False,
    primary_bone_axis='Y', secondary_bone_axis='X', use_armature_deform_only=False,
    armature_nodetype='NULL', bake_anim=True, bake_anim_use_all_bones=True,
    bake_anim_use_nla_strips=False, bake_anim_use_all_actions=False,
    bake_anim_force_startend_keying=True, bake_anim_step=1.0, bake_anim_simplify_factor=0.0,
    path_mode='AUTO', embed_textures=False)
'''

_POSE = _PRELUDE + r'''
src = P['input']
ext = src.lower().rsplit('.', 1)[-1]
scene.render.fps, scene.render.fps_base = P['fps_int'], 1.0
if ext == 'glb':
  bpy.ops.import_scene.gltf(filepath=src, bone_heuristic='BLENDER')
elif ext == 'fbx':
  bpy.ops.import_scene.fbx(filepath=src, anim_offset=0.0, use_anim=True)
elif ext == 'bvh':
  _open = builtins.open  # Blender 3.4's BVH importer opens with mode "rU" (refused by 3.11)
  builtins.open = lambda f, mode='r', *a, **k: _open(f, mode.replace('U', ''), *a, **k)
  try:
    bpy.ops.import_anim.bvh(filepath=src, global_scale=P['bvh_scale'], use_fps_scale=False,
                            update_scene_fps=True, update_scene_duration=True)
  finally:
    builtins.open = _open
else:
  fail('%s: not a .glb, .fbx or .bvh' % src)
arm = the_armature()
if arm.animation_data is None or arm.animation_data.action is None:
  fail('%s: the armature has no animation' % src)
f0, f1 = (int(round(f)) for f in arm.animation_data.action.frame_range)
heads, frames = [], []
for f in range(f0, f1 + 1):
  scene.frame_set(f)
  heads.append([list(arm.matrix_world @ b.head) for b in arm.pose.bones])
  frames.append([[list(r) for r in (arm.matrix_world @ b.matrix).to_3x3()]
                 for b in arm.pose.bones])
out = {'names': [b.name for b in arm.pose.bones],
       'parents': [b.parent.name if b.parent else None for b in arm.pose.bones],
       'frame_start': f0, 'heads': heads, 'rotations': frames,
       'fps': scene.render.fps / scene.render.fps_base,
       'objects': sorted((o.name, o.type) for o in scene.objects),
       'armature_scale': list(arm.matrix_world.to_scale())}
with open(P['output'], 'w') as f:
  json.dump(out, f)
'''


def _numpy_links(folder: Path) -> str:
  """A folder holding links to this process's numpy (and its bundled libraries), for a Blender
  whose Python has none; '' when links cannot be made."""
  pkg = Path(np.__file__).resolve().parent
  try:
    for p in (pkg, pkg.parent / 'numpy.libs'):
      if p.exists():
        (folder / p.name).symlink_to(p, target_is_directory=True)
  except OSError:
    return ''
  return str(folder)


def run_script(script: str, params: dict, timeout: float, what: str,
               blender: str | None = None) -> None:
  """Runs `script` in headless Blender with `params` (JSON, `sys.argv[-1]`; `numpy_dir` and
  `python` are added). Raises `BlenderError` (exit status and stderr's last line, or the
  timeout) naming `what`."""
  exe = blender or require_blender(what)
  with tempfile.TemporaryDirectory(prefix='ik_gat_blender_') as tmp:
    script_path = Path(tmp) / 'script.py'
    script_path.write_text(script)
    numpy_dir = Path(tmp) / 'numpy_for_blender'
    numpy_dir.mkdir()
    params = {**params, 'numpy_dir': _numpy_links(numpy_dir),
              'python': list(sys.version_info[:2])}
    cmd = [exe, '-b', '--factory-startup', '--python-exit-code', '1', '--python',
           str(script_path), '--', json.dumps(params)]
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONHOME'}  # Blender's own Python
    code, stdout, stderr = _run(cmd, env, timeout, what)
  if code != 0:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    last = lines[-1] if lines else f'no message (stdout: {stdout.strip()[-200:]!r})'
    raise BlenderError(f'Blender failed {what} (exit {code}): {last}')


def _run(cmd: list[str], env: dict, timeout: float, what: str) -> tuple[int, str, str]:
  """(exit status, stdout, stderr) of `cmd` in its own process group, which is killed whole
  at `timeout` (a child left holding the pipes would otherwise keep us waiting)."""
  with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        env=env, start_new_session=True) as proc:
    try:
      stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.communicate()
      raise BlenderError(f'Blender did not finish {what} within {timeout:.0f} s '
                         '(killed)') from None
  return proc.returncode, stdout, stderr


def glb_to_fbx(glb: str | os.PathLike, fbx: str | os.PathLike, fps: float, frames: int,
               names: Sequence[str], blender: str | None = None) -> None:
  """Converts a GLB of `io.gltf` (keys at whole frames of `round(fps)`, i.e. written at that
  rate) to FBX at `fps` (module docstring), writing `fbx` in place (the caller makes it
  atomic). `names`: the joint names the armature must have."""
  whole, base = fps_setting(fps)
  params = {'input': str(glb), 'output': str(fbx), 'fps_int': whole, 'fps_base': base,
            'frames': int(frames), 'names': list(names), 'take': TAKE_NAME}
  run_script(_GLB_TO_FBX, params, timeout_s(frames), f'converting {Path(glb).name} to FBX',
             blender)
  if not Path(fbx).is_file() or Path(fbx).stat().st_size == 0:
    raise BlenderError(f'Blender wrote no FBX for {Path(glb).name}')


def blender_pose(path: str | os.PathLike, fps: float = 30.0, bvh_scale: float = 0.01,
                 frames_hint: int = 1000, blender: str | None = None) -> dict:
  """What Blender shows of an animated GLB, FBX or BVH (module docstring): a dict with
  `names` and `parents` (bone names), `frame_start`, `heads [T, B, 3]` and `rotations [T, B,
  3, 3]` (Blender world, z up, metres; numpy float64), the scene's `fps`, the scene's
  `objects` and the armature's world `armature_scale`. A GLB's keys must lie on whole frames of
  `round(fps)`; a BVH is scaled by `bvh_scale` (0.01: centimetres). Integer rates only for an
  FBX: Blender 3.4's FBX importer places keys at time x `render.fps` (it ignores `fps_base`),
  so a 29.97 fps file reads back stretched by 30 / 29.97 although its key times are k / 29.97."""
  whole, _ = fps_setting(fps)
  with tempfile.TemporaryDirectory(prefix='ik_gat_pose_') as tmp:
    out = Path(tmp) / 'pose.json'
    run_script(_POSE, {'input': str(Path(path).absolute()), 'output': str(out),
                       'fps_int': whole, 'bvh_scale': float(bvh_scale)},
               timeout_s(frames_hint), f'reading {Path(path).name}', blender)
    pose = json.loads(out.read_text())
  pose['heads'] = np.asarray(pose['heads'], np.float64)
  pose['rotations'] = np.asarray(pose['rotations'], np.float64)
  return pose
