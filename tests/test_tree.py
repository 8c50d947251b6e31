"""The balanced pairwise tree: its shape, and that aligned groups are its subtrees."""
import pytest

from wse_core.microbatch import MicroBatches, TreeAccumulator, tree_reduce, tree_sum

SHOW = lambda a, b: f"({a}{b})"  # noqa: E731


def test_tree_shape():
    assert tree_sum("abcdefgh", SHOW) == "(((ab)(cd))((ef)(gh)))"
    assert tree_sum("abcdef", SHOW) == "((a(bc))(d(ef)))"
    assert tree_sum("a", SHOW) == "a"


@pytest.mark.parametrize("n,groups", [(8, 2), (8, 4), (12, 4), (6, 2), (16, 8)])
def test_aligned_groups_are_subtrees(n, groups):
    """Summing each of `groups` contiguous runs, then the partial sums, reproduces the whole tree."""
    items = [chr(ord("a") + i) for i in range(n)]
    m = n // groups
    parts = [tree_sum(items[g * m:(g + 1) * m], SHOW) for g in range(groups)]
    assert tree_sum(parts, SHOW) == tree_sum(items, SHOW)


def test_leaves_are_computed_in_order_and_empty_is_an_error():
    seen = []
    tree_reduce(0, 5, lambda i: seen.append(i) or i, lambda a, b: a + b)
    assert seen == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="empty range"):
        tree_sum([])


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 64])
def test_an_accumulator_adds_items_given_one_at_a_time_as_the_tree_does(n):
    items = [f"x{i}" for i in range(n)]
    acc = TreeAccumulator(n, SHOW)
    for x in items:
        acc.push(x)
    assert acc.total() == tree_sum(items, SHOW)
    with pytest.raises(ValueError, match=f"more than {n} items"):
        acc.push("one more")


@pytest.mark.parametrize("rounds,num_csx", [(4, 2), (2, 4), (8, 3), (1, 5)])
def test_rounds_of_csx_sums_are_the_whole_tree_when_the_rounds_are_a_power_of_two(rounds, num_csx):
    """The cluster's order (wse_core.microbatch's docstring): SwarmX sums round r's micro-batches
    r * num_csx + c over the CS-2s, MemoryX adds the rounds; num_csx up to SwarmX's fan-out."""
    items = [f"m{r * num_csx + c}" for r in range(rounds) for c in range(num_csx)]
    acc = TreeAccumulator(rounds, SHOW)
    for r in range(rounds):
        acc.push(tree_sum([f"m{r * num_csx + c}" for c in range(num_csx)], SHOW))
    assert acc.total() == tree_sum(items, SHOW)


@pytest.mark.parametrize("num_csx,rounds", [(1, 3), (1, 6), (2, 4), (2, 3), (2, 6), (3, 1), (3, 2), (3, 3)])
def test_the_rule_for_the_references_bits_is_the_order_the_cluster_sums_in(num_csx, rounds):
    """MicroBatches.sums_as_one (what `wse compile` prints, and a params warning says when false) holds exactly
    when SwarmX's round sums, added by MemoryX, are the whole tree: one CS-2 for any rounds (it said no
    for 3), a power of two of rounds otherwise (SwarmX's node here holding every CS-2)."""
    items = [f"m{r * num_csx + c}" for r in range(rounds) for c in range(num_csx)]
    acc = TreeAccumulator(rounds, SHOW)
    for r in range(rounds):
        acc.push(tree_sum([f"m{r * num_csx + c}" for c in range(num_csx)], SHOW))
    assert sums_as_one(num_csx, rounds, num_csx) == (acc.total() == tree_sum(items, SHOW))


def test_swarmx_sums_as_one_process_within_its_fan_out_or_in_powers_of_two():
    """Beyond one node, SwarmX's tree is the reference's only when num_csx and the fan-out are powers of two."""
    assert sums_as_one(3, 1, 4) and sums_as_one(4, 1, 2) and sums_as_one(8, 2, 2)
    assert not sums_as_one(3, 1, 2) and not sums_as_one(6, 1, 4)


def sums_as_one(num_csx, rounds, swarmx_fanout):
    """Whether ``num_csx`` CS-2s of ``rounds`` micro-batches of one sample each sum as one process."""
    return MicroBatches(num_csx * rounds, 1, num_csx).sums_as_one(swarmx_fanout)
