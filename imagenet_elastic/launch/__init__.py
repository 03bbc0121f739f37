"""Who a process is in the job and how it joins it: launcher variables (torchrun, Slurm, mpirun, spawn),
hostlists, the process group and its collectives, preemption signals, and starting the ranks.

The flow runs one way: cli -> config -> launch -> train's build -> the trainer. config/ offers this folder's
registries as options (launchers.METHODS, preemption's signals); this folder imports neither config/ nor train/:
it starts the entry point it is handed with the config it is handed (processes.py), and the check that every
rank runs the same job is a build step of train/ (train/consistency.py), which uses the collectives here."""
