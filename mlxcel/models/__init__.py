"""Model checkpoints: validation before the server binds, and loading on the worker thread."""
