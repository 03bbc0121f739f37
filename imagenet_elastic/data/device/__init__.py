"""The input side's device work: batches copied on a side stream (feed) and, under --decode gpu, decoded, cropped,
resized, flipped and augmented beside the training stream. Every module here also runs on CPU tensors."""
