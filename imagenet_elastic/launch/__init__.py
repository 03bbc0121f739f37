"""Who a process is in the job and how it joins it: launcher variables (torchrun, Slurm, mpirun, spawn),
hostlists, the process group and its collectives, preemption signals, and starting the ranks. It imports neither
config/ nor train/: it starts the entry point it is handed with the config it is handed."""
