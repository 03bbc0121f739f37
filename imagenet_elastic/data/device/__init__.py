"""The input side's device work: batches copied to the device on a side stream (feed), and under --decode gpu whole
batches decoded (jpeg_decoders: the libraries), cropped, resized and flipped (batch_crops), then augmented
(batch_policy) by gpu_decode's BatchDecoder, on the streams beside the training stream (streams). data/decoding.py
chooses between this path and the loader workers' CPU path; every module here also runs on CPU tensors."""
