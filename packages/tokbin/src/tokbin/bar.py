"""tokbin's progress bars: tqdm without its monitor thread."""

from __future__ import annotations

from tqdm import tqdm


class Bar(tqdm):
    """tqdm without the monitor thread its first bar starts (and a disabled bar leaves running): encode forks its
    worker pool while a bar exists, and the fork of a process with threads may deadlock the children (Python 3.12+
    warns). tokbin's bars move with each piece or shard, so the monitor's check for a stalled bar has nothing to do.
    """

    monitor_interval = 0
