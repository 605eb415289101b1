"""Rows of many sources, epoch after epoch, shuffled within windows; a position a checkpoint can hold.

Each epoch visits the sources in an order drawn from (seed, epoch) and reads each source
in windows of consecutive rows — at most ``window_rows`` rows and ``window_chars``
characters — whose rows it visits in an order drawn from (seed, epoch, source, window)::

    source   r0 r1 r2 r3 | r4 r5 r6 r7 | r8 r9
    windows  [ w0      ] [ w1        ] [ w2 ]
    visited  r2 r0 r3 r1   r5 r7 r4 r6   r9 r8

A source that fits in one window is shuffled whole; a larger one only locally, so that
one window's rows (tens of MB) are all that is held, whatever the source's size. The
position is five values — epoch, source, window, the reader's position at the window's
start (oomb.train.data.rows), the row within the window: a resumed run reads that window again
and goes on with exactly the rows an uninterrupted one would have read.

``keep(source, row number)`` leaves rows out (a held-out split) while the windows are
filled; ``shuffle=False`` keeps the sources and rows in their own order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence

import numpy as np

from oomb.train.data.corpus import DataError, Source
from oomb.train.data.rows import Row, TextFile

WINDOW_ROWS = 8192
WINDOW_CHARS = 32 << 20  # ~32 MB of ASCII text held at a time (Python keeps 1 byte a character for it)
POSITION_KEYS = ("epoch", "source", "window", "start", "index")


def held_out(source: Source, number: int, fraction: float) -> bool:
    """Whether row ``number`` of ``source`` is in the held-out ``fraction`` (data.val_fraction).

    A hash of the source's key and the row number decides, not the seed nor an index of all
    rows: every run with the same data holds out the same rows, and a stream of any size is
    split as it is read.
    """
    digest = hashlib.blake2b(f"{source.key}\0{number}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def permutation(n: int, *seed: int) -> np.ndarray:
    return np.random.default_rng(list(seed)).permutation(n)


def _chars(value) -> int:
    """About how many characters a row holds (what its window may hold)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_chars(v) for v in value)
    return 0 if isinstance(value, TextFile) else 8


class RowStream:
    """An endless walk over the rows of ``sources`` (``current``, ``advance``), resumable exactly."""

    def __init__(self, sources: Sequence[Source], open_reader: Callable, *, seed: int = 0, shuffle: bool = True,
                 keep: Callable[[Source, int], bool] | None = None, window_rows: int = WINDOW_ROWS,
                 window_chars: int = WINDOW_CHARS) -> None:
        self.sources, self.open_reader, self.seed, self.shuffle, self.keep = sources, open_reader, seed, shuffle, keep
        self.window_rows, self.window_chars = window_rows, window_chars
        self.epoch = self.source = self.window = self.index = 0
        self.start: dict | None = None  # the reader's position at the window's first row; None: the source's start
        self._window: tuple | None = None  # (epoch, source, window) -> its rows in visiting order
        self._reader: tuple | None = None  # (epoch, source, next window, reader at that window's first row)
        self._next_start: dict | None = None  # the reader's position after the current window's last row

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "source": self.source, "window": self.window, "start": self.start,
                "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.source, self.window = int(state["epoch"]), int(state["source"]), int(state["window"])
        self.start, self.index = state["start"], int(state["index"])
        self._window = self._reader = None

    def source_number(self) -> int:
        """The number in ``sources`` of the source the position is in."""
        if not self.shuffle:
            return self.source
        return int(permutation(len(self.sources), self.seed, self.epoch)[self.source])

    def current(self) -> Row:
        """The row at the position; past an exhausted source, the next one (after the last, the next epoch)."""
        empty = 0  # sources in a row that gave no row: a whole epoch of them means there is nothing to read
        while True:
            rows = self._rows()
            if self.index < len(rows):
                return rows[self.index]
            if rows:  # the window is done: the next one starts where it ended
                self.window, self.start, self.index = self.window + 1, self._next_start, 0
                continue
            empty = empty + 1 if self.window == 0 else 0
            if empty > len(self.sources):
                raise DataError("no row to read: every source is empty" if self.keep is None else
                                "no row to read: every source is empty, or the held-out split (data.val_fraction) "
                                "leaves out all its rows; a text file is one row, held out whole or not at all")
            self.source, self.window, self.start, self.index = self.source + 1, 0, None, 0
            if self.source == len(self.sources):
                self.epoch, self.source = self.epoch + 1, 0

    def advance(self) -> None:
        self.index += 1

    def _rows(self) -> list[Row]:
        """The current window's rows in visiting order (read once per window)."""
        key = (self.epoch, self.source, self.window)
        if self._window is not None and self._window[0] == key:
            return self._window[1]
        source = self.sources[self.source_number()]
        if self._reader is not None and self._reader[:3] == key:
            reader = self._reader[3]  # where the previous window stopped: no reopening, no seek
        else:
            reader = self.open_reader(source, self.start)
        rows, chars, it = [], 0, iter(reader)
        while len(rows) < self.window_rows and chars < self.window_chars:
            row = next(it, None)
            if row is None:
                break
            if self.keep is None or self.keep(source, row.number):
                rows.append(row)
                chars += _chars(row.value)
        self._next_start = json.loads(json.dumps(reader.position()))  # a copy the reader cannot change
        self._reader = (*key[:2], key[2] + 1, _Resumed(reader.reader if isinstance(reader, _Resumed) else reader, it))
        if self.shuffle and len(rows) > 1:
            rows = [rows[i] for i in permutation(len(rows), self.seed, self.epoch, self.source, self.window)]
        self._window = (key, rows)
        return rows


class _Resumed:
    """A reader whose iteration has begun: iterating it again goes on where it stopped."""

    def __init__(self, reader, it) -> None:
        self.reader, self.it = reader, it

    def __iter__(self):
        return self.it

    def position(self) -> dict:
        return self.reader.position()
