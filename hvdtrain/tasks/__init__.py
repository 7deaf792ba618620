"""Tasks: what a batch means (its loss and metrics). `--task` picks one.

`base` (the Task interface), `builtin` (the four built-in tasks), `user` (a user's own), `check`
(the first batch, before training). May import config, data.batch and numerics; never train.
"""

from __future__ import annotations

import difflib

from hvdtrain.config import TaskConfig
from hvdtrain.errors import UserError
from hvdtrain.factory import colon_hint, is_factory_path
from hvdtrain.tasks.base import Task, batch_metrics, model_loss, predictions, training_loss
from hvdtrain.tasks.builtin import Classification, LanguageModel, Multilabel, Regression

__all__ = ["BUILT_IN", "Task", "batch_metrics", "build_task", "model_loss", "predictions", "training_loss"]

BUILT_IN = ("classification", "regression", "multilabel", "language-model")


def build_task(cfg: TaskConfig) -> Task:
    """The task the config names; a user's `package.module:attribute` is imported here."""
    if cfg.name == "classification":
        return Classification(cfg.label_smoothing, cfg.ignore_index, cfg.target_key)
    if cfg.name == "regression":
        return Regression(cfg.regression_loss, cfg.huber_delta, cfg.target_key)
    if cfg.name == "multilabel":
        return Multilabel(cfg.target_key)
    if cfg.name == "language-model":
        return LanguageModel(cfg.ignore_index, cfg.shift, cfg.target_key)
    if is_factory_path(cfg.name):
        from hvdtrain.tasks.user import user_task

        return user_task(cfg.name, cfg.target_key, cfg.args)
    close, hint = difflib.get_close_matches(cfg.name, BUILT_IN, n=1), colon_hint(cfg.name)
    if close and not hint:  # mytasks.regression: the colon, not the built-in
        raise UserError(f"unknown task '{cfg.name}': did you mean '{close[0]}'?")
    raise UserError(f"unknown task '{cfg.name}': use one of {', '.join(BUILT_IN)}, or package.module:function "
                    f"for your own (a loss function or an object with loss and metrics){hint}")
