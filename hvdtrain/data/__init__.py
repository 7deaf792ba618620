"""Data: `sources/` (each kind of data set behind one interface, and the train/val split), the
formats they read (`mapped`: memory-mapped .npy and token files; `huggingface`; `shards` with
`shard_index`: tar shards; `images`: class folders of images), `augment` (image batches made
ready on the device: conversion, augmentation, normalisation), `streams` (data read front to
back), `introspect` (what a user's data set says about itself), `batch` (what a batch holds),
`sampler` and `stream_sampler` (sharding by rank, behind one `TrainingSampler` interface), and
`loading` (batches, workers, collate). May import config, factory, errors and engine.environment.
"""
