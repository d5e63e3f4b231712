"""The docs read as results (issue 48): a short quick start, short sentences, a results page.

Counted on the Markdown source: prose is every line outside ``` fences, tables and headings; a word is
a whitespace-separated token with a letter or digit in it (inline code counts word by word, a link
by its text). Sentences end at . ! or ? before a space; a list item, a table row or a blank line
ends one too. `python tests/docs/test_docs_shape.py` prints the counts.
"""
import pathlib
import re
import statistics

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MEASURED = ROOT / "docs" / "measured.md"

QUICK_START_WORDS = 120
SENTENCE_WORDS = 40


def _blocks(text):
    """Prose blocks (paragraphs, list items) outside code fences, tables and headings."""
    blocks, cur, fenced = [], [], False
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("```"):
            fenced = not fenced
            blocks.append(cur)
            cur = []
            continue
        if fenced or not s or s.startswith("|") or s.startswith("#"):
            blocks.append(cur)
            cur = []
            continue
        if re.match(r"([-*]|\d+\.)\s", s):
            blocks.append(cur)
            cur = []
            s = re.sub(r"^([-*]|\d+\.)\s+", "", s)
        cur.append(s)
    blocks.append(cur)
    return [" ".join(b) for b in blocks if b]


def _plain(block):
    block = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", block)  # a link counts by its text
    return block


def _words(text):
    return [w for w in text.split() if re.search(r"[A-Za-z0-9]", w)]


def _sentences(block):
    # Inline code never ends a sentence: mask its punctuation, keep its words.
    masked = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(".", "\x00").replace("?", "\x00").replace("!", "\x00"),
                    _plain(block))
    masked = re.sub(r"\b(e\.g|i\.e|vs|etc)\.", lambda m: m.group(0).replace(".", "\x00"), masked)
    return [s for s in re.split(r"(?<=[.!?])\s+", masked) if _words(s)]


def _section(text, title):
    m = re.search(r"^## " + re.escape(title) + r"\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"no '## {title}' section"
    return m.group(1)


def counts(readme=None, measured=None):
    readme = README.read_text() if readme is None else readme
    measured = MEASURED.read_text() if measured is None else measured
    quick = _section(readme, "Quick start")
    readme_sentences = [len(_words(s)) for b in _blocks(readme) for s in _sentences(b)]
    measured_sentences = [len(_words(s)) for b in _blocks(measured) for s in _sentences(b)]
    return {
        "quick_start_prose_words": sum(len(_words(_plain(b))) for b in _blocks(quick)),
        "readme_sentences": len(readme_sentences),
        "readme_sentences_over_40": sum(n > SENTENCE_WORDS for n in readme_sentences),
        "readme_longest_sentence": max(readme_sentences),
        "measured_lines": len(measured.splitlines()),
        "measured_sentences_over_40": sum(n > SENTENCE_WORDS for n in measured_sentences),
        "measured_median_sentence": statistics.median(measured_sentences),
    }


def _long_sentences(text):
    return [(len(_words(s)), s[:90]) for b in _blocks(text) for s in _sentences(b)
            if len(_words(s)) > SENTENCE_WORDS]


def test_the_quick_start_is_two_commands_and_a_few_lines():
    quick = _section(README.read_text(), "Quick start")
    words = sum(len(_words(_plain(b))) for b in _blocks(quick))
    assert words <= QUICK_START_WORDS, f"quick start prose: {words} words"
    commands = re.findall(r"```bash\n(.*?)```", quick, re.S)
    assert commands, "no command block in the quick start"
    lines = [l for l in commands[0].splitlines() if l.strip()]
    assert len(lines) == 2 and "bench/adam_throughput.py" in lines[0] and lines[1] == "python -m pytest tests", lines


def test_the_quick_start_lines_are_the_ones_ci_runs():
    """.ci/run runs the README's two lines verbatim."""
    quick = _section(README.read_text(), "Quick start")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for line in re.findall(r"```bash\n(.*?)```", quick, re.S)[0].strip().splitlines():
        assert line in ci, line


def test_no_readme_sentence_is_over_40_words():
    assert _long_sentences(README.read_text()) == []


def test_measured_md_is_a_results_page():
    text = MEASURED.read_text()
    head, _, body = text.partition("\n## ")
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert len(sections) >= 8
    # A contents list at the top naming every section.
    for title in sections:
        assert f"(#{_anchor(title)})" in head, f"the contents list misses '{title}'"
    # One results table per feature: the number, the command, the results file, the date and machine.
    for title in sections:
        if title.startswith("Proven on CPU"):
            continue
        body = _section(text, title)
        tables = [t for t in re.findall(r"^(\|.*\|)\n\|[-| :]+\|\n", body, re.M)]
        assert tables, f"'{title}' has no table"
        header = tables[0].lower()
        for column in ("result", "command", "file", "date"):
            assert column in header, f"'{title}': the first table's header lacks '{column}': {tables[0]}"
    assert any(t.startswith("Proven on CPU") for t in sections), "no 'proven on CPU / waiting for a GPU' section"
    # Results, not history: no "before:" rows, short sentences.
    assert not re.search(r"^\|\s*before:", text, re.M | re.I)
    assert _long_sentences(text) == []


def test_every_results_file_named_in_measured_md_exists():
    text = MEASURED.read_text()
    names = set(re.findall(r"`([A-Za-z0-9_.{},-]+\.(?:json|log|txt|png))`", text))
    assert names
    results = ROOT / "bench" / "results"
    for name in names:
        expanded = _expand_braces(name)
        assert any((results / n).exists() for n in expanded), f"bench/results/{name} does not exist"


def _expand_braces(name):
    m = re.search(r"\{([^}]*)\}", name)
    if not m:
        return [name]
    return [x for alt in m.group(1).split(",") for x in _expand_braces(name[:m.start()] + alt + name[m.end():])]


def _anchor(title):
    """GitHub's heading anchor."""
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).strip().lower()
    return re.sub(r"[^\w\- ]", "", title).replace(" ", "-")


def _anchors(path):
    seen, out, fenced = {}, set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            a = _anchor(m.group(1))
            n = seen.get(a, 0)
            seen[a] = n + 1
            out.add(a if n == 0 else f"{a}-{n}")
    return out


def test_links_between_the_docs_resolve():
    files = [README] + sorted((ROOT / "docs").glob("*.md"))
    bad = []
    for path in files:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append((path.name, target))
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append((path.name, target))
    assert bad == []


if __name__ == "__main__":
    for k, v in counts().items():
        print(f"{k}: {v}")
    for n, s in _long_sentences(README.read_text()):
        print("README", n, s)
