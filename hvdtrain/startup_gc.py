"""Python's garbage collector while `hvdtrain fit` starts.

Importing torch and Horovod makes a few hundred thousand objects that live as long as the process, and
the collector walked all of them again and again before the first step: 0.4 s of a rank's 2.3 s start
on the CPU. The command holds the collector while it imports (`hold`), then freezes what the imports
made and lets it run again (`settle`): its later full collections walk only the objects made since.
Those collections pause one rank while the others wait for it in the next allreduce, so they cost the
whole job; frozen, they are shorter. What the imports left as garbage (some thousands of objects) is
frozen with the rest instead of freed.
"""

from __future__ import annotations

import gc

_held = False


def hold() -> None:
    """Turns the collector off until `settle`, in the command's own process only: a script's is its own."""
    global _held
    if gc.isenabled():
        gc.disable()
        _held = True


def settle() -> None:
    """Freezes every object made so far and turns the collector back on, where `hold` turned it off."""
    global _held
    if _held:
        gc.freeze()
        gc.enable()
        _held = False
