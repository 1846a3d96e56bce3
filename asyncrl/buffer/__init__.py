"""Trajectory buffer: version-tagged samples, group assembly, freshness ordering (learner side)."""
