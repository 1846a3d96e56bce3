"""Tasks: prompt streams, held-out sets, prompt rendering and rewards (the `Task` seam, `base.py`)."""
