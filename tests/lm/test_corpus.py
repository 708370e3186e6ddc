"""Tests of heloco_jax.lm.data.corpus: markup, language check, a fake .deb, the CLI errors.

No network: apt-get is never run (its entry points raise if called).
"""

import gzip
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from heloco_jax.cli import main as cli
from heloco_jax.lm.data import corpus

GERMAN = [
    "Wählen Sie die Papierausrichtung für die Anzeige und den Druck aus.",
    "Die Funktion gibt die Anzahl der Bytes in einer Datei zurück.",
    "Klicken Sie im Dokument an die Stelle, an der Sie die Formel einfügen möchten.",
]
ENGLISH = [
    "Select the protection options that you want to apply to the sheet.",
    "This function returns the number of bytes in a file.",
]

HELP_PAGE = f"""<!DOCTYPE html>
<html lang="de"><head><title>Makrosicherheit</title>
<script>var english = "this is the script and it should never be kept";</script></head>
<body><header><p>Hilfe für LibreOffice 7.4 und die Module</p></header>
<h1>Makrosicherheit</h1>
<p class="paragraph">{GERMAN[0]}</p>
<p>Die Funktion gibt die Anzahl der <span class="emph">Bytes</span> in
   einer Datei zurück.</p>
<p>{ENGLISH[0]}</p>
<p>Der Dialog erscheint über <span hidden="true" class="MAC">LibreOffice – Einstellungen
</span><span>Extras – Optionen</span>, wenn das Dokument Makros enthält.</p>
<pre>Sub Main
  MsgBox "Das ist ein Beispiel und kein Text für das Modell"
End Sub</pre>
<p>{GERMAN[0]}</p>
<footer><p>This page is: /text/shared/optionen/macrosecurity.xhp</p></footer>
</body></html>
"""

XHP_PAGE = f"""<?xml version="1.0" encoding="UTF-8"?>
<helpdocument version="1.0">
<meta><topic id="textsharedformula" indexer="include"><title id="tit">Formel</title>
<filename>/text/shared/formula.xhp</filename></topic></meta>
<body>
<bookmark xml-lang="de" id="bm_1"><bookmark_value>Formeln; einfügen und bearbeiten
</bookmark_value></bookmark>
<paragraph role="paragraph" id="p1">{GERMAN[2]}</paragraph>
<paragraph role="paragraph" id="p2">{ENGLISH[1]}</paragraph>
<paragraph role="paragraph" id="p3">Die Formel wird <switchinline select="sys">
<caseinline select="MAC">mit Befehl+Eingabe</caseinline><defaultinline>mit Strg+Eingabe
</defaultinline></switchinline> in das Dokument übernommen &amp; angezeigt.</paragraph>
</body></helpdocument>
"""

MAN_PAGE = r""".\" Kommentar: this comment must go
.TH LS 1 "Juli 2024" "GNU" "Benutzerbefehle"
.SH BEZEICHNUNG
ls \- Verzeichnisinhalte auflisten
.SH BESCHREIBUNG
Auflisten von Informationen über die \fBDATEI\fPen (standardmäßig das
aktuelle Verzeichnis). Die Einträge werden alphabetisch sortiert, wenn
.B \-\-sort
nicht angegeben ist.
.TP
\fB\-a\fR, \fB\-\-all\fR
Einträge, die mit \(Bq.\(lq beginnen, nicht ignorieren und alle anzeigen.
.nf
ls -la /usr/share/doc | grep the
.fi
"""


def test_strip_markup_html_drops_chrome_hidden_and_code():
  text = corpus.strip_markup(HELP_PAGE)
  lines = text.splitlines()
  assert GERMAN[0] in lines
  assert GERMAN[1] in lines  # Inline markup and line breaks inside a paragraph joined.
  assert ("Der Dialog erscheint über Extras – Optionen, wenn das Dokument Makros enthält."
          in lines)
  for gone in ("<", "script", "Hilfe für", "Einstellungen", "MsgBox", "This page is"):
    assert gone not in text


def test_strip_markup_xhp():
  lines = corpus.strip_markup(XHP_PAGE).splitlines()
  assert GERMAN[2] in lines
  assert "Die Formel wird mit Strg+Eingabe in das Dokument übernommen & angezeigt." in lines
  assert not any("Befehl" in line or "Formeln;" in line or ".xhp" in line for line in lines)


def test_strip_markup_roff():
  lines = corpus.strip_markup(MAN_PAGE, "roff").splitlines()
  assert lines == [
      "ls - Verzeichnisinhalte auflisten",
      "Auflisten von Informationen über die DATEIen (standardmäßig das aktuelle "
      "Verzeichnis). Die Einträge werden alphabetisch sortiert, wenn --sort nicht "
      "angegeben ist.",
      "-a, --all",
      "Einträge, die mit „.“ beginnen, nicht ignorieren und alle anzeigen.",
  ]


