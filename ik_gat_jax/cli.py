"""The `ik-gat` console script (setup.cfg entry point `ik_gat_jax.cli:entry`).

  ik-gat solve --input=FILE --output=FILE [--checkpoint=DIR] ...   positions -> rotations
  ik-gat solve --help                                              the solve flags
  ik-gat --help                                                    this text

Each command is the matching `python -m` main (`ik-gat solve` = `python -m ik_gat_jax.solve`).
"""

from __future__ import annotations

import sys

COMMANDS = {
    'solve': 'joint positions (.npz/.csv/.bvh) -> joint rotations (.bvh/.glb/.fbx/.npz/'
             '.smpl.npz)',
}


def usage(prog: str = 'ik-gat') -> str:
  lines = [f'usage: {prog} COMMAND [--flags]', '', 'commands:']
  lines += [f'  {name:8s} {text}' for name, text in COMMANDS.items()]
  lines += ['', f'`{prog} COMMAND --help` lists the flags of a command, e.g.',
            f'  {prog} solve --input=walk.npz --output=walk.bvh --checkpoint=ikgat_fast']
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
  """Dispatches `argv` (argv[0] = program name; default sys.argv); returns the exit status."""
  argv = list(sys.argv if argv is None else argv)
  prog = 'ik-gat'
  args = argv[1:]
  if not args or args[0] in ('-h', '--help', 'help'):
    print(usage(prog))
    return 0 if args else 2
  command = args[0]
  if command not in COMMANDS:
    print(f'error: unknown command {command!r}; commands: {", ".join(COMMANDS)} '
          f'(`{prog} --help`)', file=sys.stderr)
    return 2
  from ik_gat_jax import solve
  return solve.run([f'{prog} {command}'] + args[1:])


def entry() -> None:
  """The console script: `main` on sys.argv, then the command line's exit
  (`solve.exit_process`: no final garbage collection)."""
  status = main()
  solve = sys.modules.get('ik_gat_jax.solve')  # loaded by a command (not by `--help`)
  if solve is None:
    sys.exit(status)
  solve.exit_process(status)


if __name__ == '__main__':
  entry()
