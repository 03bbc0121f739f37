"""The run: its build steps (the check that every rank runs the same job among them), the training loop, one
optimizer step and exact validation, the loss, mixing, distillation, progressive sizes, the checkpointed state."""
