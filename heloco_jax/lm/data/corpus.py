"""Builds the offline multilingual corpus from Debian's translated documentation.

``heloco-jax corpus debian_docs --languages=de,en,es,fr,it --out=DIR`` fetches Debian's
translated documentation packages with ``apt-get download`` (no root needed), unpacks them
with ``dpkg-deb -x``, turns their HTML/XHP help pages and roff manual pages into plain text
(one paragraph per line), keeps only the lines written in the target language, drops
duplicates and writes ``DIR/<lang>/<source>.txt`` plus ``DIR/manifest.json``. The result is
read with ``--config.data.source=text_dir --config.data.path=DIR``. It then trains a
byte-level BPE vocabulary of ``--vocab-size`` ids (default 8192; 0: none) on the corpus's
training text (``heloco_jax.lm.data.bpe``) and writes ``DIR/tokenizer.json``, used with
``--config.data.tokenizer=DIR/tokenizer.json``; ``heloco-jax corpus bpe --out=DIR``
trains it for any text_dir corpus.

Sources (``--sources``): ``libreoffice-help`` (default; about 3 MB of clean text per
language), ``manpages`` and ``debian-reference`` (used where the language has the package).

Package lists: apt keeps its own lists in ``CACHE/lists`` (``apt-get -o
Dir::State::Lists=CACHE/lists -o Dir::Cache=CACHE -o Debug::NoLocking=1 update``, which
works unprivileged); if that update fails the system's lists are used. Downloaded ``.deb``
files stay in ``CACHE/debs`` and are reused on later runs without touching apt at all.

The language check (``is_language``) is a per-line test with three parts:

1. Character check: at least 60% of the line's non-space characters are letters, so code,
   formulas, paths and tables of numbers go.
2. Script check: at least 90% of the letters are Latin (for ``ru``: at least 60% Cyrillic,
   which still allows Latin product names such as "LibreOffice Calc").
3. Word vote. Each word in the small built-in stopword lists (about 60 function words per
   language, ``_STOPWORDS``) gives one vote, split equally among the languages listing it
   ("de" counts a fifth each for es, fr, nl, pt and sv); each word with letters outside
   a-z gives one more vote, split among the languages whose alphabet has them all
   (``_LETTERS``: "ä" gives a third each to de, sv and fi; Cyrillic letters go to ru).
   The line is kept when at least ``MIN_EVIDENCE`` (15%) of its words vote for the target,
   and the target gets at least as many votes as any other supported language and
   strictly more than English, the language untranslated paragraphs fall back to (a tie
   with English, as in "Zoom in an image" for German, means the line may well be English).

Why this check: translated documentation falls back to untranslated English paragraphs,
which the vote rejects since their function words ("the", "of", "is") are English and
they lack the target's letters; prose always carries function words while code, menus
and identifiers mostly do not. The letter votes carry languages that put their grammar
in word endings rather than separate function words (fi, ru, pl). It costs one regex scan and a few
cached dictionary look-ups per line, so cleaning runs at the speed of the markup parser;
a full language-ID model pass over ~100 MB took about 28 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import gzip
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, TextIO

from heloco_jax.lm.data import bpe
from heloco_jax.rundir import safe_files

SOURCES = ("libreoffice-help", "manpages", "debian-reference")
MB = 1_000_000
MIN_CHARS = 24
MIN_WORDS = 4
MIN_EVIDENCE = 0.15
_TEXT_DIR_HINT = ("point --config.data.source=text_dir --config.data.path=DIR at any folder "
                  "of per-language text instead")

_STOPWORDS: dict[str, frozenset[str]] = {lang: frozenset(words.split()) for lang, words in {
    "de": """der die das und in zu den von mit ist im für auf dem des ein eine einer eines
             einem einen nicht sich es sie wird werden wenn auch als an bei oder aus nach
             wie um so kann können sind durch dass über zum zur vom hier diese dieser dieses
             diesem diesen noch nur alle man haben hat wir ich aber muss soll sollte wurde
             ihre ihren ihr sein keine welche damit dann bis unter sowie kein""",
    "en": """the of and to a in is that for it as with on be by this are or from at an not
             you can if which will your all has have was when then into these there their
             its also more only other such each than any how do does were been but they them
             what where who would should could may must one some no so up out about between
             after before both same""",
    "es": """de la que el en y a los se del las un por con no una su para es al lo como más
             o pero sus le ya este esta si cuando puede pueden sobre entre también hasta
             desde todo todos ser son está están hay sin otro otra cada mediante usted ese
             esa estos estas donde qué cómo debe""",
    "fr": """de la le et les des en un une du à est pour que qui dans ce il pas par sur plus
             au aux avec se ne sont vous votre vos ou son sa ses cette ces mais si peut
             peuvent être été comme tout tous toutes lorsque quand où l d qu n s c entre sans
             leur leurs elle ils nous on y dont aussi""",
    "it": """di e il la che a per un una in del della dei delle degli dello al alla ai alle
             nel nella nei con non si è da dal dalla sono come le lo gli i ma se anche può
             possono questo questa questi queste o tra fra su sul sulla più essere viene
             vengono ogni tutti tutte quando dove l d dell all nell sull un""",
    "nl": """de het een en van in is op te dat die voor met niet zijn wordt worden aan er
             als om door of bij ook kan kunt u uw naar dan uit deze dit wat wel nog maar
             hebben heeft tot moet zo geen meer onder alle waar hoe wanneer je jouw""",
    "pl": """i w z na się do nie to że jest o a jak ale po dla od co tak jako za przez może
             być są lub oraz tym ten ta te tego tej które który która jeśli aby przy ze we
             tylko można jego jej ich już też także gdy będzie między pod nad bez każdy""",
    "pt": """de a o que e do da em um para é com não uma os no se na por mais as dos como
             mas ao ele das à seu sua ou quando nos já também só pelo pela até isso entre
             depois sem mesmo aos seus quem nas esse essa este esta você pode podem são ser
             está estão cada todos todas sobre onde""",
    "ru": """и в не на что с по для как это из к а или у от о же так при то все его ее её
             если можно быть будет только также этот эта эти этого этой который которая
             которые может когда до за над под без чтобы есть вы нет""",
    "sv": """och i att det som en på är av för med till den har de inte om ett kan du så
             vid men eller från när alla måste också under efter dessa detta denna din ditt
             dina sig sin sitt sina ska skall finns vara blir där hur vilken vilket man mer
             än över utan mellan""",
    "fi": """ja on ei se että hän oli olla kun mutta tai jos niin myös kuin voi voit
             voidaan ovat tämä tämän tätä nämä joka jotka jonka sen sitä siitä mukaan kanssa
             vain kaikki eli sekä jo nyt mitä miten missä ole et olet tässä siinä tähän
             tulee eikä vaan""",
}.items()}
# Letters outside a-z that each language's orthography uses.
_LETTERS: dict[str, frozenset[str]] = {lang: frozenset(letters) for lang, letters in {
    "de": "äöüß", "en": "", "es": "áéíóúñü", "fr": "àâçéèêëîïôûùüÿœæ", "it": "àèéìòù",
    "nl": "éèëïöü", "pl": "ąćęłńóśźż", "pt": "áâãàçéêíóôõú",
    "ru": "абвгдеёжзийклмнопрстуфхцчшщъыьэюя", "sv": "åäöé",
    "fi": "äöå"}.items()}
_SPECIAL_LETTERS = frozenset().union(*_LETTERS.values())
LANGUAGES = tuple(sorted(_STOPWORDS))

_WORD = re.compile(r"[^\W\d_]+")
_LATIN = re.compile(r"[A-Za-z\u00C0-\u024F]")
_CYRILLIC = re.compile(r"[\u0400-\u04FF]")
_SPACE = re.compile(r"\s+")


class CorpusError(Exception):
  """An error reported to the user as one line (exit code 2)."""


@functools.lru_cache(maxsize=1 << 17)
def _word_votes(word: str) -> dict[str, float]:
  """A lower-case word's votes per language (see the module docstring)."""
  special = _SPECIAL_LETTERS.intersection(word)
  votes: dict[str, float] = collections.defaultdict(float)
  for langs in ([lang for lang in LANGUAGES if word in _STOPWORDS[lang]],
                [lang for lang in LANGUAGES if special and special <= _LETTERS[lang]]):
    for lang in langs:
      votes[lang] += 1.0 / len(langs)
  return dict(votes)


