"""The training loop and its components (optimizer, checkpoints, metrics). CLI: `python -m specforge_k25.train`."""
