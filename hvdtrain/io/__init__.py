"""What a run leaves on disk and on the terminal: `atomic` writes, the `checkpoint` files (the one
module that writes and reads them), the `run_dir` (config, metrics, summary), the TensorBoard
`event_log`, MLflow's `mlflow_log` and rank 0's `progress` lines. May import config and errors;
knows no engine and no training: the ranks' reductions happen above it, in train/.
"""
