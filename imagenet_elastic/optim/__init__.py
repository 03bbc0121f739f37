"""The optimisation, below config/ (which offers its names as --opt and --sched) and train/ (which builds and
steps it): the optimizers and their registry, parameter groups and the rules of their loaded state
(optimizer.py), and the LR schedule and its registry (schedule.py). It imports nothing of the package's
other folders."""
