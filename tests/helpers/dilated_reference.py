"""Two independent models of `DilatedCache`, neither of which knows slots or modular arithmetic of the cache.

`DilatedHistory` is the chronological contract: per session, the kept frames reserved so far in order (a frame is
kept iff frame % dilation == 0), of which the last ``buckets`` are retained; committed kept frames become visible
at the next begin (pending until then); the current chunk's latest write is visible to that chunk only.

`SeedUpsert` transcribes the seed's per-layer ring (``LayerRingCache.upsert``) on frame labels: a ``written`` flag
per slot, a scratch tail always written, the visibility row computed before the commit. It runs one frame per
call (the seed's unit) and answers which frames a query of that frame sees.
"""

from __future__ import annotations

import numpy as np


class DilatedHistory:
    def __init__(self, tokens_per_frame: int, chunk_frames: int, dilation: int, buckets: int, batch: int):
        self.t, self.c, self.d, self.buckets, self.batch = tokens_per_frame, chunk_frames, dilation, buckets, batch
        self.sessions = [self._fresh() for _ in range(batch)]

    @staticmethod
    def _fresh():
        return dict(next=0, current=None, reserved=[], published={}, pending={}, scratch={})

    def begin(self, active=None):
        for b, s in enumerate(self.sessions):
            if active is not None and not active[b]:
                continue
            n = s["next"]
            s["current"], s["next"] = n, n + 1
            s["published"].update(s["pending"])
            s["pending"], s["scratch"] = {}, {}
            new = [f for f in range(n * self.c, (n + 1) * self.c) if f % self.d == 0]
            s["reserved"] = (s["reserved"] + new)[-self.buckets :]
            keep = set(s["reserved"]) - set(new)
            s["published"] = {f: x for f, x in s["published"].items() if f in keep}

    def write(self, k, v, active=None, commit=True):
        for b, s in enumerate(self.sessions):
            if (active is not None and not active[b]) or s["current"] is None:
                continue
            for i in range(self.c):
                f = s["current"] * self.c + i
                frame = (np.array(k[b, i * self.t : (i + 1) * self.t]), np.array(v[b, i * self.t : (i + 1) * self.t]))
                s["scratch"][f] = frame
                if commit and f % self.d == 0:
                    s["pending"][f] = frame

    def reset(self, sessions=None):
        for b in range(self.batch):
            if sessions is None or sessions[b]:
                self.sessions[b] = self._fresh()

    def visible_frames(self, b: int):
        s = self.sessions[b]
        return sorted({**s["published"], **s["scratch"]})

    def logical(self, b: int):
        """(k [n, heads, dim], v, positions [n]) of what session b's current chunk sees, in position order."""
        s = self.sessions[b]
        frames = {**s["published"], **s["scratch"]}
        if not frames:
            return None, None, np.zeros((0,), np.int64)
        order = sorted(frames)
        ks = [frames[f][0] for f in order]
        vs = [frames[f][1] for f in order]
        ps = [np.arange(f * self.t, (f + 1) * self.t) for f in order]
        return np.concatenate(ks), np.concatenate(vs), np.concatenate(ps)


class SeedUpsert:
    """The seed's ring for one session, on frame labels (no data): ``ring_buckets`` slots + a scratch frame."""

    def __init__(self, dilation: int, buckets: int):
        self.d, self.buckets = dilation, buckets
        self.slot_frame = [None] * buckets
        self.written = [False] * buckets

    def upsert(self, frame_pos: int, commit: bool):
        """Returns the frames a query of ``frame_pos`` sees (the visibility row, built before the commit)."""
        bucket = (frame_pos + (self.d - 1)) // self.d
        slot = bucket % self.buckets
        write_step = frame_pos % self.d == 0
        seen = {self.slot_frame[s] for s in range(self.buckets) if self.written[s] and not (s == slot and write_step)}
        seen.add(frame_pos)  # the scratch tail, always written with this frame
        if commit and write_step:
            self.slot_frame[slot] = frame_pos
            self.written[slot] = True
        return sorted(seen)
