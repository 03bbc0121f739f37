"""Who a process is in the job and how it joins it: launcher variables (torchrun, Slurm, mpirun, spawn),
hostlists, the process group and its collectives, the start-up check that every rank runs the same
job, preemption signals, and starting the ranks."""
