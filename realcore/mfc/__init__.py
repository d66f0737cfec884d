"""MFC implementations (registered on import) and the algorithm math they use."""

from realcore.mfc import agents, generate, inference, reward, train  # noqa: F401
