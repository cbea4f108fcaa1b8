"""End-site table of docs/benchmarks/sparse.md from outputs/g2/*.json (sparse_table.py's columns)."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from sparse_table import H, load, row  # noqa: E402

rows = [('g2_sparse_mild, full', 'mild_full'),
        ('g2_sparse_mild, full + orient. head/hands', 'mild_full_oxr'),
        ('g2_sparse_mild, 6 trackers + orient. 6 trackers', 'mild_t6_o6'),
        ('g2_endsites, full', 'endsites_full'),
        ('g2_endsites, full + end sites', 'endsites_full_es'),
        ('g2_endsites, full + orient. head/hands', 'endsites_full_oxr'),
        ('g2_endsites, full + end sites + orient. head/hands', 'endsites_full_es_oxr'),
        ('g2_endsites, 6 trackers + orient. 6 trackers', 'endsites_t6_o6'),
        ('g2_endsites, 6 trackers + end sites + orient. 6 trackers', 'endsites_t6_es_o6')]
print(H)
for label, n in rows:
  print(row(label, load(n)))
