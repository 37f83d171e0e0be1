"""How long a tier takes to move bytes: round-trip time and bytes per second, measured.

The engine decides per lookup whether waiting for a tier beats recomputing the pages, so
each tier keeps a running estimate of its own link. A transfer of `b` bytes in one request
is modelled as `rtt + b / rate`. A transfer that mostly waited (a PING, EXPIREs, a few pages
over a slow link) measures the round trip; one that mostly moved bytes, with the round trip
taken off, measures the rate (each exponentially weighted, `alpha` per sample). Priors stand
until the first sample of each kind; the Redis tier PINGs once at start.
"""

from __future__ import annotations

import threading

SMALL_BYTES = 64 << 10  # a transfer smaller than this measures the round trip, a larger one the rate


class TransferEstimate:
    """Args:
    rtt_s: prior round-trip time.
    bytes_per_s: prior transfer rate.
    alpha: weight of a new sample (EWMA).
    """

    def __init__(self, rtt_s: float = 0.001, bytes_per_s: float = 500e6, alpha: float = 0.3):
        self.rtt_s = rtt_s
        self.bytes_per_s = bytes_per_s
        self.alpha = alpha
        self._rtt_measured = False
        self._rate_measured = False
        self._lock = threading.Lock()  # the writer and the lookup thread both observe

    def observe(self, num_bytes: int, seconds: float) -> None:
        """One request that moved `num_bytes` (either way) and took `seconds` to answer."""
        seconds = max(seconds, 1e-6)
        with self._lock:
            moving = seconds - self.rtt_s
            if num_bytes < SMALL_BYTES or not self._rtt_measured or moving < 0.5 * seconds:
                # Mostly the round trip (a PING, EXPIREs, a few pages over a slow link).
                sample = max(seconds - num_bytes / self.bytes_per_s, 0.0)
                self.rtt_s = sample if not self._rtt_measured else self._ewma(self.rtt_s, sample)
                self._rtt_measured = True
            else:  # mostly moving bytes: the rate, with the round trip taken off
                rate = num_bytes / moving
                self.bytes_per_s = rate if not self._rate_measured else self._ewma(self.bytes_per_s, rate)
                self._rate_measured = True

    def seconds(self, num_bytes: int, round_trips: int = 1) -> float:
        """Expected time to move `num_bytes` in `round_trips` requests."""
        return round_trips * self.rtt_s + num_bytes / self.bytes_per_s

    def _ewma(self, old: float, sample: float) -> float:
        return (1 - self.alpha) * old + self.alpha * sample
