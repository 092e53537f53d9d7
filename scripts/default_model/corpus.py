"""Build the default model's training corpus from Debian packages.

    python scripts/default_model/corpus.py --out .corpus/corpus.jsonl.xz

Sources (fetched with ``apt-get download`` and unpacked with ``dpkg-deb -x``: nothing is
installed, so R is not needed):

    r-cran-janeaustenr  Jane Austen's six completed novels (public-domain texts; the
                        package is MIT). One document per chapter.
    bible-kjv-text      The King James Version of the Bible (public domain), read out with
    + bible-kjv         the package's own ``bible`` program (GPL-2+; only run, not
                        shipped). One document per chapter, its verses run together.
    python3.11-doc      The Python 3.11 documentation's reST sources (PSF License
                        Version 2). One document per page, with the markup lightened:
                        directives, labels and heading underlines dropped, roles reduced
                        to their text. The changelog-like parts (whatsnew, distutils,
                        the C API) are left out.

The output is JSON lines, one document each: ``{"source", "name", "split", "text"}``,
xz-compressed, sorted, with every 20th document of each source held out as ``"val"``. The
same package versions give the same bytes; ``--out``'s sibling ``manifest.json`` records
the versions, the .deb hashes and the sizes. ``--debs DIR`` reads already downloaded
.deb files instead of calling apt.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import lzma
import re
import struct
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PACKAGES = ("r-cran-janeaustenr", "bible-kjv", "bible-kjv-text", "python3.11-doc")
VAL_EVERY = 20
AUSTEN_DATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"
# Title of each novel's R object, in the package's order.
AUSTEN_NOVELS = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
PYDOC_SOURCES = "usr/share/doc/python3.11/html/_sources"
PYDOC_SKIPPED = ("whatsnew/", "distutils/", "c-api/", "includes/", "license", "copyright",
                 "about", "bugs", "contents")


# ---- the R lazy-load database (janeaustenr's data) ------------------------------------
# R's XDR serialization, only as much as the package's character vectors and the index
# need: vectors, strings, pairlists and symbols.
_NIL, _REF = 254, 255
_SPECIAL_SXP = {254, 253, 252, 251, 250, 242, 241}


class _RReader:
    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError("not an R XDR serialization")
        self.data, self.pos = data, 2
        version = self.int()
        self.int(), self.int()  # writer and minimal reader versions
        if version == 3:
            n = self.int()  # the native encoding's name follows
            self.pos += n
        self.refs: list[Any] = []

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return v

    def item(self) -> Any:
        flags = self.int()
        sxp, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if sxp in _SPECIAL_SXP:
            return None
        if sxp == _REF:
            return self.refs[(flags >> 8) - 1]
        if sxp == 1:  # SYMSXP
            name = self.item()
            self.refs.append(name)
            return name
        if sxp == 2:  # LISTSXP: a pairlist, returned as {tag: value}
            out: dict[Any, Any] = {}
            while sxp == 2:
                if has_attr:
                    self.item()
                tag = self.item() if has_tag else len(out)
                out[tag] = self.item()
                flags = self.int()
                sxp, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
            return out
        if sxp == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None
            s = self.data[self.pos:self.pos + n].decode("utf-8", "replace")
            self.pos += n
            return s
        n = self.int()
        if sxp in (10, 13):  # LGLSXP, INTSXP
            value: Any = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif sxp == 14:  # REALSXP
            value = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif sxp in (16, 19):  # STRSXP, VECSXP
            value = [self.item() for _ in range(n)]
        else:
            raise ValueError(f"R type {sxp} is not handled")
        if has_attr:
            attrs = self.item()
            if isinstance(attrs, dict) and "names" in attrs:
                value = dict(zip(attrs["names"], value))
        return value


def read_r_lazyload(stem: Path) -> dict[str, Any]:
    """Every object of an R lazy-load database (``stem.rdx`` + ``stem.rdb``), by name."""
    index = _RReader(_rdx_payload(stem.with_suffix(".rdx"))).item()
    blob = stem.with_suffix(".rdb").read_bytes()
    out = {}
    for name, (offset, length) in index["variables"].items():
        chunk = blob[offset:offset + length]
        out[name] = _RReader(zlib.decompress(chunk[4:])).item()
    return out


def _rdx_payload(path: Path) -> bytes:
    """The index is gzip-compressed (R's ``saveRDS``), or zlib with a length prefix."""
    raw = path.read_bytes()
    return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else zlib.decompress(raw[4:])


def austen_documents(root: Path) -> Iterator[tuple[str, str]]:
    """(name, text) per chapter: paragraphs joined from the package's lines."""
    novels = read_r_lazyload(root / AUSTEN_DATA)
    for key, title in AUSTEN_NOVELS.items():
        lines = novels[key]
        chapters: list[list[str]] = [[]]
        for line in lines:
            if re.match(r"^\s*(CHAPTER|Chapter)\s+[0-9IVXLC]+\b", line or ""):
                chapters.append([])
            chapters[-1].append(line or "")
        for i, chapter in enumerate(chapters):
            text = _paragraphs(chapter)
            if len(text) > 200:
                yield f"{key}/{i:03d}", (f"{title}\n\n{text}" if i == 0 else text)


def _paragraphs(lines: list[str]) -> str:
    paras, cur = [], []
    for line in lines:
        if line.strip():
            cur.append(line.strip())
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return "\n\n".join(paras)


# ---- the King James Version ----------------------------------------------------------
_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


def kjv_documents(root: Path) -> Iterator[tuple[str, str]]:
    """(name, text) per chapter, e.g. ("Ge/1", "In the beginning God created ...")."""
    dump = subprocess.run(
        [str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-f", "gen1:1-rev22:21"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True).stdout
    chapter, verses = "", []
    for line in dump.splitlines():
        m = _VERSE.match(line)
        if not m:
            continue
        name = f"{m.group(1)}/{m.group(2)}"
        if name != chapter and verses:
            yield chapter, " ".join(verses)
            verses = []
        chapter = name
        verses.append(m.group(4).strip())
    if verses:
        yield chapter, " ".join(verses)


# ---- the Python documentation --------------------------------------------------------
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`!?~?([^`<]*?)(?:\s*<[^>]*>)?`")
_UNDERLINE = re.compile(r"^\s*([=\-~^*#+\"'`]){3,}\s*$")


