"""Terminal views of a run's metrics (rich); imported only by the CLI layer."""