def is_language(line: str, lang: str) -> bool:
  """Whether ``line`` is prose in ``lang`` (see the module docstring for the check)."""
  chars = len(line) - line.count(" ")
  letters = sum(1 for c in line if c.isalpha())
  if not chars or letters < 0.6 * chars:
    return False
  script = _CYRILLIC if lang == "ru" else _LATIN
  if len(script.findall(line)) < (0.6 if lang == "ru" else 0.9) * letters:
    return False
  words = _WORD.findall(line.lower())
  votes = dict.fromkeys(LANGUAGES, 0.0)
  evidence = 0
  for word in words:
    word_votes = _word_votes(word)
    evidence += lang in word_votes
    for other, share in word_votes.items():
      votes[other] += share
  target = votes.pop(lang)
  return (evidence >= MIN_EVIDENCE * len(words) and target >= max(votes.values())
          and (lang == "en" or target > votes["en"]))


def clean_lines(lines: Iterable[str], lang: str,
                seen: Optional[set[str]] = None) -> list[str]:
  """Keeps the lines worth training on, in order.

  Args:
    lines: plain-text lines (``strip_markup``'s output).
    lang: the target language code.
    seen: lines already kept (updated in place), to de-duplicate across documents.

  Returns:
    The lines with whitespace collapsed, short lines (under ``MIN_CHARS`` characters or
    ``MIN_WORDS`` words), lines not in ``lang`` and repeated lines removed.
  """
  seen = set() if seen is None else seen
  kept = []
  for line in lines:
    line = _SPACE.sub(" ", line).strip()
    if (len(line) < MIN_CHARS or line.count(" ") + 1 < MIN_WORDS or line in seen
        or not is_language(line, lang)):
      continue
    seen.add(line)
    kept.append(line)
  return kept


