"""What a run says: the console (rank 0's output, warnings), the rows of steps and epochs
(metrics.py) and where they go (sinks/: steps.jsonl, TensorBoard, the experiment trackers), the sample log, and
what a restart cost."""
