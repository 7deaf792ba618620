"""The one exception type for mistakes a user can fix.

A `UserError` ends the run with one line from rank 0 and exit status 2; anything
else is a bug or a failure of the machine and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: the message says what is wrong and how to fix it."""

    exit_code = 2


class TrainingStopped(UserError):
    """Training cannot go on (a non-finite loss, say): one line, exit status 1, checkpoints kept."""

    exit_code = 1
