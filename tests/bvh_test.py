"""Tests for ik_gat_jax.io.bvh: parsing, writing, errors, Euler matrices and the naive FK."""

import re

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from ik_gat_jax.io import bvh


# A small valid file; the corrupt-file cases below edit it by (1-based) line number.
BASE_LINES = [
    "HIERARCHY",  # 1
    "ROOT Hips",  # 2
    "{",  # 3
    "\tOFFSET 0 0 0",  # 4
    "\tCHANNELS 6 Xposition Yposition Zposition Zrotation Yrotation Xrotation",  # 5
    "\tJOINT Chest",  # 6
    "\t{",  # 7
    "\t\tOFFSET 0 1 0",  # 8
    "\t\tCHANNELS 3 Xrotation Yrotation Zrotation",  # 9
    "\t\tEnd Site",  # 10
    "\t\t{",  # 11
    "\t\t\tOFFSET 0 1 0",  # 12
    "\t\t}",  # 13
    "\t}",  # 14
    "}",  # 15
    "MOTION",  # 16
    "Frames: 2",  # 17
    "Frame Time: 0.05",  # 18
    "0 0 0 0 0 0 0 0 0",  # 19
    "1 2 3 4 5 6 7 8 9",  # 20
]


def _text(edits=None, keep=None, final_newline=True):
  """BASE_LINES with {line_number: replacement} edits, optionally only the first `keep` lines."""
  lines = list(BASE_LINES)
  for number, new in (edits or {}).items():
    lines[number - 1] = new
  lines = lines[:keep]
  return "\n".join(lines) + ("\n" if final_newline else "")


def test_base_file_parses():
  m = bvh.parse_bvh(_text())
  assert m.names == ("Hips", "Chest")
  assert m.parents == (-1, 0)
  assert m.num_frames == 2 and m.frame_time == 0.05 and m.fps == pytest.approx(20.0)
  np.testing.assert_array_equal(m.motion[1], np.arange(1, 10))
  np.testing.assert_array_equal(m.joints[1].end_site, [0, 1, 0])
  assert m.joints[0].end_site is None


CORRUPT_CASES = {
    # name: (edits, keep, final_newline, expected line, expected words in the reason)
    "truncated_frames": ({
        17: "Frames: 3"
    }, None, True, 21, "truncated motion"),
    "truncated_no_newline": ({
        17: "Frames: 3"
    }, None, False, 20, "truncated motion"),
    "short_last_line": ({
        20: "1 2 3 4 5"
    }, None, True, 20, "has 5 values, expected 9"),
    "long_line": ({
        19: "0 0 0 0 0 0 0 0 0 0"
    }, None, True, 19, "has 10 values"),
    "extra_frame_lines": ({
        17: "Frames: 1"
    }, None, True, 20, "more frame lines"),
    "not_a_number": ({
        20: "1 2 x 4 5 6 7 8 9"
    }, None, True, 20, "'x'"),
    "not_finite": ({
        19: "0 0 0 0 nan 0 0 0 0"
    }, None, True, 19, "not a finite number"),
    "unclosed_brace": ({
        14: ""
    }, None, True, 16, "unbalanced braces"),
    "extra_close_brace": ({
        15: "}}"
    }, None, True, 15, "without a matching"),
    "missing_open_brace": ({
        7: ""
    }, None, True, 8, "expected '{'"),
    "channels_count": ({
        9: "\t\tCHANNELS 2 Xrotation Yrotation Zrotation"
    }, None, True, 9, "CHANNELS says 2 but lists 3"),
    "channels_no_count": ({
        9: "\t\tCHANNELS Xrotation Yrotation Zrotation"
    }, None, True, 9, "needs a count"),
    "unknown_channel": ({
        9: "\t\tCHANNELS 3 Xrotation Yrotation Wrotation"
    }, None, True, 9, "unknown channel name 'Wrotation'"),
    "duplicate_channel": ({
        9: "\t\tCHANNELS 3 Xrotation Xrotation Zrotation"
    }, None, True, 9, "listed twice"),
    "unknown_keyword": ({
        6: "\tBONE Chest"
    }, None, True, 6, "unknown keyword 'BONE'"),
    "end_without_site": ({
        10: "\t\tEnd"
    }, None, True, 10, "expected 'End Site'"),
    "channels_in_end_site": ({
        12: "\t\t\tCHANNELS 1 Xrotation"
    }, None, True, 12, "CHANNELS outside a joint"),
    "joint_without_offset": ({
        8: ""
    }, None, True, 14, "joint 'Chest' has no OFFSET"),
    "offset_too_short": ({
        8: "\t\tOFFSET 0 1"
    }, None, True, 8, "OFFSET needs 3 numbers"),
    "offset_not_number": ({
        8: "\t\tOFFSET 0 a 0"
    }, None, True, 8, "not a number: 'a'"),
    "joint_without_name": ({
        6: "\tJOINT"
    }, None, True, 6, "JOINT needs a name"),
    "duplicate_joint": ({
        6: "\tJOINT Hips"
    }, None, True, 6, "duplicate joint name 'Hips'"),
    "second_root": ({
        15: "}\nROOT Other\n{\nOFFSET 0 0 0\n}"
    }, None, True, 16, "more than one ROOT"),
    "no_hierarchy": ({
        1: "HIERARCH"
    }, None, True, 1, "expected 'HIERARCHY'"),
    "missing_motion": ({}, 15, True, 15, "missing MOTION section"),
    "missing_frames": ({
        17: "Frams: 2"
    }, None, True, 17, "expected 'Frames: ...'"),
    "negative_frames": ({
        17: "Frames: -2"
    }, None, True, 17, "non-negative integer"),
    "frame_time_zero": ({
        18: "Frame Time: 0"
    }, None, True, 18, "must be positive"),
    "frame_time_missing": ({}, 17, True, 17, "missing 'Frame Time:'"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_CASES))
