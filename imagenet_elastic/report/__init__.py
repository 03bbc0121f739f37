"""What a run says: the console (rank 0's output, warnings), the rows of steps and epochs
and where they go (sinks/), the sample log, and what a restart cost."""
