"""Data: `sources` (digits, random, .npz, factories; the train/val split), `introspect` (what a
user's data set says about itself), `loading` (batches, workers, collate), `sampler` (sharding by
rank) and `batch` (what a batch holds). May import config, factory, errors and engine.environment.
"""
