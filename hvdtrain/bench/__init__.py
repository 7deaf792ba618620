"""`hvdtrain bench`: allreduce bandwidth, training throughput, sampler cost."""