def test_strip_markup_rejects_unknown_kind():
  with pytest.raises(ValueError, match="'pdf'"):
    corpus.strip_markup("", "pdf")


SENTENCES = {
    "de": "Wählen Sie die Zellen aus, die Sie in die Tabelle einfügen möchten.",
    "en": "Select the cells that you want to insert into the table.",
    "es": "Seleccione las celdas que desea insertar en la tabla de la hoja.",
    "fr": "Sélectionnez les cellules que vous voulez insérer dans le tableau.",
    "it": "Selezionate le celle che volete inserire nella tabella del foglio.",
    "nl": "Selecteer de cellen die u in de tabel wilt invoegen.",
    "pl": "Zaznacz komórki, które chcesz wstawić do tabeli w arkuszu.",
    "pt": "Selecione as células que você deseja inserir na tabela da planilha.",
    "ru": "Выберите ячейки, которые нужно вставить в таблицу на листе.",
    "sv": "Markera de celler som du vill infoga i tabellen och klicka på OK.",
    "fi": "Valitse solut, jotka haluat lisätä taulukkoon, ja napsauta OK-painiketta.",
}


def test_sentences_cover_every_language():
  assert sorted(SENTENCES) == sorted(corpus.LANGUAGES)


@pytest.mark.parametrize("lang", sorted(SENTENCES))
def test_is_language_accepts_own_and_rejects_others(lang):
  assert corpus.is_language(SENTENCES[lang], lang)
  for other, sentence in SENTENCES.items():
    if other != lang:
      assert not corpus.is_language(sentence, lang), (other, lang)


@pytest.mark.parametrize("line", [
    "svc.GetDatabase(user: str = '', password: str = ''): svc",
    "=SUMME(A1:B2; 3) * 100 / 7",
    "/usr/share/libreoffice/help/de/text/shared/01/01010000.html",
    "Zoom in an image",  # Only stopwords shared with English: may be English.
])
def test_is_language_rejects_code_paths_and_ambiguous_lines(line):
  assert not corpus.is_language(line, "de")


def test_clean_lines_filters_and_deduplicates():
  seen = {GERMAN[2]}
  lines = [GERMAN[0], "  " + GERMAN[0] + "  ", ENGLISH[0], "", "Zu kurz.", GERMAN[1],
           GERMAN[2], GERMAN[1].replace(" ", "   ")]
  assert corpus.clean_lines(lines, "de", seen) == [GERMAN[0], GERMAN[1]]
  assert {GERMAN[0], GERMAN[1]} <= seen


def test_package_candidates():
  assert corpus.package_candidates("en", "libreoffice-help") == ("libreoffice-help-en-us",)
  assert corpus.package_candidates("pt", "manpages") == ("manpages-pt-br", "manpages-pt")
  assert corpus.package_candidates("de", "debian-reference") == ("debian-reference-de",)


def _fake_deb(tmp_path: Path, package: str = "libreoffice-help-de") -> Path:
  """A tiny help package: two HTML pages, one XHP page and one manual page."""
  if shutil.which("dpkg-deb") is None:
    pytest.skip("dpkg-deb is not installed")
  root = tmp_path / "pkg"
  help_dir = root / "usr/share/libreoffice/help/de/text/shared"
  help_dir.mkdir(parents=True)
  (help_dir / "macrosecurity.html").write_text(HELP_PAGE, encoding="utf-8")
  (help_dir / "copy.html").write_text(HELP_PAGE.replace("Makrosicherheit", "Kopie"),
                                      encoding="utf-8")
  (help_dir / "formula.xhp").write_text(XHP_PAGE, encoding="utf-8")
  man_dir = root / "usr/share/man/de/man1"
  man_dir.mkdir(parents=True)
  (man_dir / "ls.1.gz").write_bytes(gzip.compress(MAN_PAGE.encode("utf-8")))
  doc_dir = root / "usr/share/doc" / package
  doc_dir.mkdir(parents=True)
  (doc_dir / "README.html").write_text(f"<p>{GERMAN[0]} Nur im Dokumentationsordner.</p>",
                                       encoding="utf-8")
  (root / "DEBIAN").mkdir()
  (root / "DEBIAN/control").write_text(
      f"Package: {package}\nVersion: 1:1.0-1\nArchitecture: all\n"
      "Maintainer: Test <test@example.org>\nDescription: fake help\n", encoding="utf-8")
  debs = tmp_path / "cache/debs"
  debs.mkdir(parents=True)
  deb = debs / f"{package}_1%3a1.0-1_all.deb"
  subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "-b", str(root), str(deb)],
                 check=True, capture_output=True)
  return deb


