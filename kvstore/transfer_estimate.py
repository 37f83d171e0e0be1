"""How long a tier takes to move bytes: round-trip time and bytes per second, measured.

The engine decides per lookup whether waiting for a tier beats recomputing the pages, so
each tier keeps a running estimate of its own link. A transfer of `b` bytes in one request
is modelled as `rtt + b / rate`. Each observed transfer updates the term that dominated it
(exponentially weighted, `alpha` per sample): a small transfer says little about the rate
and mostly measures the round trip, a large one mostly measures the rate. Priors stand until
the first sample of each kind.
"""

from __future__ import annotations

import threading


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
            transfer = num_bytes / self.bytes_per_s
            if transfer < 0.5 * seconds:  # mostly waiting for the answer: a round-trip sample
                sample = max(seconds - transfer, 0.0)
                self.rtt_s = sample if not self._rtt_measured else self._ewma(self.rtt_s, sample)
                self._rtt_measured = True
            else:  # mostly moving bytes: a rate sample
                rate = num_bytes / max(seconds - self.rtt_s, 0.1 * seconds)
                self.bytes_per_s = rate if not self._rate_measured else self._ewma(self.bytes_per_s, rate)
                self._rate_measured = True

    def seconds(self, num_bytes: int, round_trips: int = 1) -> float:
        """Expected time to move `num_bytes` in `round_trips` requests."""
        return round_trips * self.rtt_s + num_bytes / self.bytes_per_s

    def _ewma(self, old: float, sample: float) -> float:
        return (1 - self.alpha) * old + self.alpha * sample
