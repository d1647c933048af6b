"""Extract the shipped texts from Debian's r-cran-janeaustenr: the training corpus,
data/austen/austen.txt, and the held-out text, data/austen/heldout.txt (Emma's opening).

    apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb x
    .venv/bin/python scripts/extract_austen.py x/usr/lib/R/site-library/janeaustenr/data/Rdata
    .venv/bin/python scripts/extract_austen.py x/usr/lib/R/site-library/janeaustenr/data/Rdata \
        --books emma --max-bytes 60000 --out data/austen/heldout.txt

The R package stores each novel as a character vector of lines in an R lazy-load
database (Rdata.rdx: index; Rdata.rdb: zlib-compressed objects in R's XDR
serialization). This reads just the types those objects use; no R is needed.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import struct
import zlib
from pathlib import Path

BOOKS = ("prideprejudice", "persuasion", "northangerabbey")  # the training corpus
ALL_BOOKS = (*BOOKS, "sensesensibility", "mansfieldpark", "emma")
OUT = Path(__file__).resolve().parent.parent / "data" / "austen" / "austen.txt"


class _Reader:
    """A minimal reader of R's XDR serialization: vectors, pairlists, strings, symbols."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.refs = data, 0, []

    def _int(self) -> int:
        (v,) = struct.unpack(">i", self._take(4))
        return v

    def _take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def read(self):
        if self._take(2) != b"X\n":
            raise ValueError("not an XDR-serialized R object")
        version = self._int()
        self._int(), self._int()  # writer and minimal reader R versions
        if version == 3:
            self._take(self._int())  # native encoding name
        return self._item()

    def _item(self):
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (241, 242, 251, 252, 253, 254):  # environments, NULL, missing: nothing we need
            return None
        if kind == 255:  # reference to an earlier symbol
            return self.refs[(flags >> 8) - 1]
        if kind == 1:  # symbol
            name = self._item()
            self.refs.append(name)
            return name
        if kind in (2, 6):  # pairlist / language: (tag, value) pairs
            if has_attr:
                self._item()
            tag = self._item() if has_tag else None
            car, cdr = self._item(), self._item()
            return [(tag, car), *(cdr or [])]
        if kind == 9:  # one string
            n = self._int()
            return None if n == -1 else self._take(n).decode("utf-8")
        if kind in (10, 13, 14, 16, 19):  # logical, integer, double, character, list
            n = self._int()
            if kind in (10, 13):
                values = list(struct.unpack(f">{n}i", self._take(4 * n)))
            elif kind == 14:
                values = list(struct.unpack(f">{n}d", self._take(8 * n)))
            else:
                values = [self._item() for _ in range(n)]
            attrs = dict(self._item()) if has_attr else {}
            return (values, attrs) if attrs else values
        raise ValueError(f"unsupported R type {kind} at byte {self.pos}")


def read_lazyload(stem: Path) -> dict[str, object]:
    """Every object of an R lazy-load database (stem.rdx + stem.rdb), by name."""
    raw = stem.with_suffix(".rdx").read_bytes()
    index = _Reader(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else zlib.decompress(raw[4:])).read()
    (variables, _, _), _ = index
    offsets, attrs = variables
    db = stem.with_suffix(".rdb").read_bytes()
    out = {}
    for name, (start, length) in zip(attrs["names"], offsets, strict=True):
        out[name] = _Reader(zlib.decompress(db[start + 4 : start + length])).read()  # 4 bytes: raw length
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rdata", type=Path, help=".../janeaustenr/data/Rdata (without suffix)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--books", default=",".join(BOOKS), help=f"comma-separated, of {', '.join(ALL_BOOKS)} (default: the corpus)"
    )
    parser.add_argument(
        "--max-bytes", type=int, default=None, help="keep the paragraphs that fit in this many bytes (default: all)"
    )
    args = parser.parse_args()
    books = args.books.split(",")
    if unknown := [b for b in books if b not in ALL_BOOKS]:
        parser.error(f"unknown book(s) {', '.join(unknown)}; the package holds {', '.join(ALL_BOOKS)}")
    objects = read_lazyload(args.rdata)
    text = "\n\n\n".join("\n".join(line or "" for line in objects[book]).strip() for book in books) + "\n"
    if args.max_bytes is not None and len(text.encode()) > args.max_bytes:
        # NOTE: cut at the last paragraph break that fits, so no sentence is left half-written
        cut = text.encode()[: args.max_bytes].decode("utf-8", errors="ignore")
        text = cut[: cut.rfind("\n\n")].rstrip() + "\n"
    args.out.write_text(text, encoding="utf-8")
    digest = hashlib.sha256(text.encode()).hexdigest()
    print(f"wrote {args.out}: {len(text):,} characters, {len(text.encode()):,} bytes, sha256 {digest}")


if __name__ == "__main__":
    main()