# ---------------------------------------------------------------------------------------
# Markup.

_HTML_BLOCK = frozenset(
    "address article aside blockquote br caption dd div dl dt figcaption footer h1 h2 h3 h4 "
    "h5 h6 header hr li nav ol p pre section table tbody td th thead tr ul "
    # XHP (LibreOffice help sources).
    "paragraph title listitem tablecell".split())
_HTML_SKIP = frozenset(
    "script style head header footer aside nav noscript pre button select "
    # XHP: index keywords, per-platform alternatives, file names, comments.
    "bookmark caseinline filename comment history".split())
_HTML_VOID = frozenset("area base br col embed hr img input link meta source track wbr".split())


class _HtmlText(html.parser.HTMLParser):
  """Collects the visible text of an HTML or XHP document, one paragraph per block."""

  def __init__(self) -> None:
    super().__init__(convert_charrefs=True)
    self.paragraphs: list[str] = []
    self._current: list[str] = []
    self._skip_tag = ""
    self._skip_depth = 0

  def handle_starttag(self, tag: str, attrs: list[tuple[str, Optional[str]]]) -> None:
    if self._skip_depth:
      self._skip_depth += tag == self._skip_tag
      return
    if tag in _HTML_BLOCK:
      self._flush()
    if tag not in _HTML_VOID and (tag in _HTML_SKIP or any(k == "hidden" for k, _ in attrs)):
      self._skip_tag, self._skip_depth = tag, 1

  def handle_endtag(self, tag: str) -> None:
    if self._skip_depth:
      self._skip_depth -= tag == self._skip_tag
    elif tag in _HTML_BLOCK:
      self._flush()

  def handle_data(self, data: str) -> None:
    if not self._skip_depth:
      self._current.append(data)

  def close(self) -> None:
    super().close()
    self._flush()

  def _flush(self) -> None:
    text = _SPACE.sub(" ", "".join(self._current)).strip()
    if text:
      self.paragraphs.append(text)
    self._current = []


