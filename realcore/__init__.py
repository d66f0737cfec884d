"""realcore: reinforcement learning for LLMs, a master/worker system driven by a dataflow graph."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # realcore.Controller (the RL loop in one Python file) without importing the launcher with realcore.
    if name in ("Controller", "Batch", "LoopError"):
        from realcore.launch import controller

        return getattr(controller, name)
    raise AttributeError(f"module 'realcore' has no attribute {name!r}")