def test_corrupt_file_gives_one_clear_error(tmp_path, case):
  edits, keep, final_newline, line, words = CORRUPT_CASES[case]
  path = tmp_path / f"{case}.bvh"
  path.write_text(_text(edits, keep, final_newline))
  with pytest.raises(bvh.BVHError) as info:
    bvh.read_bvh(path)
  message = str(info.value)
  assert message.startswith(f"{path}:{line}: "), message
  assert words in message
  assert "\n" not in message
  assert info.value.line == line and info.value.file == str(path)


def test_error_names_the_channel_and_default_source():
  with pytest.raises(bvh.BVHError, match=r"^<string>:20: .*\(Hips Zposition\)"):
    bvh.parse_bvh(_text({20: "1 2 x 4 5 6 7 8 9"}))
  with pytest.raises(bvh.BVHError, match=r"^clip\.bvh:20: "):
    bvh.read_bvh(_text({20: "1 2 x 4 5 6 7 8 9"}), name="clip.bvh")
  assert issubclass(bvh.BVHError, ValueError)


def test_non_utf8_bytes_are_located(tmp_path):
  path = tmp_path / "binary.bvh"
  path.write_bytes(_text({6: "\tJOINT Ch\xffst"}).encode("latin-1"))
  with pytest.raises(bvh.BVHError, match=rf"^{re.escape(str(path))}:6: not UTF-8"):
    bvh.read_bvh(path)


# Mixed channel orders, position channels on a non-root joint, partial channel sets,
# zero channels, lower-case channel names and braces sharing a line.
SYNTHETIC = """HIERARCHY
ROOT root {
  OFFSET 1 2 3
  CHANNELS 6 Zrotation Xposition Xrotation Yposition Yrotation Zposition
  JOINT a
  {
    OFFSET 0 2 0
    CHANNELS 6 Yposition Xposition Zposition Yrotation Zrotation Xrotation
    JOINT b
    {
      OFFSET 1 0 0
      CHANNELS 2 xrotation Zrotation
      End Site
      {
        OFFSET 0.5 0 0
      }
    }
  }
  JOINT c
  {
    OFFSET -1 0 0
    CHANNELS 1 Yposition
    JOINT d
    {
      OFFSET 0 -1 0
      CHANNELS 0
      End Site { OFFSET 0 -1 0 }
    }
  }
}
MOTION
Frames: 3
Frame Time: 0.0333333
10 0.5 20 1.5 30 2.5 0.1 0.2 0.3 40 50 60 70 80 -0.25
0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
-90.125 1 45 2 -30 3 1 -1 0.5 -15 25 -35 12.5 -7.25 3
"""


