"""The input side's device work: batches copied to the device on a side stream (feed), and under --decode gpu whole
batches decoded, cropped, resized, flipped and augmented beside the training stream. Every module here also runs on
CPU tensors."""
