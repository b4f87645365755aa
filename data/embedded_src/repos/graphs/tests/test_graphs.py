import pytest

from graphs import Graph, bfs, components, dfs, distance, from_edges, has_cycle, shortest_path


def square():
    return from_edges([(1, 2), (2, 3), (3, 4), (4, 1)])


def line():
    return from_edges([(1, 2), (2, 3), (3, 4)])


def test_add_edge_both_ways():
    g = from_edges([(1, 2)])
    assert g.has_edge(1, 2) and g.has_edge(2, 1)


def test_self_loop_raises():
    with pytest.raises(ValueError):
        Graph().add_edge(1, 1)


def test_add_node_isolated():
    g = Graph()
    g.add_node(5)
    assert g.nodes() == [5]


def test_add_node_keeps_edges():
    g = from_edges([(1, 2)])
    g.add_node(1)
    assert g.neighbors(1) == [2]


def test_remove_edge():
    g = square()
    g.remove_edge(1, 2)
    assert not g.has_edge(2, 1)


def test_nodes_sorted():
    assert from_edges([(3, 1), (2, 1)]).nodes() == [1, 2, 3]


def test_neighbors_sorted():
    assert square().neighbors(1) == [2, 4]


def test_neighbors_unknown():
    assert Graph().neighbors(9) == []


def test_degree():
    assert line().degree(2) == 2
    assert line().degree(1) == 1


def test_edge_count():
    assert square().edge_count() == 4


def test_bfs_line():
    assert bfs(line(), 1) == [1, 2, 3, 4]


def test_bfs_square():
    assert bfs(square(), 1) == [1, 2, 4, 3]


def test_bfs_single():
    g = Graph()
    g.add_node(7)
    assert bfs(g, 7) == [7]


def test_dfs_square():
    assert dfs(square(), 1) == [1, 2, 3, 4]


def test_dfs_tree():
    g = from_edges([(1, 2), (1, 3), (2, 4)])
    assert dfs(g, 1) == [1, 2, 4, 3]


def test_shortest_path():
    assert shortest_path(line(), 1, 4) == [1, 2, 3, 4]


def test_shortest_path_square():
    assert shortest_path(square(), 1, 3) == [1, 2, 3]


def test_shortest_path_same_node():
    assert shortest_path(line(), 2, 2) == [2]


def test_shortest_path_unreachable():
    g = line()
    g.add_node(9)
    assert shortest_path(g, 1, 9) is None


def test_distance():
    assert distance(line(), 1, 3) == 2


def test_distance_unreachable():
    g = line()
    g.add_node(9)
    assert distance(g, 1, 9) == -1


def test_components():
    g = from_edges([(1, 2), (5, 6), (3, 2)])
    g.add_node(9)
    assert components(g) == [[1, 2, 3], [5, 6], [9]]


def test_has_cycle_square():
    assert has_cycle(square())


def test_no_cycle_line():
    assert not has_cycle(line())


def test_cycle_in_second_component():
    g = from_edges([(1, 2), (5, 6), (6, 7), (7, 5)])
    assert has_cycle(g)


def test_from_edges_empty():
    assert from_edges([]).nodes() == []
