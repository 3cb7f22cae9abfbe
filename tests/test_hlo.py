"""`jdp.hlo`'s rules, each held to a small hand-written HLO text, and its reading of one real compiled program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jdp import hlo
from jdp.hlo import CommBytes


def _entry(*instructions: str) -> str:
    """A module whose entry computation holds `instructions`."""
    return "HloModule m\n\nENTRY %main (p: f32[8]) -> f32[8] {\n" + "".join(f"  {i}\n" for i in instructions) + "}\n"


LOOP_AND_BRANCHES = """HloModule m

%body (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
}

%startup (p: f32[4]) -> f32[4] {
  ROOT %ar1 = f32[100]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
}

%steady (p: f32[4]) -> f32[4] {
  ROOT %ag = (f32[2]{0}, f32[4]{0}) all-gather-start(%p), replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (a: f32[8], b: pred[]) -> f32[8] {
  %w = f32[8]{0} while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %c = f32[4]{0} conditional(%b, %x, %x), true_computation=%steady, false_computation=%startup
  ROOT %rs = f32[4]{0} reduce-scatter(%w), replica_groups={{0,1}}, dimensions={0}, to_apply=%add
}
"""


def test_loops_two_branch_conditionals_and_asynchronous_collectives():
    """A loop's body counts its trip count times (3 x 32 bytes); a conditional only its true branch, once per
    period (an asynchronous all-gather's operand: 2 floats); a reduce-scatter its result times the group (4 x 4 x
    2). Breaks if a loop is counted once, a start-up branch is counted, or a gather-start's result is counted."""
    assert hlo.collectives(LOOP_AND_BRANCHES, 2).total == 3 * 32 + 8 + 32
    assert hlo.collectives(LOOP_AND_BRANCHES, 2, period=4).total == 3 * 32 + 8 / 4 + 32
    assert hlo.collectives(LOOP_AND_BRANCHES.replace(', backend_config={"known_trip_count":{"n":"3"}}', ""),
                           2).total == 32 + 8 + 32
    with pytest.raises(ValueError, match="no ENTRY"):
        hlo.collectives("HloModule m\n", 2)


def test_lax_cond_as_an_index_conditional_counts_its_true_branch():
    """`lax.cond` lowers to an index conditional {false, true}: the true branch alone, once per period. Breaks if
    the two-branch form is read as a staggered sync (the start-up path's 400 bytes counted)."""
    text = LOOP_AND_BRANCHES.replace("true_computation=%steady, false_computation=%startup",
                                     "branch_computations={%startup, %steady}")
    assert hlo.collectives(text, 2, period=4).total == 3 * 32 + 8 / 4 + 32


STAGGERED = """HloModule m

%nothing (p: f32[4]) -> f32[4] {
  ROOT %p = f32[4]{0} parameter(0)
}

%frag0 (p: f32[4]) -> f32[4] {
  ROOT %ar0 = f32[4]{0} all-reduce(%p), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}

%frag1 (p: f32[4]) -> f32[4] {
  ROOT %ar1 = f32[8]{0} all-reduce(%p), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}

%frag2 (p: f32[4]) -> f32[4] {
  ROOT %ar2 = f32[20]{0} all-reduce(%p), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}

ENTRY %main (a: f32[4], i: s32[]) -> f32[4] {
  ROOT %c = f32[4]{0} conditional(%i, %a, %a, %a, %a), branch_computations={%nothing, %frag0, %frag1, %frag2}
}
"""


def test_a_staggered_switch_counts_each_fragment_once_a_period():
    """`lax.switch` over {nothing, fragment 0, 1, 2}: each fragment synced once every period steps, (16 + 32 + 80)
    / 4 bytes a step; without the branch of nothing (one fragment every step) the same. Breaks if only the last
    fragment is counted (80 / 4), or the first branch is taken for nothing."""
    assert hlo.collectives(STAGGERED, 8, period=4).total == (16 + 32 + 80) / 4
    no_idle = STAGGERED.replace("%nothing, ", "").replace("%a, %a, %a, %a", "%a, %a, %a")
    assert hlo.collectives(no_idle, 8, period=3).total == (16 + 32 + 80) / 3


def test_an_all_to_all_is_counted():
    """An all-to-all sends its operand (the result's size), in its tuple form and asynchronously. Breaks if it
    counts nothing (or a ragged one does), or a -start counts its operands and results both."""
    assert hlo.collectives(_entry(
        "%a = (f32[1,8]{1,0}, f32[1,8]{1,0}) all-to-all(%x, %y), channel_id=1, replica_groups={{0,1}}"), 2).total == 64
    assert hlo.collectives(_entry(
        "%a = ((s8[4,8]{1,0}), s8[4,8]{1,0}) all-to-all-start(%x), replica_groups={{0,1,2,3}}, dimensions={0}"),
        4).total == 32
    assert hlo.collectives(_entry(  # a ragged one: its output buffer, the most it moves
        "%r = f32[6,8]{1,0} ragged-all-to-all(%x, %out, %o, %s, %o, %s), replica_groups={{0,1}}"), 2).total == 192


def test_a_collective_permute_is_counted():
    """A collective-permute sends its operand; the -start form's result also holds the received buffer and two
    u32 contexts. Breaks if a permute counts nothing, or its -start counts more than the operand."""
    pairs = "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}"
    assert hlo.collectives(_entry(f"%c = f32[4,8]{{1,0}} collective-permute(%x), channel_id=1, {pairs}"),
                           4).total == 128
    assert hlo.collectives(_entry(
        f"%c = (f32[4,8]{{1,0}}, f32[4,8]{{1,0}}, u32[], u32[]) collective-permute-start(%x), {pairs}"), 4).total == 128


def test_sub_byte_and_float8_payloads():
    """int4 packed two to a uint8 by hand sends its u8 bytes; an s4 (u4) shape is half a byte an element, rounded
    up to a byte per array; float8 one byte. Breaks if a 4-bit shape counts nothing, or a byte an element."""
    gather = "all-gather(%x), replica_groups={{0,1}}, dimensions={0}"
    assert hlo.collectives(_entry(f"%g = u8[32]{{0}} {gather}"), 2).total == 16
    assert hlo.collectives(_entry(f"%g = s4[64]{{0}} {gather}"), 2).total == 16
    assert hlo.collectives(_entry(f"%g = u4[64]{{0}} {gather}"), 2).total == 16
    assert hlo.collectives(_entry(f"%g = f8e4m3fn[64]{{0}} {gather}"), 2).total == 32
    assert hlo.shape_bytes("s4[3]\nf8e5m2[2,2]\nbf16[4]") == 2 + 4 + 8


@pytest.mark.parametrize("groups", ["{{0,1,2,3},{4,5,6,7}}", "[2,4]<=[8]"])
def test_a_grouped_all_gather_is_sized_and_classed_by_its_group(groups):
    """An all-gather over groups of 4 in 8 devices sends its result / 4, and lies within a node of 4 devices but
    not one of 2. Breaks if it is sized by the whole mesh (/ 8), or classed by the mesh."""
    text = _entry(f"%g = f32[16]{{0}} all-gather(%x), replica_groups={groups}, dimensions={{0}}")
    assert hlo.collectives(text, 8, group_size=4) == CommBytes(in_group=16, cross_group=0)
    assert hlo.collectives(text, 8, group_size=2) == CommBytes(in_group=0, cross_group=16)
    assert hlo.collectives(text, 8) == CommBytes(in_group=0, cross_group=16)  # flat: every collective crosses


def test_strided_groups_cross_nodes():
    """An all-reduce over {0,4}, {1,5}, ... (and the transposed iota groups {0,2,4,6}, {1,3,5,7}, whose
    reduce-scatter sends its result x 4) crosses nodes of 4. Breaks if a group is read as consecutive devices."""
    reduce = _entry("%r = f32[8]{0} all-reduce(%x), replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add")
    assert hlo.collectives(reduce, 8, group_size=4) == CommBytes(in_group=0, cross_group=32)
    assert hlo.collectives(reduce, 8, group_size=8) == CommBytes(in_group=32, cross_group=0)
    scatter = _entry("%s = f32[2]{0} reduce-scatter(%x), replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}")
    assert hlo.collectives(scatter, 8, group_size=4) == CommBytes(in_group=0, cross_group=32)


def test_a_collective_of_the_whole_mesh_or_of_one_device():
    """No replica groups, or `{}`, means every device; a group of one device sends nothing. Breaks if an
    all-gather without groups is not divided by the mesh, or a one-device all-reduce is counted."""
    assert hlo.collectives(_entry("%g = f32[16]{0} all-gather(%x), replica_groups={}, dimensions={0}"), 8).total == 8
    assert hlo.collectives(_entry("%g = f32[16]{0} all-gather(%x), dimensions={0}"), 8).total == 8
    assert hlo.collectives(_entry("%r = f32[8]{0} all-reduce(%x), replica_groups={{0},{1}}, to_apply=%a"), 2).total == 0
    assert hlo.collectives(_entry("%r = f32[8]{0} all-reduce(%x), replica_groups={}, to_apply=%a"), 1).total == 0


def test_a_compiled_psum_over_each_axis_of_a_2d_mesh():
    """On a (2, 4) mesh ('replica', 'shard') of 8 CPU devices, a psum over 'shard' stays within a node of 4
    devices (4 x 8 floats), a psum over 'replica' crosses nodes (2 x 8 floats). Breaks if XLA's replica groups are
    misread, or a collective is sized or classed by the whole mesh."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("replica", "shard"))

    def sums(x, y):
        return jax.lax.psum(x, "shard"), jax.lax.psum(y, "replica")

    step = jax.jit(jax.shard_map(sums, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    text = step.lower(jnp.ones((4, 8)), jnp.ones((2, 8))).compile().as_text()
    assert hlo.collectives(text, 8, group_size=4) == CommBytes(in_group=4 * 8 * 4, cross_group=2 * 8 * 4)
    assert hlo.collectives(text, 8).total == (4 + 2) * 8 * 4
