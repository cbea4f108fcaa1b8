"""The docs' commands run: every `python -m MODULE --flag[=value]` in the Markdown files names a
module of this repository, a flag that module (or a repository module it imports) defines, and
for an enum flag a value it accepts (`--attention=dense|auto`: each alternative). Read from the
sources (no import, no JAX), so it is cheap; flags defined through a local alias
(`s = flags.DEFINE_string`, as `ik_gat_jax.solve.define_flags`) count."""

import ast
import functools
from pathlib import Path
import re

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ('ik_gat_jax', 'experiments', 'data_prep')
# absl's own flags, and modules of the standard library or tools the docs run.
ABSL_FLAGS = {'help', 'helpfull', 'helpshort', 'flagfile', 'undefok', 'alsologtostderr',
              'logtostderr', 'verbosity', 'v', 'log_dir', 'only_check_args'}
OTHER_MODULES = ('pytest', 'pip', 'venv', 'compileall', 'cProfile', 'timeit', 'pstats')

_COMMAND = re.compile(r'python3? -m ([\w.]+)'
                      r'((?:\s+(?:\[?--[\w.]+(?:=[^\s`\]]*)?\]?'
                      r'|[\w./-]+\.(?:bvh|npz|csv|json|py)\b))*)')
_FLAG = re.compile(r'--([\w.]+)(?:=([^\s`\]\[]*))?')


def _docs() -> list[Path]:
  return sorted(list(REPO.glob('*.md')) + list(REPO.glob('docs/**/*.md')) +
                list(REPO.glob('checkpoints/*/README.md')))


def _module_file(module: str) -> Path | None:
  base = REPO / module.replace('.', '/')
  for p in (base.with_suffix('.py'), base / '__init__.py'):
    if p.is_file():
      return p
  return None


def _defines(tree: ast.AST) -> dict[str, list[str] | None]:
  """The flags a module's source defines: name -> enum values (None: not an enum)."""
  aliases = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
      target, value = node.targets[0], node.value
      pairs = (zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and
               isinstance(value, ast.Tuple) else [(target, value)])
      for t, v in pairs:
        if (isinstance(t, ast.Name) and isinstance(v, ast.Attribute) and
            v.attr.startswith('DEFINE')):
          aliases[t.id] = v.attr
  out = {}
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call):
      continue
    f = node.func
    kind = f.attr if isinstance(f, ast.Attribute) else aliases.get(getattr(f, 'id', ''), '')
    if not kind.startswith('DEFINE') or not node.args:
      continue
    name = node.args[0]
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
      continue
    values = None
    if kind == 'DEFINE_enum' and len(node.args) > 2 and isinstance(node.args[2], ast.List):
      if all(isinstance(e, ast.Constant) for e in node.args[2].elts):
        values = [e.value for e in node.args[2].elts]
    out[name.value] = values
  return out


def _imports(tree: ast.AST) -> set[str]:
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split('.')[0] in PACKAGES:
      out.add(node.module)
      out.update(f'{node.module}.{a.name}' for a in node.names)
    elif isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name.split('.')[0] in PACKAGES)
  return out


@functools.cache
def _parsed(module: str) -> tuple[dict, set[str]]:
  """(flags defined, repository modules imported) of one module; empty when not a file here."""
  path = _module_file(module)
  if path is None:
    return {}, set()
  tree = ast.parse(path.read_text(), str(path))
  return _defines(tree), _imports(tree)


@functools.cache
def _flags(module: str) -> dict[str, list[str] | None]:
  """Flags of `module` and of every repository module it imports, transitively."""
  out, seen, todo = {}, set(), [module]
  while todo:
    m = todo.pop()
    if m in seen:
      continue
    seen.add(m)
    defines, imports = _parsed(m)
    for name, values in defines.items():
      out.setdefault(name, values)
    todo.extend(imports)
  return out


def _commands(text: str):
  """(module, [(flag, value or None)]) per `python -m` command; lines joined, so a command
  wrapped over several lines of a paragraph or a code block is read whole."""
  joined = re.sub(r'\\?\s*\n\s*', ' ', text)
  for m in _COMMAND.finditer(joined):
    yield m.group(1), [(f, v or None) for f, v in _FLAG.findall(m.group(2))]


def _problems(doc: Path) -> list[str]:
  out = []
  for module, used in _commands(doc.read_text()):
    if module.split('.')[0] in OTHER_MODULES:
      continue
    if _module_file(module) is None:
      out.append(f'{doc.name}: python -m {module}: no such module here')
      continue
    defined = _flags(module)
    for flag, value in used:
      name = flag.split('.')[0]  # --config.model.hidden: the config flag
      if name in ABSL_FLAGS:
        continue
      if name not in defined and not (name.startswith('no') and name[2:] in defined):
        out.append(f'{doc.name}: python -m {module} --{flag}: no such flag')
        continue
      values = defined.get(name)
      if values and value and re.fullmatch(r'[\w|]+', value) and not value.isupper():
        bad = [v for v in value.split('|') if v not in values]
        if bad:
          out.append(f'{doc.name}: python -m {module} --{flag}={value}: {bad} not in {values}')
  return out


@pytest.mark.parametrize('doc', _docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_doc_commands_name_real_modules_and_flags(doc):
  assert not _problems(doc), '\n'.join(_problems(doc))


def test_the_check_finds_wrong_flags_and_values(tmp_path):
  doc = tmp_path / 'x.md'
  doc.write_text('Run `python -m experiments.bench_forward --batches=64\n  --no_such_flag=1 '
                 '--attention=dense|sideways` and `python -m ik_gat_jax.solve --input=a.csv '
                 '--output=b.bvh --units=cm` and `python -m experiments.nothing --x`.')
  problems = _problems(doc)
  assert any('--no_such_flag' in p for p in problems), problems
  assert any("['sideways']" in p for p in problems), problems
  assert any('experiments.nothing' in p for p in problems), problems
  assert len(problems) == 3, problems  # solve's flags (defined through aliases) are found