def test_synthetic_mixed_channels():
  m = bvh.parse_bvh(SYNTHETIC)
  assert m.names == ("root", "a", "b", "c", "d")
  assert m.parents == (-1, 0, 1, 0, 3)
  assert m.joints[2].channels == ("Xrotation", "Zrotation")
  assert m.joints[4].channels == ()
  assert [m.euler_order(j) for j in range(5)] == ["ZXY", "YZX", "XZ", "", ""]
  assert [m.channel_slice(j) for j in (0, 2, 3, 4)
         ] == [slice(0, 6), slice(12, 14), slice(14, 15),
               slice(15, 15)]
  np.testing.assert_array_equal(m.rotation_degrees(0), m.motion[:, [0, 2, 4]])
  np.testing.assert_array_equal(m.rotation_degrees(1), m.motion[:, [9, 10, 11]])
  assert m.rotation_degrees(2).shape == (3, 2) and m.rotation_degrees(3).shape == (3, 0)
  np.testing.assert_array_equal(m.position_channels(0), m.motion[:, [1, 3, 5]])
  np.testing.assert_array_equal(m.position_channels(1), m.motion[:, [7, 6, 8]])
  assert m.position_channels(2) is None and m.position_channels(4) is None
  expected_c = np.stack([np.full(3, -1.0), m.motion[:, 14], np.zeros(3)], axis=-1)
  np.testing.assert_array_equal(m.position_channels(3), expected_c)
  np.testing.assert_array_equal(m.joints[2].end_site, [0.5, 0, 0])
  np.testing.assert_array_equal(m.offsets[3], [-1, 0, 0])


def test_keywords_in_any_case_and_spacing_read_alike():
  # As Blender's importer reads them: 'hierarchy', 'End site', 'Frames:' in any case, 'Frame
  # Time:' with any spacing.
  text = SYNTHETIC
  for old, new in (("HIERARCHY", "hierarchy"), ("ROOT", "Root"), ("JOINT", "joint"),
                   ("OFFSET", "Offset"), ("CHANNELS", "channels"), ("End Site", "END site"),
                   ("MOTION", "Motion"), ("Frames:", "FRAMES:"), ("Frame Time:", "frame   TIME:")):
    assert old in text
    text = text.replace(old, new)
  a, b = bvh.parse_bvh(SYNTHETIC), bvh.parse_bvh(text)
  assert a.names == b.names and a.parents == b.parents and a.frame_time == b.frame_time
  np.testing.assert_array_equal(a.motion, b.motion)
  np.testing.assert_array_equal(a.offsets, b.offsets)
  assert [j.channels for j in a.joints] == [j.channels for j in b.joints]
  np.testing.assert_array_equal(a.joints[2].end_site, b.joints[2].end_site)


def test_other_tools_line_ends_labels_and_spaced_names_read_alike():
  # CR-only line ends (classic Mac OS; Blender reads them), 'Frames:2' without a space, and a
  # 3ds Max Biped name with spaces ('Bip01 Spine'), which a written file keeps.
  a = bvh.parse_bvh(_text())
  for text in (_text().replace("\n", "\r"), _text().replace("\n", "\r\n"),
               _text({17: "Frames:2", 18: "Frame Time:0.05"})):
    b = bvh.parse_bvh(text)
    assert b.names == a.names and b.frame_time == a.frame_time
    np.testing.assert_array_equal(b.motion, a.motion)
  spaced = bvh.parse_bvh(_text({6: "\tJOINT  Bip01   Spine {", 7: ""}))
  assert list(spaced.names) == ["Hips", "Bip01 Spine"] and list(spaced.parents) == [-1, 0]
  assert bvh.parse_bvh(bvh.format_bvh(spaced)).names == spaced.names
  spaced.joints[1].name = "Bip01  Spine"
  with pytest.raises(ValueError, match="cannot be written"):
    bvh.format_bvh(spaced)


