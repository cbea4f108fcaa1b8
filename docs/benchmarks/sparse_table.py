"""Tables of docs/benchmarks/sparse.md from outputs/g2/*.json."""
import json, sys
from pathlib import Path
O = Path('outputs/g2')
LEAVES = ('Head', 'LeftHand', 'RightHand', 'LeftToeBase', 'RightToeBase')
def load(n):
  p = O / f'{n}.json'
  return json.loads(p.read_text()) if p.exists() else None
def row(label, r):
  if r is None:
    return f'| {label} | (not run) |'
  pj = r['per_joint']
  leaf = [pj[j]['local_rot_err_deg'] for j in LEAVES]
  obs = r.get('sparse', {}).get('observed_joints_mean', 21.0)
  c = r['local_rot_err_deg_by_class']
  return (f"| {label} | {obs:.1f} | {r['local_rot_err_deg']:.2f} | {r['root_rot_err_deg']:.2f} | "
          f"{r['global_rot_err_deg']:.2f} | {r['mpjpe_mm']:.1f} | {c['determined']:.2f} | {c['swing']:.2f} | "
          + ' | '.join(f'{x:.1f}' for x in leaf) + ' |')
H = ('| model, input | observed joints | local (deg) | root (deg) | global (deg) | MPJPE (mm) | determined | swing | '
     + ' | '.join(LEAVES) + ' |\n|---|' + '---:|' * (8 + len(LEAVES)))
rows = [('unmasked baseline (ablations baseline_s0), full', 'baseline_full')]
for L, name in (('sparse', 'g2_sparse'), ('mild', 'g2_sparse_mild')):
  rows += [(f'{name}, full', f'{L}_full'), (f'{name}, 10 trackers', f'{L}_t10'), (f'{name}, 6 trackers', f'{L}_t6')]
  rows += [(f'{name}, dropout {p}', f'{L}_drop{p}') for p in ('0.1', '0.2', '0.3', '0.5')]
  rows += [(f'{name}, full + orient. head/hands', f'{L}_full_oxr'), (f'{name}, full + orient. 6 trackers', f'{L}_full_o6'),
           (f'{name}, 10 trackers + orient. head/hands', f'{L}_t10_oxr'),
           (f'{name}, 6 trackers + orient. head/hands', f'{L}_t6_oxr'), (f'{name}, 6 trackers + orient. 6 trackers', f'{L}_t6_o6')]
print(H)
for label, n in rows:
  print(row(label, load(n)))
