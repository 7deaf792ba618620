"""`hvdtrain bench`: allreduce bandwidth, training throughput, sampler cost.

May import engine, data, train's loop and precision, tasks and models.
"""