def test_fake_deb_extract_and_clean(tmp_path):
  deb = _fake_deb(tmp_path)
  dest = tmp_path / "unpacked"
  corpus.extract_deb(deb, dest)
  lines = list(corpus.package_lines(dest, "de"))
  text = "\n".join(lines)
  for line in GERMAN:
    assert lines.count(line) == 1  # Kept once, though the pages repeat them.
  assert "Auflisten von Informationen über die DATEIen" in text  # The manual page.
  for english in ENGLISH:
    assert english not in text
  for gone in ("<", ">", "&amp;", "\\f", "Nur im Dokumentationsordner", "the script"):
    assert gone not in text
  assert len(lines) == len(set(lines))


@pytest.fixture(name="no_apt")
def fixture_no_apt(monkeypatch):
  """Makes any apt-get/apt-cache call fail the test."""
  def forbidden(*args, **kwargs):
    raise AssertionError(f"apt must not run in tests: {args} {kwargs}")
  for name in ("update", "available", "download"):
    monkeypatch.setattr(corpus._Apt, name, forbidden)  # pylint: disable=protected-access


def test_cli_builds_from_cached_deb(tmp_path, no_apt, capsys):
  del no_apt
  _fake_deb(tmp_path)
  out = tmp_path / "out"
  assert cli.main(["corpus", "debian_docs", "--languages=de", f"--out={out}",
                   f"--cache={tmp_path / 'cache'}"]) == 0
  lines = (out / "de/libreoffice-help.txt").read_text(encoding="utf-8").splitlines()
  assert set(GERMAN) <= set(lines) and not set(ENGLISH) & set(lines)
  manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
  entry = manifest["languages"]["de"]
  assert entry["packages"] == ["libreoffice-help-de=1:1.0-1"]
  assert entry["files"] == ["de/libreoffice-help.txt"]
  assert entry["lines"] == len(lines)
  assert entry["bytes"] == (out / "de/libreoffice-help.txt").stat().st_size
  assert "de: " in capsys.readouterr().out


def test_cli_max_mb_per_language(tmp_path, no_apt):
  del no_apt
  _fake_deb(tmp_path)
  out = tmp_path / "out"
  assert corpus.main(["debian_docs", "--languages=de", f"--out={out}",
                      f"--cache={tmp_path / 'cache'}", "--max-mb-per-language=0.0001"]) == 0
  size = (out / "de/libreoffice-help.txt").stat().st_size
  assert 0 < size <= 100


def test_cli_unknown_language(tmp_path, no_apt, capsys):
  del no_apt
  assert cli.main(["corpus", "debian_docs", "--languages=de,xx", f"--out={tmp_path}"]) == 2
  err = capsys.readouterr().err
  assert "unknown language 'xx'" in err and "de, en, es" in err
  assert len(err.strip().splitlines()) == 1


def test_cli_unknown_source(tmp_path, no_apt, capsys):
  del no_apt
  assert corpus.main(["debian_docs", "--languages=de", f"--out={tmp_path}",
                      "--sources=libreoffice-help,wiki"]) == 2
  assert "unknown source 'wiki'" in capsys.readouterr().err


def test_cli_missing_apt(tmp_path, monkeypatch, no_apt, capsys):
  del no_apt
  real_which = shutil.which
  monkeypatch.setattr(corpus.shutil, "which",
                      lambda name: None if name == "apt-get" else real_which(name))
  assert corpus.main(["debian_docs", "--languages=de", f"--out={tmp_path}",
                      f"--cache={tmp_path / 'cache'}"]) == 2
  err = capsys.readouterr().err
  assert "apt-get not found" in err
  assert "--config.data.source=text_dir --config.data.path=DIR" in err
  assert len(err.strip().splitlines()) == 1


def test_cli_language_without_package(tmp_path, monkeypatch, no_apt, capsys):
  del no_apt
  monkeypatch.setattr(corpus.shutil, "which", lambda name: f"/usr/bin/{name}")
  monkeypatch.setattr(corpus._Apt, "update", lambda self: None)  # pylint: disable=protected-access
  monkeypatch.setattr(corpus._Apt, "available",  # pylint: disable=protected-access
                      lambda self, packages: {"libreoffice-help-de"})
  assert corpus.main(["debian_docs", "--languages=de,sv", f"--out={tmp_path / 'out'}",
                      f"--cache={tmp_path / 'cache'}"]) == 2
  err = capsys.readouterr().err
  assert "no package for language 'sv': tried libreoffice-help-sv" in err
  assert len(err.strip().splitlines()) == 1


def test_cli_requires_out(capsys):
  assert corpus.main(["debian_docs", "--languages=de"]) == 2
  assert "--out" in capsys.readouterr().err
