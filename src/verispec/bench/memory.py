"""Peak resident memory per method, sampled from ``/proc/self/statm`` in a background thread.

RSS is a property of the whole process, so every figure includes the loaded models (and
whatever earlier methods left allocated); what differs between methods is their extra
working memory (KV caches, logits, the draft model's cache). A spike shorter than the
sampling interval can be missed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_STATM = Path("/proc/self/statm")


def current_rss() -> int | None:
    """Resident set size of this process in bytes, or None where ``/proc`` is not available."""
    try:
        resident_pages = int(_STATM.read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """One sampling thread for the whole run; ``measuring(label)`` attributes samples to ``label``."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.peaks: dict[str, int] = {}
        self._label: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return current_rss() is not None

    def start(self) -> "PeakRss":
        if self.available and self._thread is None:
            self._thread = threading.Thread(target=self._sample_until_stopped, name="verispec-rss", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @contextmanager
    def measuring(self, label: str) -> Iterator[None]:
        with self._lock:
            self._label = label
            self._record_locked()  # a call shorter than one interval still gets a sample
        try:
            yield
        finally:
            with self._lock:
                self._record_locked()
                self._label = None

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                self._record_locked()

    def _record_locked(self) -> None:
        # Read under the lock, so a sample is never credited to a label that has just ended.
        rss = current_rss() if self._label is not None else None
        if rss is not None and rss > self.peaks.get(self._label, 0):
            self.peaks[self._label] = rss
