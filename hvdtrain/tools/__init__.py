"""The tools beside training: `doctor` (will a launch work here?), `plan` (what each rank of a fit
would do) and `bench` (allreduce, training throughput, sampler cost).
May import anything below cli; nothing imports tools but cli.
"""
