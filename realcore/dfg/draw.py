"""Draw a DataFlowGraph to PNG: the data source on the left, MFCs by topological level."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display on workers or CI
import matplotlib.pyplot as plt  # noqa: E402
import networkx as nx  # noqa: E402

from realcore.dfg.graph import DataFlowGraph  # noqa: E402

SOURCE = "data source"


def draw(dfg: DataFlowGraph, path: str) -> None:
    g = nx.DiGraph()
    g.add_node(SOURCE, layer=0)
    for depth, level in enumerate(dfg.levels(), start=1):
        for name in level:
            g.add_node(name, layer=depth)
    for u, v, d in dfg.graph.edges(data=True):
        g.add_edge(u, v, label=", ".join(d["keys"]))
    for name, node in dfg.nodes.items():
        from_source = [k for k in node.inputs if k in dfg.source_keys]
        if from_source:
            g.add_edge(SOURCE, name, label=", ".join(from_source))
    pos = nx.multipartite_layout(g, subset_key="layer")
    labels = {SOURCE: SOURCE}
    for name, n in dfg.nodes.items():
        labels[name] = f"{name}\n{n.type}" + (f" @ {n.model}" if n.model else "")
    width = 3.2 * (len(dfg.levels()) + 1)
    fig, ax = plt.subplots(figsize=(max(width, 6), 4.5))
    nx.draw_networkx_nodes(g, pos, ax=ax, node_size=3800, node_color="#dbe9f6", edgecolors="#3a6ea5")
    nx.draw_networkx_labels(g, pos, labels=labels, ax=ax, font_size=8)
    nx.draw_networkx_edges(g, pos, ax=ax, arrows=True, arrowsize=15, node_size=3800)
    nx.draw_networkx_edge_labels(g, pos, edge_labels=nx.get_edge_attributes(g, "label"), ax=ax, font_size=7)
    ax.margins(x=0.08, y=0.2)  # keep node circles inside the canvas
    ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
