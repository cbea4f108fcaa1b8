"""BVH motion files: reader, writer and a naive numpy forward-kinematics reference.

Pure numpy (no JAX), so data preparation can verify itself independently of the model code.

Conventions (DESIGN.md section 2):
- Euler channels are intrinsic, in channel order: ``Zrotation Yrotation Xrotation`` means
  ``R = Rz @ Ry @ Rx`` (column vectors), angles in degrees as in the file.
- FK: ``G_j = G_parent @ R_j``; ``p_j = p_parent + G_parent @ t_j`` where ``t_j`` is the joint's
  translation: its position channels when it has any (a missing axis keeps the OFFSET's value),
  else its OFFSET. Root: ``p_root = t_root``, ``G_root = R_root``.

Parsing choices (strict on purpose: every problem is ONE ``BVHError`` "<file>:<line>: <reason>"):
- lines end in LF, CRLF or CR alone (classic Mac OS, as Blender's importer reads them);
- exactly one ROOT; joint names are unique, the rest of their line up to a brace (3ds Max
  Biped's ``Bip01 L Thigh``: words joined by one space); "End Site" is not a joint (its offset is
  stored on its parent as ``end_site``, at most one per joint);
- channel names are case-insensitive and stored capitalised (``Xposition``, ``Zrotation``...);
  a joint may list 0..6 distinct channels in any order; a missing CHANNELS line means none;
- ``CHANNELS n`` must list exactly n names on the same line;
- the number of non-blank frame lines must equal ``Frames:``; every frame line must hold exactly
  the total channel count of finite numbers; blank lines in the motion block are ignored.

Namespaces (`strip_namespace`, called by the project's readers above this module, not by
`read_bvh`): when every joint name carries the same namespace, as Maya, MotionBuilder and
Mixamo (``mixamorig:Hips``) write them and motion-capture software per subject (``Anna:Hips``),
it is dropped, so files of several subjects share one hierarchy and match a rig or joint map
by the bare names.

Writing: motion values in fixed-point with ``precision`` decimals (trailing zeros dropped, so a
written file re-read and re-written is byte-identical), offsets and frame time exactly (shortest
repr); the file is written atomically (temp file in the same directory, then ``os.replace``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import numpy as np

from ik_gat_jax.io import atomic

from ik_gat_jax import skeleton

POSITION_CHANNELS = ("Xposition", "Yposition", "Zposition")
ROTATION_CHANNELS = ("Xrotation", "Yrotation", "Zrotation")
_CANONICAL = {c.lower(): c for c in POSITION_CHANNELS + ROTATION_CHANNELS}
_BRACES = ("{", "}")
_LINE_END = re.compile(r"\r\n|\r|\n")
# The shortest Frame Time read (100 kHz): below it 1 / Frame Time is no motion-capture rate.
_MIN_FRAME_TIME = 1e-5


def _quote(text: str, limit: int = 60) -> str:
  """``repr`` of ``text`` cut to ``limit`` characters, for a one-line error."""
  return repr(text if len(text) <= limit else text[:limit] + "...")


def _is_count(token: str) -> bool:
  """A non-negative decimal integer written with ASCII digits only."""
  return token.isascii() and token.isdigit()


class BVHError(ValueError):
  """A malformed BVH file. ``str(e)`` is always ``"<file>:<line>: <reason>"``."""

  def __init__(self, file: str, line: int, reason: str):
    super().__init__(f"{file}:{line}: {reason}")
    self.file, self.line, self.reason = file, line, reason


@dataclasses.dataclass(eq=False)
class BVHJoint:
  """One joint, in file (depth-first) order. End Sites are not joints.

    Attributes:
      name: joint name.
      parent: index of the parent joint, -1 for the root.
      offset: [3] float64 rest offset from the parent, in the parent's frame, file units.
      channels: channel names in file order, e.g. ('Zrotation', 'Yrotation', 'Xrotation').
      end_site: [3] offset of the joint's End Site child, or None.
    """

  name: str
  parent: int
  offset: np.ndarray
  channels: tuple[str, ...]
  end_site: np.ndarray | None = None


@dataclasses.dataclass(eq=False)
class BVHMotion:
  """A parsed BVH file.

    Attributes:
      joints: [J] joints in file order (parents before children).
      frame_time: seconds per frame.
      motion: [T, C] float64 raw channel values as in the file, C = total channel count.
      path: where it came from (file path or the name given for text), or None.
    """

  joints: list[BVHJoint]
  frame_time: float
  motion: np.ndarray
  path: str | None = None

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(j.name for j in self.joints)

  @property
  def parents(self) -> tuple[int, ...]:
    return tuple(j.parent for j in self.joints)

  @property
  def offsets(self) -> np.ndarray:
    """[J, 3] float64 rest offsets, file units."""
    return np.stack([j.offset for j in self.joints]).astype(np.float64)

  @property
  def num_frames(self) -> int:
    return int(self.motion.shape[0])

  @property
  def num_channels(self) -> int:
    return sum(len(j.channels) for j in self.joints)

  @property
  def fps(self) -> float:
    return 1.0 / self.frame_time

  def channel_slice(self, j: int) -> slice:
    """Columns of joint ``j`` in ``motion``."""
    start = sum(len(joint.channels) for joint in self.joints[:j])
    return slice(start, start + len(self.joints[j].channels))

  def euler_order(self, j: int) -> str:
    """Rotation axes of joint ``j`` in channel order, e.g. 'ZYX'; '' without rotations."""
    return "".join(c[0] for c in self.joints[j].channels if c in ROTATION_CHANNELS)

  def rotation_degrees(self, j: int) -> np.ndarray:
    """[T, len(euler_order(j))] rotation channel values (degrees) in ``euler_order`` order."""
    cols = self.motion[:, self.channel_slice(j)]
    keep = [k for k, c in enumerate(self.joints[j].channels) if c in ROTATION_CHANNELS]
    return cols[:, keep]

  def position_channels(self, j: int) -> np.ndarray | None:
    """[T, 3] joint translation (x, y, z) from its position channels, or None without any.

        An axis without a channel keeps the joint's OFFSET value on that axis.
        """
    channels = self.joints[j].channels
    if not any(c in POSITION_CHANNELS for c in channels):
      return None
    cols = self.motion[:, self.channel_slice(j)]
    out = np.tile(np.asarray(self.joints[j].offset, np.float64), (self.num_frames, 1))
    for k, c in enumerate(channels):
      if c in POSITION_CHANNELS:
        out[:, POSITION_CHANNELS.index(c)] = cols[:, k]
    return out


# ----------------------------------------------------------------------------- namespaces


def namespace(names) -> str:
  """The namespace (up to and including the last ':') that every one of `names` carries, e.g.
  'Anna:' for ('Anna:Hips', 'Anna:Spine'); '' when they do not all carry the same non-empty
  one, or when dropping it would leave an empty name."""
  spaces = {n[:n.rfind(':') + 1] for n in names}
  if len(spaces) != 1:
    return ''
  (space,) = spaces
  return space if all(len(n) > len(space) for n in names) else ''


def partial_namespace(names) -> str | None:
  """Where most of `names` carry one namespace and some do not (a file edited by hand or by a
  tool that renamed a joint): 'namespace 'Anna:' on 26 of 27 joints (not on Spine1)', said
  instead of the joints the others seem to lack; None otherwise."""
  names = list(names)
  spaces = [n[:n.rfind(':') + 1] for n in names]
  common = max(set(spaces), key=spaces.count)
  if not common or namespace(names) or 2 * spaces.count(common) <= len(names):
    return None
  off = [n for n, s in zip(names, spaces) if s != common]
  return (f'namespace {common!r} on {len(names) - len(off)} of {len(names)} joints (not on '
          f'{", ".join(off[:4])}{" ..." if len(off) > 4 else ""})')


def strip_namespace(motion: BVHMotion) -> BVHMotion:
  """`motion` with its joints' common `namespace` dropped (the same object when there is
  none); offsets, channels and motion unchanged."""
  space = namespace(motion.names)
  if not space:
    return motion
  joints = [dataclasses.replace(j, name=j.name[len(space):]) for j in motion.joints]
  return dataclasses.replace(motion, joints=joints)


# ----------------------------------------------------------------------------- reading


def read_bvh(path_or_text: str | os.PathLike, *, name: str | None = None) -> BVHMotion:
  """Reads a BVH file (a path) or BVH text (a str containing a newline).

    ``name`` names the source in error messages and ``BVHMotion.path`` (default: the path, or
    '<string>' in messages for text). Missing files raise OSError as usual.
    """
  if isinstance(path_or_text, str) and "\n" in path_or_text:
    return parse_bvh(path_or_text, path=name)
  path = os.fspath(path_or_text)
  display = name if name is not None else path
  data = Path(path).read_bytes()
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = data.count(b"\n", 0, e.start) + 1
    raise BVHError(display, line, f"not UTF-8/ASCII text (byte {data[e.start]:#04x})") from None
  return parse_bvh(text, path=display)


def parse_bvh(text: str, path: str | None = None) -> BVHMotion:
  """Parses BVH text. ``path`` only names the source (errors, ``BVHMotion.path``)."""
  src = path if path is not None else "<string>"
  lines = _LINE_END.split(text.lstrip("\ufeff"))
  joints, motion_idx = _HierarchyParser(src, lines).parse()
  frames, frame_time, body_idx = _parse_motion_header(src, lines, motion_idx)
  num_channels = sum(len(j.channels) for j in joints)
  motion = _parse_frames(src, lines, body_idx, frames, num_channels, joints)
  return BVHMotion(joints=joints, frame_time=frame_time, motion=motion, path=path)


def _last_line(lines: list[str]) -> int:
  """1-based number of the last non-blank line (1 for an empty text)."""
  return next((i + 1 for i in range(len(lines) - 1, -1, -1) if lines[i].strip()), 1)


def _parse_float(src: str, line: int, token: str, what: str) -> float:
  try:
    value = float(token)
  except ValueError:
    raise BVHError(src, line, f"{what}: not a number: {token!r}") from None
  if not np.isfinite(value):
    raise BVHError(src, line, f"{what}: not a finite number: {token!r}")
  return value


class _HierarchyParser:
  """Parses the HIERARCHY section statement by statement (braces may share a line)."""

  def __init__(self, src: str, lines: list[str]):
    self.src, self.lines = src, lines
    self.joints: list[BVHJoint] = []
    self.stack: list[tuple[str, int, int]] = []  # (kind 'joint'|'end', joint index, line)
    self.pending: tuple[str, int, int] | None = None  # block announced, waiting for '{'
    self.seen_offset: set[tuple[str, int]] = set()
    self.seen_channels: set[int] = set()
    self.root_done = False

  def error(self, line: int, reason: str) -> BVHError:
    return BVHError(self.src, line, reason)

  def parse(self) -> tuple[list[BVHJoint], int]:
    """Returns (joints, index of the MOTION line)."""
    header_seen = False
    for idx, raw in enumerate(self.lines):
      tokens = raw.replace("{", " { ").replace("}", " } ").split()
      if not tokens:
        continue
      line = idx + 1
      if not header_seen:
        if [t.upper() for t in tokens] != ["HIERARCHY"]:
          raise self.error(line, f"expected 'HIERARCHY', got {_quote(raw.strip())}")
        header_seen = True
        continue
      if tokens[0].upper() == "MOTION":
        self._finish(line)
        if len(tokens) > 1:
          raise self.error(line, f"unexpected text after MOTION: {tokens[1]!r}")
        return self.joints, idx
      while tokens:
        tokens = self._statement(line, tokens)
    last = _last_line(self.lines)
    if not header_seen:
      raise self.error(1, "empty file: expected 'HIERARCHY'")
    self._finish(last)
    raise self.error(last, "missing MOTION section")

  def _finish(self, line: int) -> None:
    if self.pending:
      raise self.error(line, f"expected '{{' after line {self.pending[2]}")
    if self.stack:
      kind, j, opened = self.stack[-1]
      what = "End Site" if kind == "end" else f"joint {self.joints[j].name!r}"
      raise self.error(
          line, f"unbalanced braces: {what} opened at line {opened} "
          f"is not closed ({len(self.stack)} block(s) open)")
    if not self.joints:
      raise self.error(line, "no ROOT joint in HIERARCHY")

  def _statement(self, line: int, tokens: list[str]) -> list[str]:
    """Consumes one statement from ``tokens``; returns the rest of the line."""
    rest = tokens[1:]
    # Keywords in any case, as Blender's importer reads them ('End site', 'Offset').
    key = tokens[0].upper()
    if self.pending and key != "{":
      raise self.error(line, f"expected '{{' after line {self.pending[2]}, got {tokens[0]!r}")
    if key == "{":
      if not self.pending:
        raise self.error(line, "unexpected '{'")
      self.stack.append(self.pending)
      self.pending = None
      return rest
    if key == "}":
      self._close(line)
      return rest
    if key in ("ROOT", "JOINT"):
      return self._joint(line, key, rest)
    if key == "END":
      if not rest or rest[0].upper() != "SITE":
        raise self.error(line, "expected 'End Site'")
      return self._end_site(line, rest[1:])
    if key == "OFFSET":
      return self._offset(line, rest)
    if key == "CHANNELS":
      return self._channels(line, rest)
    raise self.error(
        line, f"unknown keyword {tokens[0]!r} (expected ROOT, JOINT, End Site, "
        "OFFSET, CHANNELS, '{' or '}')")

  def _close(self, line: int) -> None:
    if not self.stack:
      raise self.error(line, "unbalanced braces: '}' without a matching '{'")
    kind, j, _ = self.stack.pop()
    if (kind, j) not in self.seen_offset:
      what = "End Site" if kind == "end" else f"joint {self.joints[j].name!r}"
      raise self.error(line, f"{what} has no OFFSET")
    if not self.stack:
      self.root_done = True

  def _joint(self, line: int, key: str, rest: list[str]) -> list[str]:
    if key == "ROOT" and (self.stack or self.root_done):
      raise self.error(line, "more than one ROOT (only one skeleton per file)")
    if key == "JOINT" and not self.stack:
      raise self.error(line, "JOINT outside the ROOT block")
    if self.stack and self.stack[-1][0] == "end":
      raise self.error(line, f"{key} inside an End Site")
    n = next((i for i, t in enumerate(rest) if t in _BRACES), len(rest))
    if n == 0:
      raise self.error(line, f"{key} needs a name")
    name = " ".join(rest[:n])  # 'Bip01 L Thigh' (3ds Max Biped)
    if name in (j.name for j in self.joints):
      raise self.error(line, f"duplicate joint name {name!r}")
    parent = self.stack[-1][1] if self.stack else -1
    self.joints.append(BVHJoint(name, parent, np.zeros(3), ()))
    self.pending = ("joint", len(self.joints) - 1, line)
    return rest[n:]

  def _end_site(self, line: int, rest: list[str]) -> list[str]:
    if not self.stack or self.stack[-1][0] != "joint":
      raise self.error(line, "End Site must be inside a joint")
    j = self.stack[-1][1]
    if self.joints[j].end_site is not None:
      raise self.error(line, f"joint {self.joints[j].name!r} has more than one End Site")
    self.joints[j].end_site = np.zeros(3)
    self.pending = ("end", j, line)
    return rest

  def _offset(self, line: int, rest: list[str]) -> list[str]:
    if not self.stack:
      raise self.error(line, "OFFSET outside a joint")
    kind, j, _ = self.stack[-1]
    if (kind, j) in self.seen_offset:
      raise self.error(line, "second OFFSET in the same block")
    values = rest[:3]
    if len(values) != 3 or any(v in _BRACES for v in values):
      raise self.error(line, f"OFFSET needs 3 numbers, got {len(values)}")
    offset = np.array([_parse_float(self.src, line, v, "OFFSET") for v in values])
    if kind == "end":
      self.joints[j].end_site = offset
    else:
      self.joints[j].offset = offset
    self.seen_offset.add((kind, j))
    return rest[3:]

  def _channels(self, line: int, rest: list[str]) -> list[str]:
    if not self.stack or self.stack[-1][0] != "joint":
      raise self.error(line, "CHANNELS outside a joint (End Sites have none)")
    j = self.stack[-1][1]
    if j in self.seen_channels:
      raise self.error(line, "second CHANNELS line in the same joint")
    n = 0
    while n < len(rest) and rest[n] not in _BRACES:
      n += 1
    args, after = rest[:n], rest[n:]
    if not args or not _is_count(args[0]):
      raise self.error(line, f"CHANNELS needs a count, got {args[:1]}")
    count, names = int(args[0]), args[1:]
    if count != len(names):
      raise self.error(line, f"CHANNELS says {count} but lists {len(names)} name(s)")
    channels = []
    for c in names:
      if c.lower() not in _CANONICAL:
        raise self.error(line, f"unknown channel name {c!r} (expected "
                         "X/Y/Z + position/rotation)")
      if _CANONICAL[c.lower()] in channels:
        raise self.error(line, f"channel {c!r} listed twice")
      channels.append(_CANONICAL[c.lower()])
    self.joints[j].channels = tuple(channels)
    self.seen_channels.add(j)
    return after


def _header_value(src: str, lines: list[str], idx: int, label: str) -> tuple[str, int]:
  """Finds the next non-blank line from ``idx``; it must be ``label value``."""
  while idx < len(lines) and not lines[idx].strip():
    idx += 1
  if idx >= len(lines):
    raise BVHError(src, _last_line(lines), f"missing '{label}' line in MOTION section")
  text = lines[idx].strip()
  head, colon, tail = text.partition(":")
  # The label in any case and spacing ('FRAMES:', 'Frame  Time:', 'Frames:301'), as Blender
  # reads it.
  if not colon or head.lower().split() != label.lower().rstrip(":").split():
    raise BVHError(src, idx + 1, f"expected '{label} ...', got {_quote(text)}")
  value = tail.split()
  if len(value) != 1:
    raise BVHError(src, idx + 1, f"expected one value after '{label}', got {value}")
  return value[0], idx


def _parse_motion_header(src: str, lines: list[str], motion_idx: int) -> tuple[int, float, int]:
  """Returns (frames, frame_time, index of the first line after 'Frame Time:')."""
  token, idx = _header_value(src, lines, motion_idx + 1, "Frames:")
  if not _is_count(token):
    raise BVHError(src, idx + 1, f"Frames: must be a non-negative integer, got {token!r}")
  frames = int(token)
  token, idx = _header_value(src, lines, idx + 1, "Frame Time:")
  frame_time = _parse_float(src, idx + 1, token, "Frame Time")
  if frame_time <= 0:
    raise BVHError(src, idx + 1, f"Frame Time must be positive, got {token!r}")
  if frame_time < _MIN_FRAME_TIME:
    raise BVHError(src, idx + 1, f"Frame Time {token} s is {1 / frame_time:.3g} frames/s: "
                   f"at least {_MIN_FRAME_TIME:g} s expected")
  return frames, frame_time, idx + 1


def _parse_frames(src: str, lines: list[str], start: int, frames: int, num_channels: int,
                  joints: list[BVHJoint]) -> np.ndarray:
  """[frames, num_channels] float64 from the frame lines (numpy fast path, then locate errors)."""
  numbered = [(i + 1, lines[i]) for i in range(start, len(lines)) if lines[i].strip()]
  rows = [text.split() for _, text in numbered]
  for (line, _), row in zip(numbered, rows):
    if len(row) != num_channels:
      raise BVHError(src, line, f"frame line has {len(row)} values, "
                     f"expected {num_channels} channels")
  if num_channels == 0:  # frame lines are blank: nothing to count
    return np.zeros((frames, 0))
  if len(numbered) < frames:
    at = numbered[-1][0] + 1 if numbered else start + 1
    raise BVHError(
        src, min(at, len(lines)), f"truncated motion: 'Frames: {frames}' "
        f"but only {len(numbered)} frame line(s)")
  if len(numbered) > frames:
    raise BVHError(src, numbered[frames][0], f"more frame lines than 'Frames: {frames}'")
  try:
    motion = np.array(rows, dtype=np.float64).reshape(frames, num_channels)
    if np.isfinite(motion).all():
      return motion
  except ValueError:
    pass
  owner = [f"{j.name} {c}" for j in joints for c in j.channels]
  return np.array([[
      _parse_float(src, line, token, f"value {k + 1} ({owner[k]})") for k, token in enumerate(row)
  ] for (line, _), row in zip(numbered, rows)],
                  dtype=np.float64)


# ----------------------------------------------------------------------------- writing


def _fmt_exact(value: float) -> str:
  """Shortest text that parses back to exactly ``value``."""
  return repr(float(value))


def _fmt_fixed(value: float, precision: int) -> str:
  """Fixed-point with ``precision`` decimals, trailing zeros dropped, no '-0'."""
  text = f"{value:.{precision}f}"
  if "." in text:
    text = text.rstrip("0").rstrip(".")
  return "0" if text == "-0" else text


def format_bvh(motion: BVHMotion, precision: int | None = 6) -> str:
  """BVH text for ``motion``: tabs, '\\n' line ends, motion values to ``precision`` decimals.

    ``precision=None`` writes every value exactly (shortest repr). Offsets and the frame time are
    always exact. Raises ValueError if ``motion.motion`` is not [T, total channels] and finite.
    """
  _check_writable_order(motion)
  data = np.asarray(motion.motion, dtype=np.float64)
  if data.ndim != 2 or data.shape[1] != motion.num_channels:
    raise ValueError(f"motion has shape {data.shape}, expected [T, {motion.num_channels}]")
  if not np.isfinite(data).all():
    raise ValueError("motion contains non-finite values")
  out = ["HIERARCHY"]
  _format_joint(motion.joints, 0, 0, out)
  out += ["MOTION", f"Frames: {data.shape[0]}", f"Frame Time: {_fmt_exact(motion.frame_time)}"]
  if precision is None:
    fmt = _fmt_exact
  else:
    fmt = lambda v: _fmt_fixed(v, precision)  # noqa: E731
  out += [" ".join(map(fmt, row)) for row in data.tolist()]
  return "\n".join(out) + "\n"


def _format_joint(joints: list[BVHJoint], j: int, depth: int, out: list[str]) -> None:
  """Appends joint ``j`` and its subtree, depth-first in index order."""
  tab, joint = "\t" * depth, joints[j]
  out += [
      f"{tab}{'ROOT' if joint.parent < 0 else 'JOINT'} {joint.name}", f"{tab}{{",
      f"{tab}\tOFFSET {' '.join(_fmt_exact(v) for v in joint.offset)}",
      f"{tab}\tCHANNELS {len(joint.channels)} {' '.join(joint.channels)}".rstrip()
  ]
  for child in range(j + 1, len(joints)):
    if joints[child].parent == j:
      _format_joint(joints, child, depth + 1, out)
  if joint.end_site is not None:
    out += [
        f"{tab}\tEnd Site", f"{tab}\t{{",
        f"{tab}\t\tOFFSET {' '.join(_fmt_exact(v) for v in joint.end_site)}", f"{tab}\t}}"
    ]
  out.append(f"{tab}}}")


def write_bvh(path: str | os.PathLike, motion: BVHMotion, *, precision: int | None = 6) -> None:
  """Writes ``format_bvh(motion, precision)`` to ``path`` atomically (``io.atomic``)."""
  atomic.write_text(path, format_bvh(motion, precision))


def _check_writable_order(motion: BVHMotion) -> None:
  """Joints must be depth-first with one root first, or the written file reorders columns."""
  parents = motion.parents
  if not parents or parents[0] != -1 or any(p < 0 for p in parents[1:]):
    raise ValueError("BVH needs exactly one root, as joint 0")
  if skeleton.depth_first_order(parents) != list(range(len(parents))):
    raise ValueError("joints are not in depth-first order; reorder before writing")
  for name in motion.names:  # read back as written: words joined by one space, no braces
    if name != " ".join(name.split()) or not name or "{" in name or "}" in name:
      raise ValueError(f"joint name {name!r} cannot be written to BVH (empty, braces, or "
                       "whitespace other than single spaces between words)")


# ----------------------------------------------------------------------------- numpy reference


def _axis_rotation_np(axis: str, degrees: np.ndarray) -> np.ndarray:
  """[..., 3, 3] rotation by ``degrees`` [...] about axis 'X', 'Y' or 'Z' (column vectors)."""
  a = np.deg2rad(np.asarray(degrees, dtype=np.float64))
  c, s = np.cos(a), np.sin(a)
  one, zero = np.ones_like(a), np.zeros_like(a)
  rows = {
      "X": [[one, zero, zero], [zero, c, -s], [zero, s, c]],
      "Y": [[c, zero, s], [zero, one, zero], [-s, zero, c]],
      "Z": [[c, -s, zero], [s, c, zero], [zero, zero, one]],
  }[axis.upper()]
  return np.stack([np.stack(r, axis=-1) for r in rows], axis=-2)


def euler_to_matrix_np(angles_deg: np.ndarray, order: str) -> np.ndarray:
  """Intrinsic Euler angles to rotation matrices: ``R = R_order[0] @ R_order[1] @ R_order[2]``.

    Args:
      angles_deg: [..., len(order)] degrees, in ``order`` order.
      order: axes, e.g. 'ZYX' (=> Rz @ Ry @ Rx, scipy ``from_euler('ZYX')``) or 'ZXZ'.
    Returns:
      [..., 3, 3] float64.
    """
  angles = np.asarray(angles_deg, dtype=np.float64)
  if angles.shape[-1:] != (len(order),) or not set(order.upper()) <= set("XYZ"):
    raise ValueError(f"angles {angles.shape} do not match Euler order {order!r}")
  result = np.broadcast_to(np.eye(3), angles.shape[:-1] + (3, 3))
  for k, axis in enumerate(order):
    result = result @ _axis_rotation_np(axis, angles[..., k])
  return result


def naive_fk_np(motion: BVHMotion, scale: float = 1.0, with_rotations: bool = False):
  """Joint positions [T, J, 3] float64 by an obvious per-joint loop over the raw channels.

    The independent reference that converters verify against: for each joint in file order,
    translation t = OFFSET with position channels substituted per axis; local R = product of the
    rotation channels in channel order; ``G = G_parent @ R``, ``p = p_parent + G_parent @ t``;
    all positions times ``scale``. With ``with_rotations``: ``(positions, G [T, J, 3, 3])``.
    """
  T = motion.motion.shape[0]
  positions = np.zeros((T, len(motion.joints), 3))
  rotations = np.zeros((T, len(motion.joints), 3, 3))
  column = 0
  for j, joint in enumerate(motion.joints):
    translation = np.tile(np.asarray(joint.offset, np.float64), (T, 1))
    local = np.tile(np.eye(3), (T, 1, 1))
    for name in joint.channels:
      values = motion.motion[:, column]
      column += 1
      if name.endswith("position"):
        translation[:, "XYZ".index(name[0])] = values
      else:
        local = local @ _axis_rotation_np(name[0], values)
    if joint.parent < 0:
      positions[:, j] = translation
      rotations[:, j] = local
    else:
      parent_rot = rotations[:, joint.parent]
      positions[:,
                j] = positions[:, joint.parent] + np.einsum("tab,tb->ta", parent_rot, translation)
      rotations[:, j] = parent_rot @ local
  return (positions * scale, rotations) if with_rotations else positions * scale
