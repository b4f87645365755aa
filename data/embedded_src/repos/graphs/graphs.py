"""Undirected graphs as adjacency sets, with traversal and path finding."""


class Graph:
    def __init__(self):
        self.adjacency = {}

    def add_node(self, node):
        if node not in self.adjacency:
            self.adjacency[node] = set()

    def add_edge(self, a, b):
        if a == b:
            raise ValueError("self loops are not allowed")
        self.add_node(a)
        self.add_node(b)
        self.adjacency[a].add(b)
        self.adjacency[b].add(a)

    def remove_edge(self, a, b):
        self.adjacency[a].discard(b)
        self.adjacency[b].discard(a)

    def nodes(self):
        return sorted(self.adjacency)

    def neighbors(self, node):
        return sorted(self.adjacency.get(node, ()))

    def degree(self, node):
        return len(self.adjacency.get(node, ()))

    def edge_count(self):
        return sum(len(n) for n in self.adjacency.values()) // 2

    def has_edge(self, a, b):
        return b in self.adjacency.get(a, ())


def bfs(graph, start):
    """Nodes in breadth-first order; neighbors are visited in sorted order."""
    order = [start]
    seen = {start}
    i = 0
    while i < len(order):
        for nxt in graph.neighbors(order[i]):
            if nxt not in seen:
                seen.add(nxt)
                order.append(nxt)
        i += 1
    return order


def dfs(graph, start):
    """Nodes in depth-first (preorder) order; neighbors in sorted order."""
    order = []
    stack = [start]
    while stack:
        node = stack.pop()
        if node in order:
            continue
        order.append(node)
        for nxt in reversed(graph.neighbors(node)):
            stack.append(nxt)
    return order


def shortest_path(graph, start, goal):
    """A shortest path as a list of nodes, or None when unreachable."""
    previous = {start: None}
    queue = [start]
    while queue:
        node = queue.pop(0)
        if node == goal:
            path = []
            while node is not None:
                path.append(node)
                node = previous[node]
            return path[::-1]
        for nxt in graph.neighbors(node):
            if nxt not in previous:
                previous[nxt] = node
                queue.append(nxt)
    return None


def distance(graph, start, goal):
    path = shortest_path(graph, start, goal)
    if path is None:
        return -1
    return len(path) - 1


def components(graph):
    """Connected components, each sorted, in order of their smallest node."""
    seen = set()
    result = []
    for node in graph.nodes():
        if node in seen:
            continue
        part = bfs(graph, node)
        seen.update(part)
        result.append(sorted(part))
    return result


def has_cycle(graph):
    """True when some component has more edges than a tree would."""
    for part in components(graph):
        edges = sum(graph.degree(n) for n in part) // 2
        if edges >= len(part):
            return True
    return False


def from_edges(edges):
    graph = Graph()
    for a, b in edges:
        graph.add_edge(a, b)
    return graph
