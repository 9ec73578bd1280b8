"""A process's kernel status, as tests read it from ``/proc/PID/stat`` (Linux)."""

from __future__ import annotations

from pathlib import Path


def stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name: ``[0]`` the state (``R``, ``S``, ``T`` stopped,
    ``Z`` zombie...), ``[1]`` the parent's pid. The name, in parentheses, may hold spaces and parentheses itself,
    so the fields are what follows its last ``)``."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
