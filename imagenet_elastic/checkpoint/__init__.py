"""Checkpoints: files and lock, when saves happen, rank 0's writer, load-once; imports neither train/ nor models/."""