_ROFF_CHARS = {"em": "—", "en": "–", "aq": "'", "dq": '"', "lq": "“", "rq": "”", "oq": "‘",
               "cq": "’", "bu": "•", "co": "©", "hy": "-", "mi": "-", "ti": "~", "lB": "[",
               "rB": "]", "rs": "\\", "Fo": "«", "Fc": "»", "fo": "‹", "fc": "›", "ga": "`",
               "ha": "^", "dg": "†", "de": "°", "tm": "™", "rg": "®", "->": "→", "<-": "←",
               "Bq": "„", "bq": "‚"}
_ROFF_ESCAPE = re.compile(
    r"\\(?:f(?:\[[^\]]*\]|\(..|.)"        # font change: \fB \f(CW \f[B]
    r"|s[+-]?\d+"                         # size change: \s-1
    r"|\*(?:\[[^\]]*\]|\(..|.)"           # string: \*(Tm \*[name] \*x
    r"|\((?P<two>..)|\[(?P<long>[^\]]*)\]"  # named character: \(em \[em]
    r"|(?P<one>.))")
_ROFF_SINGLE = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "~": " ", "0": " "}
_ROFF_FONT_MACROS = frozenset("B I SM SB".split())
_ROFF_ALTERNATING_MACROS = frozenset("BI BR IB IR RB RI".split())
_ROFF_ARG = re.compile(r'"([^"]*)"|(\S+)')
# mdoc (BSD manual page) macros that carry inline text; their arguments are kept.
_MDOC_INLINE = frozenset(
    "Ar Cm Dq Dv Em Er Ev Fl Fn Ft Ic Li Nm Ns Op Pa Pq Ql Qq Sq Sy Va Xr".split())
_ROFF_TEXT_MACROS = _ROFF_FONT_MACROS | _ROFF_ALTERNATING_MACROS | _MDOC_INLINE
# Requests that start (True) or end (False) unfilled text: code, synopses, tables.
_ROFF_NO_FILL = {"nf": True, "EX": True, "TS": True, "fi": False, "EE": False, "TE": False}


def _roff_escape(match: re.Match[str]) -> str:
  """The text a roff escape sequence stands for ("" for font, size and string changes)."""
  name = match.group("two") or match.group("long")
  if name is not None:
    return _ROFF_CHARS.get(name, "")
  return _ROFF_SINGLE.get(match.group("one") or "", "")


def _roff_text(text: str) -> str:
  """A roff text line without its trailing comment, escapes decoded."""
  return _ROFF_ESCAPE.sub(_roff_escape, text.split('\\"', 1)[0])


def _strip_roff(text: str) -> str:
  """Plain text of a roff manual page: one paragraph per line, no-fill blocks dropped."""
  paragraphs: list[str] = []
  current: list[str] = []

  def flush() -> None:
    joined = _SPACE.sub(" ", " ".join(current)).strip()
    if joined:
      paragraphs.append(joined)
    current.clear()

  no_fill = tag_line = False
  for line in text.splitlines():
    if line.startswith((".", "'")):
      macro, _, args = line[1:].strip().partition(" ")
      if macro in _ROFF_TEXT_MACROS:
        parts = [quoted or bare for quoted, bare in _ROFF_ARG.findall(args)
                 if (quoted or bare) not in _MDOC_INLINE]
        if not parts:
          continue
        line = ("" if macro in _ROFF_ALTERNATING_MACROS else " ").join(parts)
      else:
        flush()
        no_fill = _ROFF_NO_FILL.get(macro, no_fill)
        tag_line = macro == "TP"
        continue
    if no_fill:
      continue
    if not line.strip():
      flush()
      continue
    current.append(_roff_text(line))
    if tag_line:
      flush()
      tag_line = False
  flush()
  return "\n".join(paragraphs)


