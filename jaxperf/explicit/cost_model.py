"""An alpha-beta cost model of all-reduce algorithms: predict their time from message size, device count, latency
and bandwidth, fit a link to measurements, and convert times to bus bandwidth.

    predict("ring", nbytes=4 << 20, n=8, link=LinkModel(alpha_s=5e-6, beta_s_per_byte=1 / 50e9))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np

from jaxperf.explicit.collectives import check_power_of_two


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """A link that takes alpha_s + nbytes * beta_s_per_byte seconds to deliver one message of nbytes."""

    alpha_s: float  # latency per message: launch, synchronisation, the first byte's trip
    beta_s_per_byte: float  # 1 / bandwidth of one link in one direction

    @classmethod
    def from_bandwidth(cls, alpha_s: float, bytes_per_s: float) -> LinkModel:
        return cls(alpha_s, 1.0 / bytes_per_s)

    @property
    def bandwidth(self) -> float:
        """Bytes per second of one link in one direction (inf when beta is 0)."""
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else math.inf


PREDICTED = ("naive", "psum", "ring", "bidirectional_ring", "halving_doubling")


def cost_terms(algorithm: str, nbytes: float, n: int) -> tuple[float, float]:
    """(messages, bytes) on the critical path of an all-reduce of `nbytes` per device: time = m*alpha + b*beta.

    See `predict` for the formulas.
    """
    if n < 1:
        raise ValueError(f"n={n}: need at least one device")
    if algorithm not in PREDICTED:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose from {', '.join(PREDICTED)}")
    if n == 1:
        return 0.0, 0.0
    ring_bytes = 2 * (n - 1) / n * nbytes
    if algorithm == "naive":
        return float(n - 1), float((n - 1) * nbytes)
    if algorithm in ("psum", "ring"):
        return float(2 * (n - 1)), ring_bytes
    if algorithm == "bidirectional_ring":
        return float(2 * (n - 1)), ring_bytes / 2
    check_power_of_two(n, "the halving_doubling cost model")
    return float(2 * int(math.log2(n))), ring_bytes


def predict(algorithm: str, nbytes: float, n: int, link: LinkModel) -> float:
    """Predicted seconds for an all-reduce of `nbytes` per device over `n` devices (alpha-beta model).

    With alpha the per-message latency and beta the seconds per byte of one link direction:

      naive (each device sends its whole buffer to each other device, one after the other, and sums locally):
                            (n-1)*alpha + (n-1)*nbytes*beta
      ring, psum (psum modelled as a ring, what NCCL and most runtimes use for large buffers):
                            2(n-1)*alpha + 2(n-1)/n*nbytes*beta
      bidirectional_ring (half each way on full-duplex links):
                            2(n-1)*alpha + (n-1)/n*nbytes*beta
      halving_doubling (n a power of two; every pair one hop apart, no link contention):
                            2*log2(n)*alpha + 2(n-1)/n*nbytes*beta

    The model ignores the time of the additions, topology (a ring laid on a torus uses one dimension's links) and
    congestion; it is a first-order guide to which algorithm should win, and where latency gives way to bandwidth.
    """
    messages, nbytes_sent = cost_terms(algorithm, nbytes, n)
    return messages * link.alpha_s + nbytes_sent * link.beta_s_per_byte


def bus_bandwidth(nbytes: float, n: int, seconds: float) -> float:
    """Bus bandwidth in bytes/s: nbytes / seconds * 2(n-1)/n (the nccl-tests convention for all-reduce).

    The factor is the share of the buffer each device must send in a bandwidth-optimal all-reduce, so the figure is
    comparable across n and with the link's bandwidth: a ring that saturates its links reports the link bandwidth.
    """
    return nbytes / seconds * 2 * (n - 1) / n


def fit_link(measurements: Iterable[tuple[float, float]], *, n: int, algorithm: str = "psum") -> LinkModel:
    """The LinkModel whose `predict(algorithm, ., n, .)` best fits measured (nbytes, seconds) pairs.

    Least squares in relative error (each row divided by its measured time): message sizes span orders of magnitude,
    and an absolute fit would let the largest messages decide alpha too. alpha and beta are kept >= 0 (a negative
    latency fitted to noise means "no measurable latency").

    Raises:
      ValueError: fewer than two distinct sizes, or a non-positive time.
    """
    pairs = [(float(b), float(t)) for b, t in measurements]
    if len({b for b, _ in pairs}) < 2:
        raise ValueError(f"fit_link needs measurements at two or more message sizes, got {len(pairs)} pair(s) "
                         f"with sizes {sorted({b for b, _ in pairs})}")
    if any(t <= 0 for _, t in pairs):
        raise ValueError(f"fit_link needs positive times, got {[t for _, t in pairs]}")
    a_Px2 = np.array([cost_terms(algorithm, b, n) for b, _ in pairs], np.float64)
    t_P = np.array([t for _, t in pairs], np.float64)
    a_Px2, rhs_P = a_Px2 / t_P[:, None], np.ones_like(t_P)  # relative residuals
    (alpha, beta), *_ = np.linalg.lstsq(a_Px2, rhs_P, rcond=None)
    if alpha < 0 or beta < 0:  # two unknowns: the constrained optimum has one of them at zero
        fits = []
        for col in (0, 1):
            coef = max(float(a_Px2[:, col] @ rhs_P / (a_Px2[:, col] @ a_Px2[:, col])), 0.0)
            fits.append((float(np.sum((a_Px2[:, col] * coef - rhs_P) ** 2)), col, coef))
        _, col, coef = min(fits)
        alpha, beta = (coef, 0.0) if col == 0 else (0.0, coef)
    return LinkModel(float(alpha), float(beta))
