"""Training: `fit` (the dispatch, above both kinds) over `plain` and `elastic` fit, which share
`setup` and `epoch`; below them the `loop` (train step, evaluate), `precision`, `schedule`, `metrics`.
May import config, data, engine, io, tasks and models; nothing but cli and tools import train.
"""
