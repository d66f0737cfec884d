"""MFC implementations (registered on import) and the algorithm math they use."""

from realcore.mfc import generate, inference, reward, train  # noqa: F401
