"""What a run leaves on disk and on the terminal: `atomic` writes, `checkpoint`s, the `run_dir`
(config, metrics, summary), the TensorBoard `event_log` and rank 0's `progress` lines.
May import config and errors; knows no engine (an Engine is a type hint only).
"""
