"""The optimisation, below config/ (which offers its names as --opt and --sched) and train/ (which builds and
steps it). It imports nothing of the package's other folders."""
