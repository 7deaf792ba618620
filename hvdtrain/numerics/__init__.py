"""Numerics shared by the tasks and the training loop: `metrics` (metrics as sums and counts, exact
over ranks) and `precision` (fp32, bf16 autocast, fp16 with its gradient scaler). Below both: may
import errors only (an Engine is a type hint: anything with `allreduce_sum`).
"""
