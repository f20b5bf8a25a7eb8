"""report.html (specdec.study.html_report): self-contained, readable offline, and what a browser shows.

The browser test opens a real run's page in headless Chromium (Debian's `chromium`; `.ci/run` installs
it, and the test is skipped, saying so, where it is missing), reads the DOM the browser built and takes
a screenshot that must not be blank."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from specdec.study import html_report
from specdec.study.html_report import markdown_to_html, write_run_report
from tests.study.test_experiment import FAST, _cfg
from tests.study.test_figures import _summary

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def test_markdown_tables_become_html_tables_with_numbers_right_aligned_and_text_escaped():
    text = ("title <b>line</b>\n\n| category | speedup |\n|---|---:|\n| qa | 1.20x [1.1, 1.3] |\n"
            "| **overall** | `1.10x` |\n\nnote")
    out = markdown_to_html(text)
    assert out.count("<table>") == 1 and out.count("<tr>") == 3
    assert '<th class="num">speedup</th>' in out and '<td class="num">1.20x [1.1, 1.3]</td>' in out
    assert "<strong>overall</strong>" in out and "<code>1.10x</code>" in out
    assert "&lt;b&gt;line&lt;/b&gt;" in out and "<b>" not in out
    assert out.endswith("<p>note</p>")


def test_a_page_holds_everything_it_shows(tmp_path):
    from specdec.study.figures import run_figures

    summary = _summary()
    figures = run_figures(summary, tmp_path)
    page = write_run_report(tmp_path, summary, "| a | b |\n|---|---:|\n| x | 1 |", {"seed": 3, "method": {"k": 4}},
                            figures).read_text()
    assert page.count('src="data:image/png;base64,') == 2
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing to fetch: no link, no remote image
    assert "<script" not in page and "@import" not in page
    for part in ("specdec run: draft_forced (lossy)", "seed: 3", "Provenance", "version: python", "git commit",
                 "tiny-target"):
        assert part in page
    assert html_report.provenance([summary])["device"] == "cpu float32"


def _browser(*args: str, profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *BROWSER_FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium; .ci/run "
                                             "tries to): the page is not checked in a browser")
def test_a_browser_shows_a_tiny_runs_report(tmp_path):
    from PIL import Image

    from specdec.study import experiment
    from specdec.study.tracking import read_offline_summary

    out = tmp_path / "run"
    cfg = _cfg(*FAST, "method=ngram", "plots=true", "logger=wandb", "logger.mode=offline")
    result = experiment.run(cfg, out)
    page = out / "report.html"
    url = page.resolve().as_uri()

    dom = _browser("--dump-dom", url, profile=tmp_path / "profile")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert "specdec run: ngram" in html
    tables = re.findall(r"<table>.*?</table>", html, flags=re.S)
    assert tables and any("speedup" in t and "overall" in t for t in tables)
    images = re.findall(r'<img [^>]*src="data:image/png;base64,', html)
    assert len(images) == 2  # acceptance per position and categories
    for section in ("Results", "Figures", "Configuration", "Summary", "Provenance"):
        assert f"<h2>{section}</h2>" in html
    assert json.loads((out / "summary.json").read_text())["method"] in html

    shot = tmp_path / "shot.png"
    taken = _browser(f"--screenshot={shot}", "--window-size=1280,1800", url, profile=tmp_path / "profile")
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    with Image.open(shot) as image:
        assert image.format == "PNG" and image.size == (1280, 1800)
        pixels = image.convert("RGB")
        colours = pixels.getcolors(maxcolors=1 << 20) or []
        inked = sum(n for n, rgb in colours if sum(rgb) < 600)  # anything darker than near-white
    assert len(colours) > 50 and inked > 0.02 * 1280 * 1800  # text, tables and figures, not a blank page

    logged = read_offline_summary(result.wandb_run_dir)  # W&B got the page too, as an HTML file
    assert logged["report"]["_type"] == "html-file"
