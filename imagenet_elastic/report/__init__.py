"""What a run says: the console (rank 0's output, warnings), the start-up table, metrics.jsonl, steps.jsonl and
TensorBoard, the sample log, and what a restart cost."""
