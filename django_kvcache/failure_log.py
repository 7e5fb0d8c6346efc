"""Logging of repeated failures that never floods the log.

A cache that ignores its failures (``IGNORE_EXCEPTIONS``) may see thousands per second
while a server is down. :class:`FailureLog` writes, per failing *source* (a server, a
node: any name), one line when an episode starts, at most one summary per ``interval``
while it lasts, and one line when the caller says the source answers again. Exact
counts belong in the caller's metrics; this only decides what reaches the log.

It knows nothing of any backend: the caller gives it a logger and a word for its kind
of failure ("memcached", "MySQL").
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from django_kvcache import forks

#: Seconds between two summary lines of one source.
DEFAULT_INTERVAL = 60.0


@dataclass
class Episode:
    """A run of failures of one source."""

    started: float
    last_failure: float
    last_line: float  # when this episode last wrote a line
    last_error: str
    label: str  # how the lines name the source
    total: int = 1
    unreported: int = 0  # failures since the last line


class FailureLog:
    """One line per episode start, a summary per ``interval``, one line at the end.

    An episode ends when :meth:`recovered` is called for its source, or silently after
    ``interval`` seconds without a failure: the next failure then starts a new one
    (after a summary of what the old one left unreported). Summaries are written when a
    failure arrives, never by a timer, so a quiet source costs nothing. Each failure that
    only adds to a count is logged at DEBUG, so none goes unlogged where that level is on.

    The lines' wording is in the class attributes below; a subclass may word its own kind
    of event (a value refused is no failure "ignored").
    """

    #: Arguments: kind, source, error, interval.
    FIRST = ("Ignored %s failure on %s: %s (further failures there are summarized at most "
             "every %g s)")
    #: Arguments: count, kind, source, seconds, last error.
    SUMMARY = "%d more %s failure(s) ignored on %s in %.1f s (last: %s)"
    #: Arguments: kind, source, error (at DEBUG).
    COUNTED = "%s failure on %s, counted for its summary: %s"

    def __init__(
        self,
        logger: logging.Logger,
        kind: str,
        interval: float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.kind = kind
        self.interval = interval
        self.clock = clock
        self.episodes: dict[str, Episode] = {}
        self.lock = threading.Lock()
        forks.register(self)

    def failed(self, source: str, error: object, label: str | None = None) -> None:
        """Note one ignored failure of ``source``; log it if the rate allows. ``label``:
        how the lines name the source (``node h:p of CACHES['default']``), when more
        than the source's key (``node h:p``, which :meth:`recovered` is called with)."""
        now = self.clock()
        error_text = str(error)
        label = label or source
        lines: list[tuple] = []
        with self.lock:  # decide under the lock, log outside it
            episode = self.episodes.get(source)
            if episode is not None and now - episode.last_failure >= self.interval:
                self._summarize(lines, source, episode, until=episode.last_failure)  # quiet end
                episode = None
            if episode is None:
                self.episodes[source] = Episode(now, now, now, error_text, label)
                lines.append(self._first(label, error_text))
            else:
                episode.total += 1
                episode.unreported += 1
                episode.last_failure = now
                episode.last_error = error_text
                if now - episode.last_line >= self.interval:
                    self._summarize(lines, source, episode, until=now)
        for line in lines:
            self.logger.warning(*line)
        if not lines:  # neither a first line nor a summary: only counted
            self.logger.debug(self.COUNTED, self.kind, label, error_text)

    def recovered(self, source: str) -> None:
        """``source`` answers again: close its episode, if one is open, with its total."""
        now = self.clock()
        with self.lock:
            episode = self.episodes.pop(source, None)
        if episode is not None:
            self.logger.warning(
                "%s %s answers again: %d failure(s) ignored in %.1f s (last: %s)",
                self.kind, episode.label, episode.total, now - episode.started,
                episode.last_error,
            )

    def _first(self, source: str, error_text: str) -> tuple:
        return (self.FIRST, self.kind, source, error_text, self.interval)

    def _summarize(self, lines: list[tuple], source: str, episode: Episode, until: float) -> None:
        """Add the summary of ``episode``'s unreported failures to ``lines``, if any."""
        unreported, since = episode.unreported, episode.last_line
        episode.unreported, episode.last_line = 0, until
        if unreported:
            lines.append((
                self.SUMMARY, unreported, self.kind, episode.label, until - since,
                episode.last_error,
            ))

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # another thread may have held it at the fork
