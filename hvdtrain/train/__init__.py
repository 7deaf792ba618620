"""Training: `fit` (the dispatch, above both kinds) over `plain` and `elastic` fit, which drive one
`trainer.Trainer` and its components (`checkpointer`, `loggers`, `stop_policy`); below them `setup`
(build, shard, checks), `steps`, the `loop` (train step, evaluate), `callbacks`, `schedule`.
May import config, data, engine, io, numerics, tasks and models; nothing but api, cli, after and tools
import train.
"""