def test_errors_stay_one_short_line():
  # A file whose first line is not HIERARCHY (here: one line of 400 KB) is quoted shortly.
  with pytest.raises(bvh.BVHError, match=r"expected 'HIERARCHY'") as e:
    bvh.parse_bvh("HIERARCHY ROOT" + " 0" * 200_000)
  assert len(str(e.value)) < 200 and "\n" not in str(e.value)
  with pytest.raises(bvh.BVHError, match="frames/s"):  # 1 / Frame Time is no rate
    bvh.parse_bvh(_text({18: "Frame Time: 1e-320"}))


def test_synthetic_round_trip_is_exact():
  m = bvh.parse_bvh(SYNTHETIC)
  text = bvh.format_bvh(m)
  m2 = bvh.parse_bvh(text)
  assert m2.names == m.names and m2.parents == m.parents
  assert [j.channels for j in m2.joints] == [j.channels for j in m.joints]
  np.testing.assert_array_equal(m2.offsets, m.offsets)
  np.testing.assert_array_equal(m2.motion, m.motion)
  assert m2.frame_time == m.frame_time
  assert bvh.format_bvh(m2) == text


def _scipy_fk(m):
  """Independent FK for the synthetic file, with scipy rotations and position_channels()."""
  positions = np.zeros((m.num_frames, len(m.joints), 3))
  rotations = np.zeros((m.num_frames, len(m.joints), 3, 3))
  for j, joint in enumerate(m.joints):
    order = m.euler_order(j)
    local = (Rotation.from_euler(order, m.rotation_degrees(j), degrees=True).as_matrix()
             if order else np.tile(np.eye(3), (m.num_frames, 1, 1)))
    translation = m.position_channels(j)
    if translation is None:
      translation = np.tile(joint.offset, (m.num_frames, 1))
    if joint.parent < 0:
      positions[:, j], rotations[:, j] = translation, local
    else:
      parent = rotations[:, joint.parent]
      positions[:, j] = positions[:, joint.parent] + np.einsum("tab,tb->ta", parent, translation)
      rotations[:, j] = parent @ local
  return positions


def test_naive_fk_matches_scipy_on_synthetic():
  m = bvh.parse_bvh(SYNTHETIC)
  np.testing.assert_allclose(bvh.naive_fk_np(m, scale=0.1), 0.1 * _scipy_fk(m), atol=1e-12)


TWO_JOINTS = """HIERARCHY
ROOT root
{
  OFFSET 9 9 9
  CHANNELS 5 Xposition Yposition Zposition Yrotation Xrotation
  JOINT tip
  {
    OFFSET 0 2 0
    CHANNELS 1 Zrotation
    End Site
    {
      OFFSET 0 1 0
    }
  }
}
MOTION
Frames: 2
Frame Time: 0.1
1 2 3 0 0 33
0 0 0 90 90 -20
"""


def test_naive_fk_two_joints_by_hand():
  m = bvh.parse_bvh(TWO_JOINTS)
  # Frame 0: no rotation; the root sits at its position channels (offset replaced).
  # Frame 1: G_root = Ry(90) @ Rx(90); Rx(90) (0,2,0) = (0,0,2); Ry(90) (0,0,2) = (2,0,0).
  expected = np.array([[[1, 2, 3], [1, 4, 3]], [[0, 0, 0], [2, 0, 0]]], dtype=np.float64)
  positions = bvh.naive_fk_np(m, scale=0.5)
  assert positions.shape == (2, 2, 3) and positions.dtype == np.float64
  np.testing.assert_allclose(positions, 0.5 * expected, atol=1e-12)


