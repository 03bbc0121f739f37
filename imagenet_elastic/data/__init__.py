"""Samples to batches on the device: where samples come from (sources/), the sampler, each sample's pixels
and augmentation, datasets and loaders, --decode (workers or the device), and feeding the device."""
