"""An independent, plain-Python model of the cache contract: per session, a chronological list of chunks.

It knows nothing of slots: after ``begin`` of chunk n a session retains the sink chunks (index < sink_chunks) and
the most recent ``window_chunks`` chunks (n - window_chunks < index <= n); ``write`` sets the newest chunk's data
(last write wins); ``reset`` forgets everything. Chunks reserved but never written hold nothing.
"""

from __future__ import annotations

import numpy as np


class ReferenceHistory:
    def __init__(self, chunk: int, window: int, sink: int, batch: int):
        self.chunk, self.batch = chunk, batch
        self.sink_chunks, self.window_chunks = sink // chunk, window // chunk
        self.sessions = [dict(next=0, chunks={}) for _ in range(batch)]

    def begin(self, active=None):
        for b, s in enumerate(self.sessions):
            if active is not None and not active[b]:
                continue
            n = s["next"]
            s["current"] = n
            s["next"] = n + 1
            s["chunks"][n] = None
            keep = lambda i: i < self.sink_chunks or n - self.window_chunks < i <= n  # noqa: B023 - called in the iteration that defines it
            s["chunks"] = {i: c for i, c in s["chunks"].items() if keep(i)}

    def write(self, k, v, active=None):
        for b, s in enumerate(self.sessions):
            if (active is not None and not active[b]) or "current" not in s:
                continue
            s["chunks"][s["current"]] = (np.array(k[b]), np.array(v[b]))

    def reset(self, sessions=None):
        for b in range(self.batch):
            if sessions is None or sessions[b]:
                self.sessions[b] = dict(next=0, chunks={})

    def logical(self, b: int):
        """(k [n, heads, dim], v, positions [n]) of session b in position order, written chunks only."""
        s = self.sessions[b]
        ks, vs, ps = [], [], []
        for i in sorted(s["chunks"]):
            if s["chunks"][i] is None:
                continue
            k, v = s["chunks"][i]
            ks.append(k)
            vs.append(v)
            ps.append(np.arange(i * self.chunk, (i + 1) * self.chunk))
        if not ks:
            return None, None, np.zeros((0,), np.int64)
        return np.concatenate(ks), np.concatenate(vs), np.concatenate(ps)