@pytest.mark.parametrize("order", ["XYZ", "XZY", "YXZ", "YZX", "ZXY", "ZYX", "ZXZ", "XYX", "YZY"])
def test_euler_to_matrix_matches_scipy(order):
  angles = np.random.default_rng(0).uniform(-180, 180, size=(4, 5, 3))
  expected = Rotation.from_euler(order, angles.reshape(-1, 3), degrees=True).as_matrix()
  got = bvh.euler_to_matrix_np(angles, order)
  assert got.shape == (4, 5, 3, 3)
  np.testing.assert_allclose(got.reshape(-1, 3, 3), expected, atol=1e-12)


def test_euler_to_matrix_is_product_in_channel_order():
  rz = bvh.euler_to_matrix_np(np.array([30.0]), "Z")
  rx = bvh.euler_to_matrix_np(np.array([-50.0]), "X")
  np.testing.assert_allclose(bvh.euler_to_matrix_np(np.array([30.0, -50.0]), "ZX"), rz @ rx)
  with pytest.raises(ValueError):
    bvh.euler_to_matrix_np(np.zeros(3), "ZY")


def test_write_is_atomic_and_refuses_bad_motion(tmp_path):
  m = bvh.parse_bvh(_text())
  m.motion = m.motion[:, :5]
  target = tmp_path / "out.bvh"
  with pytest.raises(ValueError, match="shape"):
    bvh.write_bvh(target, m)
  assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["07_01.bvh", "09_01.bvh"])
def test_cmu_round_trip(tmp_path, name, cmu_dir):
  source = cmu_dir / name
  m = bvh.read_bvh(source)
  assert len(m.joints) == 31 and m.motion.shape[1] == 96 and m.path == str(source)
  assert m.euler_order(0) == "ZYX" and m.position_channels(0) is not None
  first, second = tmp_path / "first.bvh", tmp_path / "second.bvh"
  bvh.write_bvh(first, m)
  m2 = bvh.read_bvh(first)
  assert m2.names == m.names and m2.parents == m.parents
  assert [j.channels for j in m2.joints] == [j.channels for j in m.joints]
  np.testing.assert_array_equal(m2.offsets, m.offsets)
  assert m2.frame_time == m.frame_time
  np.testing.assert_allclose(m2.motion, m.motion, rtol=0, atol=5e-7)
  bvh.write_bvh(second, m2)
  assert first.read_bytes() == second.read_bytes()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["first.bvh", "second.bvh"]


def test_namespace_is_dropped_only_when_every_joint_carries_the_same_one():
  assert bvh.namespace(['Anna:Hips', 'Anna:Spine']) == 'Anna:'
  assert bvh.namespace(['a:b:Hips', 'a:b:Spine']) == 'a:b:'  # nested: up to the last ':'
  assert bvh.namespace(['Hips', 'Spine']) == ''
  assert bvh.namespace(['Anna:Hips', 'Ben:Spine']) == ''  # two namespaces: names as they are
  assert bvh.namespace(['Anna:Hips', 'Spine']) == ''
  assert bvh.namespace(['Anna:', 'Anna:Spine']) == ''  # would leave an empty name
  m = bvh.parse_bvh(_text({2: 'ROOT Anna:Hips', 6: '\tJOINT Anna:Chest'}))
  out = bvh.strip_namespace(m)
  assert out.names == ('Hips', 'Chest') and m.names == ('Anna:Hips', 'Anna:Chest')
  assert out.parents == m.parents and out.joints[1].channels == m.joints[1].channels
  np.testing.assert_array_equal(out.motion, m.motion)
  plain = bvh.parse_bvh(_text())
  assert bvh.strip_namespace(plain) is plain
  # Most joints in one namespace, a few not: said so (solve names it instead of "lacks joints").
  assert bvh.partial_namespace(['A:Hips', 'A:Spine', 'Neck']) == (
      "namespace 'A:' on 2 of 3 joints (not on Neck)")
  for whole in (['A:Hips', 'A:Spine'], ['Hips', 'Spine'], ['A:Hips', 'Spine', 'Neck']):
    assert bvh.partial_namespace(whole) is None, whole
