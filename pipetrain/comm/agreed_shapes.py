"""Which boundary shapes the two ends of a link agreed on: an LRU cache per link, kept alike at both ends."""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

KEPT_SHAPES = 64  # shape keys remembered per link (AgreedShapes); a forgotten one costs one header again


class AgreedShapes:
    """Boundary metadata agreed per link and shape key: the ``kept`` most recently used keys of each link.

    Both ends of a link see the same keys in the same order (activations are sent and received in
    one order), so they keep and forget the same ones and agree on when a header is due without a
    message; the bound keeps many sequence lengths from growing it without limit."""

    def __init__(self, kept: int):
        self.kept = kept
        self.links: dict[int, OrderedDict] = {}

    def get(self, link: int, key: Hashable) -> tuple | None:
        """The metadata agreed for ``key`` on ``link`` (now the most recently used), or None."""
        known = self.links.get(link)
        if known is None or key not in known:
            return None
        known.move_to_end(key)
        return known[key]

    def add(self, link: int, key: Hashable, meta: tuple) -> None:
        """Remember ``meta`` for ``key`` on ``link``, forgetting the link's least recently used key past ``kept``."""
        known = self.links.setdefault(link, OrderedDict())
        known[key] = meta
        if len(known) > self.kept:
            known.popitem(last=False)
