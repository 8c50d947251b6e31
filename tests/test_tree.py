"""The balanced pairwise tree: its shape, and that aligned groups are its subtrees."""
import pytest

from wse_core.tree import tree_reduce, tree_sum

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
