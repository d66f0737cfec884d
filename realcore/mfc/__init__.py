"""MFC implementations (registered on import) and the algorithm math they use (the advantage estimators
and policy losses register on import too)."""

from realcore.mfc import advantages, critic, gae, generate, inference, policy_losses, reward, reward_model, train  # noqa: F401