def strip_markup(text: str, kind: str = "html") -> str:
  """Visible text of a document, one paragraph per line.

  Args:
    text: the document.
    kind: ``"html"`` for HTML and XHP/XML help pages (scripts, page chrome, hidden
      elements, code blocks and per-platform alternatives dropped; entities decoded) or
      ``"roff"`` for manual pages (requests, comments and no-fill blocks dropped; escapes
      decoded).

  Returns:
    The paragraphs, whitespace collapsed, joined by newlines.
  """
  if kind == "roff":
    return _strip_roff(text)
  if kind != "html":
    raise ValueError(f"kind must be 'html' or 'roff', got {kind!r}")
  parser = _HtmlText()
  parser.feed(text)
  parser.close()
  return "\n".join(parser.paragraphs)


# ---------------------------------------------------------------------------------------
# Packages.

def package_candidates(lang: str, source: str) -> tuple[str, ...]:
  """Debian package names that hold ``source`` in ``lang``, preferred first."""
  if lang == "en":
    return {"libreoffice-help": ("libreoffice-help-en-us",), "manpages": ("manpages",),
            "debian-reference": ("debian-reference-en",)}[source]
  return tuple(f"{source}-{code}" for code in (("pt-br", "pt") if lang == "pt" else (lang,)))


def extract_deb(deb_path: Path, dest: Path) -> None:
  """Unpacks the files of a ``.deb`` into ``dest`` (``dpkg-deb -x``; no root needed)."""
  _run(["dpkg-deb", "-x", str(deb_path), str(dest)], f"dpkg-deb -x {deb_path.name}")


def _documents(root: Path) -> Iterator[tuple[str, str]]:
  """(kind, text) of each help page and manual page under an unpacked package."""
  for path in sorted(root.rglob("*")):
    parts = path.relative_to(root).parts
    if path.is_symlink() or not path.is_file() or parts[:3] == ("usr", "share", "doc"):
      continue
    if path.suffix in (".html", ".htm", ".xhp"):
      yield "html", path.read_text(encoding="utf-8", errors="replace")
    elif "man" in parts[:-1]:
      data = path.read_bytes()
      yield "roff", (gzip.decompress(data) if path.suffix == ".gz" else data).decode(
          "utf-8", errors="replace")


def package_lines(root: Path, lang: str, seen: Optional[set[str]] = None) -> Iterator[str]:
  """Clean ``lang`` lines of every document under an unpacked package, document by document."""
  seen = set() if seen is None else seen
  for kind, text in _documents(root):
    yield from clean_lines(strip_markup(text, kind).splitlines(), lang, seen)


def _run(cmd: Sequence[str], what: str, cwd: Optional[Path] = None) -> str:
  """Runs a command; its stdout, or a CorpusError naming ``what`` failed and why."""
  proc = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, check=False)
  if proc.returncode:
    lines = (proc.stderr or proc.stdout).strip().splitlines() or ["(no output)"]
    raise CorpusError(f"{what} failed (exit {proc.returncode}): {lines[-1]}")
  return proc.stdout


