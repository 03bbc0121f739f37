"""The run: its build steps, the training loop, one optimizer step and exact validation, the model and
optimizer, the LR schedule, the loss, mixing, progressive sizes and the training state a checkpoint holds."""