# Directives whose body is markup (index entries, tables of contents, file names).
_DROPPED_DIRECTIVES = ("index", "toctree", "include", "literalinclude", "highlight",
                       "sectionauthor", "moduleauthor", "testsetup", "testcleanup", "raw",
                       "only", "image", "figure", "productionlist", "impl-detail",
                       "audit-event", "availability", "opcode", "csv-table", "list-table",
                       "tabularcolumns", "deprecated-removed", "xmlonly", "limited-api")
_DIRECTIVE = re.compile(r"^(\s*)\.\. ([\w:-]+)::\s*(.*)$")


def clean_rst(text: str) -> str:
    """reST with its markup lightened: labels, comments and heading underlines dropped,
    the bodies of markup-only directives dropped, a described object's directive line
    reduced to its signature, roles reduced to their text."""
    out: list[str] = []
    drop_indent: int | None = None  # dropping lines indented deeper than this
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        if drop_indent is not None:
            if not line.strip() or indent > drop_indent:
                continue
            drop_indent = None
        m = _DIRECTIVE.match(line)
        if m:
            name = m.group(2).split(":")[-1]
            if name in _DROPPED_DIRECTIVES:
                drop_indent = indent
            elif m.group(3) and name not in ("versionadded", "versionchanged", "deprecated"):
                out.append(m.group(1) + m.group(3))
            continue
        if line.lstrip().startswith(".. ") or _UNDERLINE.match(line):
            continue  # labels, comments, substitutions; heading over- and underlines
        if re.match(r"^\s+:[\w-]+:", line) and out and not out[-1].strip():
            continue  # a directive's options
        line = _ROLE.sub(r"\1", line).replace("``", "").replace("::", ":")
        out.append(line.rstrip())
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def pydoc_documents(root: Path) -> Iterator[tuple[str, str]]:
    base = root / PYDOC_SOURCES
    for path in sorted(base.rglob("*.rst.txt")):
        rel = path.relative_to(base).as_posix()
        if rel.startswith(PYDOC_SKIPPED):
            continue
        text = clean_rst(path.read_text(encoding="utf-8", errors="replace"))
        if len(text) > 200:
            yield rel.removesuffix(".rst.txt"), text


# ---- assembly ------------------------------------------------------------------------
def fetch_debs(directory: Path) -> dict[str, Path]:
    """``apt-get download`` each package into ``directory``; {package: .deb}."""
    subprocess.run(["apt-get", "download", *PACKAGES], cwd=directory, check=True)
    return find_debs(directory)


def find_debs(directory: Path) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        debs = sorted(directory.glob(f"{package}_*.deb"))
        if not debs:
            raise SystemExit(f"corpus: no {package}_*.deb in {directory}")
        found[package] = debs[-1]
    return found


def build(debs: dict[str, Path], out: Path) -> dict[str, Any]:
    """Write the corpus to ``out`` and its manifest beside it; returns the manifest."""
    manifest: dict[str, Any] = {"packages": {}, "sources": {}}
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for package, deb in debs.items():
            subprocess.run(["dpkg-deb", "-x", str(deb), tmp], check=True)
            manifest["packages"][package] = {
                "deb": deb.name, "sha256": hashlib.sha256(deb.read_bytes()).hexdigest()}
        root = Path(tmp)
        for source, docs in (("austen", austen_documents(root)),
                             ("kjv", kjv_documents(root)),
                             ("python-docs", pydoc_documents(root))):
            n = chars = 0
            for i, (name, text) in enumerate(docs):
                split = "val" if i % VAL_EVERY == VAL_EVERY - 1 else "train"
                records.append({"source": source, "name": name, "split": split, "text": text})
                n, chars = n + 1, chars + len(text)
            manifest["sources"][source] = {"documents": n, "characters": chars}
    payload = io.BytesIO()
    for r in records:
        payload.write((json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n").encode())
    data = payload.getvalue()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(lzma.compress(data, preset=9))
    manifest.update(file=out.name, bytes_uncompressed=len(data),
                    bytes_compressed=out.stat().st_size,
                    sha256_uncompressed=hashlib.sha256(data).hexdigest())
    (out.parent / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_corpus(path: Path) -> Iterator[dict[str, str]]:
    """The documents of a built corpus, in order."""
    with lzma.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".corpus/corpus.jsonl.xz"))
    ap.add_argument("--debs", type=Path, help="a directory holding the .deb files already")
    args = ap.parse_args(argv)
    if args.debs:
        debs = find_debs(args.debs)
        manifest = build(debs, args.out)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            manifest = build(fetch_debs(Path(tmp)), args.out)
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
