"""Settings read from the environment at import, checked there: a bad value fails before any work."""
from __future__ import annotations

import os


def env_switch(name: str) -> bool:
    """An experiment's on/off switch: `name` unset or "0" is off, "1" on; anything else a ValueError
    naming the variable and its value."""
    value = os.environ.get(name, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: expected 0 or 1")
    return value == "1"
