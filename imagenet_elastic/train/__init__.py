"""The run: its build steps (the check that every rank runs the same job among them), the training loop, one
optimizer step and exact validation, the loss, mixing, distillation, progressive sizes and the training state a
checkpoint holds. The model is models/'s; the optimizers and the LR schedule optim/'s."""
