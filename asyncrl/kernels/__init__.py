"""Fused or compiled versions of learner math; each has a parity test against the plain reference."""
