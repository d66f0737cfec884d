"""The dataflow graph of MFCs: build from config, validate, order, draw."""

from realcore.dfg.graph import DataFlowGraph, GraphError, MFCNode, build_graph

__all__ = ["DataFlowGraph", "GraphError", "MFCNode", "build_graph"]
