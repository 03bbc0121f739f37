"""The run: its build steps, the training loop, one optimizer step and exact validation, the optimizer, the LR
schedule, the loss, mixing, distillation, progressive sizes and the training state a checkpoint holds (the model
itself: models/)."""
