"""Checkpoints, a run's state: their files and the folder's lock, atomic writes, when saves happen and rank 0's
background writer, load-once (rank 0's checkpoint to the other ranks). Imports neither train/ nor models/."""