class _Apt:
  """apt-get/apt-cache with package lists kept in the cache, the system's as fallback."""

  def __init__(self, cache: Path) -> None:
    self._cache = cache
    self._options = ["-o", f"Dir::Cache={cache}", "-o", "Debug::NoLocking=1"]
    self._own_lists = ["-o", f"Dir::State::Lists={cache / 'lists'}"]

  def update(self) -> None:
    """Refreshes the lists in the cache; falls back to the system's if that fails.

    ``apt-get update`` exits 0 when it cannot fetch, so success means: it exited 0 and
    ``CACHE/lists`` holds package indices.
    """
    lists = self._cache / "lists"
    (lists / "partial").mkdir(parents=True, exist_ok=True)
    (self._cache / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    try:
      _run(["apt-get", "-q", *self._options, *self._own_lists, "update"], "apt-get update")
      if not any(lists.glob("*_Packages*")):
        raise CorpusError("apt-get update fetched no package lists")
    except CorpusError as e:
      print(f"heloco-jax corpus: {e}; using the system's package lists", file=sys.stderr)
      self._own_lists = []

  def available(self, packages: Sequence[str]) -> set[str]:
    """The subset of ``packages`` that apt can download."""
    out = _run(["apt-cache", *self._options, *self._own_lists, "policy", *packages],
               "apt-cache policy")
    found, name = set(), ""
    for line in out.splitlines():
      if not line.startswith(" ") and line.endswith(":"):
        name = line[:-1]
      elif line.strip().startswith("Candidate:") and line.split()[-1] != "(none)":
        found.add(name)
    return found

  def download(self, package: str, dest: Path) -> Path:
    """Downloads a package's ``.deb`` into ``dest`` (atomically); returns its path."""
    with tempfile.TemporaryDirectory(dir=self._cache, prefix="download-") as tmp:
      _run(["apt-get", "-q", *self._options, *self._own_lists, "download", package],
           f"apt-get download {package}", cwd=Path(tmp))
      (deb,) = Path(tmp).glob(f"{package}_*.deb")
      return Path(shutil.move(str(deb), dest / deb.name))


def _cached_deb(debs: Path, candidates: Sequence[str]) -> Optional[Path]:
  """The latest downloaded ``.deb`` of the first candidate package that has one."""
  for package in candidates:
    found = list(debs.glob(f"{package}_*.deb"))
    if found:
      return max(found, key=lambda deb: deb.stat().st_mtime)
  return None


def _deb_label(deb: Path) -> str:
  """``name=version`` from a ``name_version_arch.deb`` file name."""
  name, version, _ = urllib.parse.unquote(deb.stem).split("_")
  return f"{name}={version}"


# ---------------------------------------------------------------------------------------
# Building.

class _Progress:
  """One self-overwriting status line on a terminal; silent otherwise."""

  def __init__(self, stream: TextIO) -> None:
    self._stream = stream
    self._live = stream.isatty()

  def show(self, message: str) -> None:
    if self._live:
      self._stream.write(f"\r\033[K{message}")
      self._stream.flush()

  def done(self) -> None:
    self.show("")


@dataclasses.dataclass
class _Job:
  lang: str
  source: str
  package: str
  deb: Optional[Path]   # None until downloaded.


def _plan(languages: Sequence[str], sources: Sequence[str], debs: Path,
          apt: _Apt) -> list[_Job]:
  """One job per (language, source) with a package, preferring ``.deb`` files in the cache.

  A source without a package for a language is skipped with a note; a language left with
  no package at all is an error naming the packages tried.
  """
  wanted = [(lang, source, package_candidates(lang, source))
            for lang in languages for source in sources]
  cached = {(lang, source): deb for lang, source, candidates in wanted
            if (deb := _cached_deb(debs, candidates))}
  available: set[str] = set()
  if len(cached) < len(wanted):
    apt.update()
    available = apt.available([p for lang, source, candidates in wanted
                               if (lang, source) not in cached for p in candidates])
  jobs, skipped = [], []
  for lang, source, candidates in wanted:
    if (lang, source) in cached:
      deb = cached[lang, source]
      jobs.append(_Job(lang, source, deb.name.partition("_")[0], deb))
    elif package := next((p for p in candidates if p in available), None):
      jobs.append(_Job(lang, source, package, None))
    else:
      skipped.append(f"no {source} package for {lang!r} (tried {', '.join(candidates)})")
  for lang in languages:
    if not any(job.lang == lang for job in jobs):
      tried = [p for want, _, candidates in wanted if want == lang for p in candidates]
      raise CorpusError(f"no package for language {lang!r}: tried {', '.join(tried)} "
                        f"(not in apt's package lists)")
  for note in skipped:
    print(f"heloco-jax corpus: {note}; skipping it", file=sys.stderr)
  return jobs


def _build_language(lang: str, jobs: Sequence[_Job], out: Path, debs: Path, apt: _Apt,
                    max_bytes: Optional[int], progress: _Progress) -> dict[str, object]:
  """Writes ``out/<lang>/<source>.txt`` for the language's jobs; its manifest entry."""
  start = time.monotonic()
  lang_dir = out / lang
  safe_files.refuse_link(str(out))
  safe_files.refuse_link(str(lang_dir))
  shutil.rmtree(lang_dir, ignore_errors=True)
  lang_dir.mkdir(parents=True)
  seen: set[str] = set()
  written = lines = 0
  full = False
  packages, files = [], []
  for job in jobs:
    if full:
      break
    if job.deb is None:
      progress.show(f"[{lang}] {job.package}: downloading")
      job.deb = apt.download(job.package, debs)
    progress.show(f"[{lang}] {job.package}: extracting")
    packages.append(_deb_label(job.deb))
    path = lang_dir / f"{job.source}.txt"
    files.append(str(path.relative_to(out)))
    text = safe_files.open_fd(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with tempfile.TemporaryDirectory(prefix="heloco-corpus-") as tmp, \
         os.fdopen(text, "w", encoding="utf-8") as f:
      extract_deb(job.deb, Path(tmp))
      for line in package_lines(Path(tmp), lang, seen):
        size = len(line.encode("utf-8")) + 1
        full = max_bytes is not None and written + size > max_bytes
        if full:
          break
        f.write(line + "\n")
        written += size
        lines += 1
        if lines % 1000 == 0:
          progress.show(f"[{lang}] {job.package}: cleaning, {written / MB:.1f} MB so far")
  return {"packages": packages, "files": files, "bytes": written, "lines": lines,
          "seconds": round(time.monotonic() - start, 1)}


def build(languages: Sequence[str], out: Path, cache: Path,
          sources: Sequence[str] = ("libreoffice-help",),
          max_mb_per_language: Optional[float] = None) -> dict[str, object]:
  """Builds the corpus; returns the manifest (also written to ``out/manifest.json``)."""
  start = time.monotonic()
  debs = cache / "debs"
  debs.mkdir(parents=True, exist_ok=True)
  apt = _Apt(cache)
  progress = _Progress(sys.stderr)
  progress.show("finding packages")
  jobs = _plan(languages, sources, debs, apt)
  progress.done()
  max_bytes = None if max_mb_per_language is None else int(max_mb_per_language * MB)
  entries = {}
  for lang in languages:
    entries[lang] = entry = _build_language(
        lang, [j for j in jobs if j.lang == lang], out, debs, apt, max_bytes, progress)
    progress.done()
    print(f"{lang}: {entry['bytes'] / MB:.2f} MB, {entry['lines']} lines from "
          f"{', '.join(entry['packages'])} in {entry['seconds']} s", flush=True)
  manifest = {"builder": "debian_docs", "sources": list(sources),
              "max_mb_per_language": max_mb_per_language, "languages": entries,
              "seconds": round(time.monotonic() - start, 1)}
  safe_files.write_atomic(str(out / "manifest.json"), json.dumps(manifest, indent=2) + "\n")
  return manifest


# ---------------------------------------------------------------------------------------
# Command line.

def _default_cache() -> Path:
  root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
  return root / "heloco_jax" / "debian_docs"


def _parse_list(value: str, allowed: Sequence[str], what: str) -> list[str]:
  """A comma list whose items are all in ``allowed``."""
  items = [item.strip() for item in value.split(",") if item.strip()]
  if not items:
    raise CorpusError(f"no {what} given; supported: {', '.join(allowed)}")
  for item in items:
    if item not in allowed:
      raise CorpusError(f"unknown {what} {item!r}; supported: {', '.join(allowed)}")
  return items


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="heloco-jax corpus",
      description="Build the offline multilingual corpus from Debian's documentation.")
  parser.add_argument("builder", choices=["debian_docs", "bpe"],
                      help="debian_docs: build the corpus (then its BPE vocabulary); bpe: "
                           "train the BPE vocabulary of the text_dir corpus in --out")
  parser.add_argument("--languages", help=f"debian_docs: comma list of: {', '.join(LANGUAGES)}")
  parser.add_argument("--out", required=True, type=Path, help="output folder")
  parser.add_argument("--cache", type=Path, default=_default_cache(),
                      help="apt lists and downloaded .debs (default: %(default)s)")
  parser.add_argument("--max-mb-per-language", type=float, default=None,
                      help="cap on each language's output, in MB (10^6 bytes)")
  parser.add_argument("--sources", default=SOURCES[0],
                      help=f"comma list of: {', '.join(SOURCES)} (default: %(default)s)")
  parser.add_argument("--vocab-size", type=int, default=bpe.DEFAULT_VOCAB_SIZE,
                      help="ids of the byte-level BPE vocabulary written to OUT/tokenizer.json "
                           "(0: none; default: %(default)s)")
  return parser


def train_bpe(out: Path, vocab_size: int) -> Path:
  """Trains the BPE vocabulary of the text_dir corpus in ``out``; returns its path."""
  from heloco_jax.lm.data import sources as sources_lib  # pylint: disable=g-import-not-at-top
  try:
    documents = sources_lib.load_documents("text_dir", str(out), None, None)
    vocabulary = bpe.train(documents, vocab_size)
  except ValueError as error:
    raise CorpusError(str(error).replace("make_data: ", "")) from None
  path = out / bpe.FILENAME
  vocabulary.save(str(path))
  print(f"heloco-jax corpus: wrote {path} ({vocabulary.vocab_size} ids, trained on "
        f"{len(documents)} languages without the last {bpe.HOLDOUT:.0%} of each)",
        file=sys.stderr)
  return path


def main(argv: Sequence[str]) -> int:
  """``heloco-jax corpus ...``; returns the exit code (2 with one line on errors)."""
  try:
    args = _parser().parse_args(list(argv))
  except SystemExit as e:
    return int(e.code or 0)
  try:
    if args.vocab_size and not 258 <= args.vocab_size <= 65535:
      raise CorpusError(f"--vocab-size={args.vocab_size} is not allowed; allowed: 0 (none) or "
                        "an integer in [258, 65535]")
    if args.builder == "bpe":
      train_bpe(args.out, args.vocab_size or bpe.DEFAULT_VOCAB_SIZE)
      return 0
    if not args.languages:
      raise CorpusError("--languages is required with debian_docs")
    languages = _parse_list(args.languages, LANGUAGES, "language")
    sources = _parse_list(args.sources, SOURCES, "source")
    if args.max_mb_per_language is not None and args.max_mb_per_language <= 0:
      raise CorpusError(f"--max-mb-per-language must be positive, got "
                        f"{args.max_mb_per_language}")
    for tool in ("apt-get", "apt-cache", "dpkg-deb"):
      if shutil.which(tool) is None:
        raise CorpusError(f"{tool} not found (debian_docs needs Debian's apt and dpkg); "
                          f"{_TEXT_DIR_HINT}")
    build(languages, args.out, args.cache.expanduser(), sources, args.max_mb_per_language)
    if args.vocab_size:
      train_bpe(args.out, args.vocab_size)
  except (CorpusError, safe_files.LinkError) as e:
    print(f"heloco-jax corpus: {e}", file=sys.stderr)
    return 2
  except OSError as e:  # --out inside a file, a read-only file system, a full disk
    print(f"heloco-jax corpus: cannot write to --out={str(args.out)!r}: "
          f"{e.strerror or e} ({e.filename or args.out})", file=sys.stderr)
    return 2
  return 0
