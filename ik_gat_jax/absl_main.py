"""Running an absl main (`run_main`): as `absl.app.run`, with --help exiting 0, and a config
override of no field or a missing config file refused in one line. Here, below the mains of
both `experiments` and `data_prep` (and re-exported by `experiments.common`), so neither
package imports the other's."""

import contextlib
import os
import re
import signal
import sys
import threading
from typing import Callable, Iterator, NoReturn, Sequence

from absl import app, flags


def run_main(main: Callable, define_flags: Callable[[], None] | None = None,
             required: Sequence[str] = ()) -> None:
  """Runs the absl `main` of a command line as `app.run` does, after `define_flags()` (the
  main's flags, defined only when it runs) and marking the `required` flags, except that:
  - --help (--helpshort, --helpfull, --helpxml) prints its text and exits 0, not absl's 1;
  - an override of a config flag naming a field the config does not have
    (`--config.train.lrr=1`), or a config file that does not exist (`--config=/missing.py`),
    is refused in one line, `error: ...`, exit status 2, not a traceback (absl's other bad
    flags: its two lines, exit status 1);
  - a Ctrl-C that reaches it (the main kept nothing to finish) ends it with `interrupted` and
    exit status 130, not a traceback.
  """
  try:
    if define_flags is not None:
      define_flags()  # a config file flag without --config=FILE parses its overrides here
  except (KeyError, AttributeError) as e:
    _unknown_config_field(e, sys.argv)
  if required:
    flags.mark_flags_as_required(list(required))
  try:
    app.run(main, flags_parser=_parse_flags)
  except KeyboardInterrupt:  # a Ctrl-C no main handled: one line, not a 25-frame traceback
    print('interrupted', file=sys.stderr)
    sys.exit(130)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
  """SIGTERM (what a job scheduler sends at its time limit) raises KeyboardInterrupt, as Ctrl-C
  does, while the block runs (main thread only), so the block's clean-up runs: a stage it stops
  is recorded 'interrupted', not left 'running', a half-written folder is removed; while a
  trainer runs, its own handler (train.GracefulStop) saves a checkpoint first."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def interrupt(signum, frame):
    del signum, frame
    raise KeyboardInterrupt

  old = signal.signal(signal.SIGTERM, interrupt)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, old)


def fail(message: str) -> NoReturn:
  """A command line's refusal of its input: `error: message` on stderr, exit status 2, as every
  main of this project says it (experiments' through `fail_on_user_error`)."""
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (`app.parse_flags_with_usage`), with exit status 0 after a help text
  and a one-line refusal of an override of no config field (`run_main`)."""
  try:
    rest = flags.FLAGS(argv)
  except SystemExit as e:  # only the help flags exit while parsing (bad flags raise Error)
    sys.exit(0 if e.code == 1 else e.code)
  except (KeyError, AttributeError) as e:
    _unknown_config_field(e, argv)
  except OSError as e:  # an override of a config whose file did not load
    _unloaded_config_file(argv, e)
  except flags.Error as e:  # absl's own report, exit status 1 (parsing again, as it was,
    # defined a config file's override flags twice and reported that instead)
    sys.stderr.write(f'FATAL Flags parsing error: {e}\n'
                     'Pass --helpshort or --helpfull to see help on flags.\n')
    sys.exit(1)
  except Exception as e:  # pylint: disable=broad-except  (a config file that failed to run)
    _config_file_error(argv, e)
  _unloaded_config_file(argv)
  return rest


def _config_file_error(argv: Sequence[str], error: Exception) -> NoReturn:
  """Exits 2 with `error: --config=FILE: cannot read it (NameError: ...)` when a config file
  flag is given (its module raised `error` while the flags were parsed: a JSON file given for a
  Python config, a typo in one), else re-raises `error`."""
  config_flags = sys.modules.get('ml_collections.config_flags.config_flags')
  parser = getattr(config_flags, 'ConfigFileFlagParser', None)
  for name in (list(flags.FLAGS) if parser is not None else []):
    if not isinstance(flags.FLAGS[name].parser, parser):
      continue
    path = next((a.split('=', 1)[1] for a in argv[1:] if a.startswith((f'--{name}=',
                                                                          f'-{name}='))), None)
    if path is not None:
      print(f'error: --{name}={path}: cannot read it ({type(error).__name__}: '
            f'{str(error).splitlines()[0] if str(error) else ""}; a config file is Python, '
            'defining get_config())', file=sys.stderr)
      sys.exit(2)
  raise error


def _unloaded_config_file(argv: Sequence[str], error: OSError | None = None) -> None:
  """Exits 2 with `error: --config=/missing.py: no such config file` when a config file flag's
  file could not be read (ml_collections keeps its error until the config is first used: a
  traceback from inside the main); returns when every config file loaded. `error`: the OSError
  an override (`--config.train.lr=1`) of such a config raised while the flags were parsed
  (re-raised when it is not about a config file)."""
  # A main with config file flags has imported their module; one without has none (and
  # need not import it: 0.1 s).
  config_flags = sys.modules.get('ml_collections.config_flags.config_flags')
  unloaded = getattr(config_flags, '_ErrorConfig', None)
  parser = getattr(config_flags, 'ConfigFileFlagParser', None)
  failed = []  # (flag name, its path in argv, the load error)
  for name in (list(flags.FLAGS) if unloaded is not None and parser is not None else []):
    flag = flags.FLAGS[name]
    path = next((a.split('=', 1)[1] for a in argv[1:] if a.startswith((f'--{name}=',
                                                                          f'-{name}='))), None)
    if not isinstance(flag.parser, parser) or path is None:
      continue
    if isinstance(flag.value, unloaded):
      failed.append((name, path, object.__getattribute__(flag.value, '_error')))
    elif error is not None and str(error).startswith('Configuration is not available'):
      # the override failed in this flag's own parse: its value is still the default
      if not os.path.isfile(path.split(':', 1)[0]):
        failed.append((name, path, error.__cause__ or error))
  if failed:
    name, path, cause = failed[0]
    if isinstance(cause, FileNotFoundError) or str(cause).startswith('Failed loading config'):
      why = 'no such config file'
    else:
      why = f'cannot read it ({type(cause).__name__}: {str(cause).splitlines()[0]})'
    print(f'error: --{name}={path}: {why}', file=sys.stderr)
    sys.exit(2)
  if error is not None:
    raise error


def _unknown_config_field(e: BaseException, argv: Sequence[str]) -> NoReturn:
  """Exits 2 with `error: --config.train.lrr: the config has no field train.lrr (did you mean
  --config.train.lr?)` for ml_collections' KeyError or AttributeError `e` about a field that a
  `--NAME.a.b=value` override in `argv` names; re-raises `e` when none does (a bug elsewhere)."""
  chain, x = [], e
  while x is not None and x not in chain:
    chain.append(x)
    x = x.__cause__ or x.__context__
  missing = next((x.args[0] for x in reversed(chain) if isinstance(x, KeyError) and x.args
                  and isinstance(x.args[0], str)), None)
  hint = next((m.group(1) for m in (re.search(r'Did you mean "(\w+)"', str(x)) for x in chain)
               if m), None)
  for arg in argv[1:]:
    m = re.match(r'--?(?:no)?(\w+(?:\.\w+)+)(?:=|$)', arg)
    parts = m.group(1).split('.') if m else []
    if missing in parts[1:]:
      i = parts.index(missing, 1)
      said = f'error: --{m.group(1)}: the config has no field {".".join(parts[1:i + 1])}'
      if hint:
        said += f' (did you mean --{".".join(parts[:i] + [hint] + parts[i + 1:])}?)'
      print(said, file=sys.stderr)
      sys.exit(2)
  raise e
