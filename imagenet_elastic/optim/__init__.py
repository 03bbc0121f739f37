"""The optimizer and LR schedule, below config/ and train/: it imports none of the package's other folders."""
