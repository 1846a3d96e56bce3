"""Learner: advantages, policy losses, log-probs and the optimizer loop that consumes trajectories."""
