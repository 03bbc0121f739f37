"""The run: its build steps (the check that every rank runs the same job among them), the training loop, one
optimizer step and exact validation, the model, the loss, mixing, progressive sizes and the training state a
checkpoint holds. The optimizers and the LR schedule it builds are optim/'s."""
