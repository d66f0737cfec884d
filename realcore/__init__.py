"""realcore: reinforcement learning for LLMs, a master/worker system driven by a dataflow graph."""

__version__ = "0.1.0"
