"""The README's, the docs/ pages' and CONTRIBUTING's concrete claims hold: the files, names,
keywords, modes and numbers they cite are the code's, their links resolve, and their examples
run. Documentation that drifts from the code fails here, not in a new user's first hour."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fused_rl
import fused_rl.nn
from fused_rl._ops import FusedOp

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md"))
USER_DOCS = ["README.md", *PAGES]  # what a user reads: README.md and the docs/ pages
DOCS = [*USER_DOCS, "CONTRIBUTING.md"]
# documents that cite many paths and names: the patterns below must keep matching there
RICH = ["README.md", "CONTRIBUTING.md", "docs/compat.md"]


def _read(name: str) -> str:
    return (ROOT / name).read_text()


def _section(text: str, title: str) -> str:
    """The body of the markdown section headed ``title`` (up to the next heading of any level),
    fenced code blocks included ("# ..." lines inside them are comments, not headings)."""
    rest = text[text.index(title) + len(title) :]
    blanked = re.sub(r"```.*?```", lambda m: re.sub(r"[^\n]", " ", m.group()), rest, flags=re.S)
    end = re.search(r"^#{1,6} ", blanked, flags=re.M)
    return rest[: end.start()] if end else rest


# ----------------------------------------------------------------------------- files


_PATH = re.compile(
    r"(?<![\w/.])((?:fused_rl|kernels|tests|bench|scripts|docs|examples|\.ci)/[\w./-]*\w)"
    r"(?:::(\w+))?"
)


def _cited_paths(doc: str):
    for match in _PATH.finditer(_read(doc)):
        path, test = match.groups()
        if path.startswith("bench/results/local"):  # made by a run, ignored by git
            continue
        if doc == "docs/compat.md" and path.startswith(("tests/", "examples/")):
            continue  # the upstream libraries' own test files, run by the live checks
        yield path, test


@pytest.mark.parametrize("doc", DOCS)
def test_cited_files_exist(doc):
    """Every repository path a document names exists (and a cited ``file::test`` is defined)."""
    cited = list(_cited_paths(doc))
    assert len(cited) > 3 or doc not in RICH, "the path pattern no longer matches anything"
    missing = [p for p, _ in cited if not (ROOT / p).exists()]
    assert not missing, f"{doc} names files that do not exist: {sorted(set(missing))}"
    for path, test in cited:
        if test is not None:
            assert re.search(rf"^def {test}\b", (ROOT / path).read_text(), flags=re.M), (
                f"{doc} cites {path}::{test}, which is not defined"
            )


@pytest.mark.integration
def test_nothing_points_outside_the_repository():
    """The project stands alone: no document or source cites files that only exist next to
    the repository (a design document, ../ paths)."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    offenders = []
    for name in tracked:
        if not name.endswith((".py", ".md", ".sh", ".toml")) or name == "tests/test_docs.py":
            continue
        text = (ROOT / name).read_text(errors="replace")
        if "DESIGN.md" in text or "../shared" in text:
            offenders.append(name)
    assert not offenders, f"files citing documents outside the repository: {offenders}"


# ----------------------------------------------------------------------------- names


def _resolve(dotted: str):
    """``fused_rl.a.b.c``: import the longest module prefix, then getattr the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("doc", DOCS)
def test_cited_fused_rl_names_exist(doc):
    names = set(re.findall(r"\bfused_rl(?:\.\w+)+", _read(doc)))
    assert names or doc not in RICH, "the name pattern no longer matches anything"
    broken = []
    for name in sorted(names):
        name = name.rstrip(".")
        if name.endswith((".py", ".md")):
            continue
        try:
            _resolve(name)
        except (ImportError, AttributeError):
            broken.append(name)
    assert not broken, f"{doc} names what fused_rl does not have: {broken}"


def _what_is_in_it():
    return _section(_read("docs/ops.md"), "## What is in it")


def test_readme_op_table_names_exist():
    table = _what_is_in_it()
    first_cells = [row.split("|")[1] for row in table.splitlines() if row.startswith("| `")]
    names = [n for cell in first_cells for n in re.findall(r"`([\w.]+)`", cell)]
    assert "policy_loss" in names and "token_logprobs" in names
    for name in names:
        if name.startswith("fused_rl."):
            _resolve(name)
        else:
            assert hasattr(fused_rl, name), f"docs/ops.md lists fused_rl.{name}: not there"


def test_readme_modes_and_metrics_are_the_code_s():
    from fused_rl._agg import LOSS_AGG_MODES
    from fused_rl.reference.kl import KL_KINDS

    row = next(r for r in _what_is_in_it().splitlines() if r.startswith("| `policy_loss` |"))
    quoted = set(re.findall(r"`([\w.-]+)`", row))
    assert set(LOSS_AGG_MODES) <= quoted, "docs/ops.md's loss_agg list is not the code's"
    assert set(KL_KINDS) <= quoted, "docs/ops.md's KL estimator list is not the code's"
    logits = torch.randn(2, 3, 11)
    _, metrics = fused_rl.policy_loss(
        logits, torch.randint(0, 11, (2, 3)), torch.randn(2), ref_logprobs=torch.zeros(2, 3),
        beta=0.1, dual_clip=3.0, entropy_coef=0.01, backend="reference",
    )  # fmt: skip
    listed = {m for m in re.findall(r"`(\w+)`", row) if m in metrics}
    expanded = set()
    for pattern in re.findall(r"`(\w+)\((\w+)/(\w+)\)`", row):  # clip_frac(_low/_high)
        stem, *suffixes = pattern
        expanded |= {stem, *(stem + s for s in suffixes)}
    for pattern in re.findall(r"`(\w+)/(\w+)`", row):  # ratio_mean/max
        stem = pattern[0].rsplit("_", 1)[0]
        expanded |= {pattern[0], f"{stem}_{pattern[1]}"}
    assert set(metrics) == listed | (expanded & set(metrics)), (
        f"docs/ops.md's metric list {sorted(listed | expanded)} is not the code's {sorted(metrics)}"
    )


def test_compat_table_names_exist():
    """Every function or class docs/compat.md's adapter table says a module mirrors is there."""
    table = _section(_read("docs/compat.md"), "## Drop-in adapters")
    rows = [r for r in table.splitlines() if r.startswith("| `compat.")]
    assert len(rows) >= 5
    for row in rows:
        module_name, mirrors = row.split("|")[1:3]
        module = importlib.import_module("fused_rl." + module_name.strip().strip("`"))
        names = re.findall(r"`(\w+)`", mirrors)
        names = [n for n in names if not re.fullmatch(r"[0-9a-f]{7,40}|\d+", n)]  # commits
        keywords = {"dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor",
                    "temperature", "row_mask"}  # fmt: skip
        missing = [n for n in names if n not in keywords and not hasattr(module, n)]
        assert not missing, f"{module.__name__} lacks {missing} (docs/compat.md's adapter table)"


# ----------------------------------------------------------------------------- conventions


def _public_ops():
    """The public functions (an options class such as a config object is not an op)."""
    skip = {"__version__", "available_backends", "config", "describe"}
    named = [getattr(fused_rl, n) for n in fused_rl.__all__ if n not in skip]
    return [obj for obj in named if not inspect.isclass(obj)]


@pytest.mark.parametrize("op", _public_ops(), ids=lambda f: f.__name__)
def test_every_op_takes_backend_last_and_keyword_only(op):
    """docs/usage.md: every op takes ``backend="auto" | "triton" | "reference"``."""
    params = list(inspect.signature(op).parameters.values())
    last = params[-1]
    assert last.name == "backend" and last.default == "auto", op.__name__
    assert last.kind is inspect.Parameter.KEYWORD_ONLY, op.__name__


@pytest.mark.parametrize("op", _public_ops(), ids=lambda f: f.__name__)
def test_tensors_positional_everything_else_keyword_only(op):
    """CONTRIBUTING ("Naming"): tensors positionally, everything else keyword-only."""
    for p in inspect.signature(op).parameters.values():
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            annotation = str(p.annotation)
            assert "Tensor" in annotation, (
                f"{op.__name__}({p.name}: {annotation}) is positional but not a tensor"
            )


def _fused_ops():
    modules = ["logprobs", "losses", "_vocab_ops", "_policy_ops", "_truncated_ops", "kl",
               "reductions", "values", "advantages", "continuous", "distill", "linear",
               "truncated_parallel"]  # fmt: skip
    ops = {}
    for name in modules:
        module = importlib.import_module(f"fused_rl.{name}")
        ops.update({id(v): v for v in vars(module).values() if isinstance(v, FusedOp)})
    return list(ops.values())


def test_custom_op_names_follow_the_naming_rule():
    """CONTRIBUTING ("Naming"): custom ops ``fused_rl::<op>_fwd`` / ``fused_rl::<op>_bwd``,
    and every forward that has a backward pairs with one of the same stem."""
    rule = _section(_read("CONTRIBUTING.md"), "## Naming")
    assert "`fused_rl::<op>_fwd` / `fused_rl::<op>_bwd`" in rule
    names = {op.__name__ for op in _fused_ops()}
    assert len(names) >= 15
    bad = sorted(n for n in names if not re.fullmatch(r"\w+_(fwd|bwd)", n))
    assert not bad, f"custom ops breaking the naming rule: {bad}"
    orphans = sorted(n for n in names if n.endswith("_bwd") and n[:-4] + "_fwd" not in names)
    assert not orphans, f"backward ops without a forward of the same stem: {orphans}"


# ----------------------------------------------------------------------------- numbers


def test_launch_counts_in_docs_match_the_budget_tests():
    """The launch counts docs/call-cost.md and CONTRIBUTING state are the ones the tests
    enforce."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import test_call_cost as cost
    finally:
        sys.path.remove(str(ROOT / "tests"))
    page = _section(_read("docs/call-cost.md"), "## Kernel launches")
    token_row = next(r for r in page.splitlines() if r.startswith("| `policy_loss` (token IS"))
    seq_row = next(r for r in page.splitlines() if 'importance_sampling="sequence"' in r)
    logp_row = next(r for r in page.splitlines() if r.startswith("| `token_logprobs("))
    assert f"| {cost.POLICY_LOSS_BUDGET['token']}:" in token_row
    assert f"| {cost.POLICY_LOSS_BUDGET['sequence']} " in seq_row
    assert f"| {cost.TOKEN_LOGPROBS_BUDGET} " in logp_row
    contributing = _section(_read("CONTRIBUTING.md"), "## What a call costs around its kernels")
    today = {
        "token IS": cost.POLICY_LOSS_BUDGET["token"],
        "sequence IS": cost.POLICY_LOSS_BUDGET["sequence"],
        "`policy_loss_from_logprobs`": cost.FROM_LOGPROBS_BUDGET,
        "`token_logprobs(": cost.TOKEN_LOGPROBS_BUDGET,
    }
    for key, number in today.items():
        row = next(r for r in contributing.splitlines() if r.startswith("|") and key in r)
        assert row.rstrip().endswith(f"| {number} |"), (key, row)


def test_example_agreement_claim_matches_the_test():
    """docs/usage.md's figure for how closely the example's two runs agree is within the
    bound that tests/test_example.py asserts."""
    claim = re.search(r"agree to ([\d.]+e-\d+) relative", " ".join(_read("docs/usage.md").split()))
    assert claim, "docs/usage.md no longer states how closely the example's runs agree"
    example_test = (ROOT / "tests" / "test_example.py").read_text()
    bound = float(re.search(r"rel=([\d.e-]+)", example_test).group(1))
    assert float(claim.group(1)) < bound


# ----------------------------------------------------------------------------- examples


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _docs_with_python_blocks():
    return [doc for doc in USER_DOCS if _python_blocks(_read(doc))]


def test_the_runnable_examples_are_where_the_test_finds_them():
    """``python`` blocks are the runnable ones (``text`` blocks need a GPU group or show
    output): the README keeps its first example and the adapters' imports, and the usage,
    compat and tensor-parallel pages each have some."""
    assert len(_python_blocks(_read("README.md"))) >= 2
    with_blocks = _docs_with_python_blocks()
    for page in ["docs/usage.md", "docs/compat.md", "docs/tensor-parallel.md"]:
        assert page in with_blocks, f"{page} has no python block left to run"


# Runs each block in a namespace of its own (a block stands alone: a name another block
# defined is undefined here), all of one page's blocks in one process: the import is most of
# a block's time. A failing block prints its traceback, then its number and text (last: the
# message keeps the tail), and stops the page; each block's number is printed as it starts
# (a timeout says which hung).
_RUN_BLOCKS = """
import sys, traceback
blocks, sys.argv = sys.argv[1:], sys.argv[:1]
for i, block in enumerate(blocks):
    print(f"block {i}", file=sys.stderr, flush=True)
    try:
        exec(compile(block, f"<block {i}>", "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        print(f"block {i} failed:\\n{block}", file=sys.stderr)
        sys.exit(1)
"""


@pytest.mark.integration
@pytest.mark.no_poison
@pytest.mark.parametrize("doc", _docs_with_python_blocks())
def test_python_blocks_run(doc):
    """Every ``python`` block of the README and of each docs/ page runs as written (the
    reference backend here, to keep its real-size shapes fast; the kernels' parity is the rest
    of the suite's job)."""
    blocks = _python_blocks(_read(doc))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONWARNINGS": "error"}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _RUN_BLOCKS, *blocks], capture_output=True, text=True,
            env=env, timeout=300, cwd=ROOT,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr or b""  # bytes, text=True or not
        err = err.decode(errors="replace") if isinstance(err, bytes) else err
        pytest.fail(f"{doc}: timed out at {' '.join(err.split()[-2:])}")
    assert proc.returncode == 0, f"{doc}: a python block failed\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("doc", DOCS)
def test_no_section_twice(doc):
    """A section header appears once (a stale copy of a section once lingered in README)."""
    headers = [line for line in _read(doc).splitlines() if line.startswith("## ")]
    twice = sorted({h for h in headers if headers.count(h) > 1})
    assert not twice, f"{doc} repeats {twice}"


# ----------------------------------------------------------------------------- links and layout


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    blanked = re.sub(r"```.*?```", "", text, flags=re.S)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", blanked, flags=re.M):
        slug = _slug(heading)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(text: str) -> list[str]:
    blanked = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"\]\(([^()\s]+)\)", blanked)


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    """Every relative link resolves to a file or folder of the repository, and every
    ``#anchor`` to a heading of the page it points to."""
    source = ROOT / doc
    broken = []
    for link in _links(_read(doc)):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (source.parent / path).resolve() if path else source
        if ROOT.resolve() not in [target, *target.parents] or not target.exists():
            broken.append(link)
        elif anchor and (target.suffix != ".md" or anchor not in _anchors(target.read_text())):
            broken.append(link)
    assert not broken, f"{doc} has broken links: {broken}"


def test_readme_links_every_docs_page():
    """No docs/ page is left unreachable from the README."""
    links = set(_links(_read("README.md")))
    assert len(PAGES) >= 7
    assert not [page for page in PAGES if page not in links]


@pytest.mark.parametrize("page", PAGES)
def test_docs_page_opens_with_what_it_covers(page):
    """A docs/ page is a title, then one sentence saying what the page covers."""
    title, blank, *rest = _read(page).splitlines()
    assert title.startswith("# ") and blank == ""
    first = " ".join(rest[: rest.index("")] if "" in rest else rest)
    assert first[:1].isupper() and not first.startswith(("#", "|", "```", "- ")), first
    assert len(re.findall(r"[.!?](?:\s|$)", first)) == 1 and first.endswith("."), first


@pytest.mark.parametrize("doc", USER_DOCS)
def test_no_issue_numbers_or_outside_paths(doc):
    """What a user reads stands alone: no tracker numbers, no path outside the repository."""
    text = _read(doc)
    assert not re.search(r"\b[Ii]ssues?\s+#?\d+|(?<![\w&/])#\d+\b", text), doc
    for outside in ["../shared", "/work/", ".mirror/", "/home/", "/root/"]:
        assert outside not in text, f"{doc} names {outside}"


def test_readme_first_screen_then_docs_then_developer_commands():
    """README.md: what it is, install, the example, the adapters, the measured figures, then
    the links to docs/ and the two developer commands; the long sections live in docs/."""
    readme = _read("README.md")
    headings = re.findall(r"^## (.+)$", readme, flags=re.M)
    order = ["Install", "A GRPO step", "Already on", "Benchmarks", "Documentation",
             "Development"]  # fmt: skip
    assert [next(i for i, h in enumerate(headings) if h.startswith(o)) for o in order] == list(
        range(len(order))
    ), headings
    assert len(readme.splitlines()) < 150, "README.md is growing again: move it to docs/"
    example = _python_blocks(readme)[0]
    assert len(example.strip().splitlines()) <= 14 and "policy_loss" in example


def test_ci_runs_the_readme_test_command():
    """The README's test command is the one CI runs (``.ci/run``)."""
    block = re.search(r"```bash\n(.*?)```", _section(_read("README.md"), "## Development"), re.S)
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert commands == ["bash scripts/setup.sh", "bash scripts/test.sh"]
    ci = [line.strip() for line in _read(".ci/run").splitlines() if line.strip()]
    assert ci[-1] == "bash scripts/test.sh"


def test_readme_benchmark_figures_are_the_measured_ones():
    """The README's short H200 table carries figures of docs/benchmarks.md's full tables (to
    the README's rounding), and their date and commit."""
    readme = _section(_read("README.md"), "## Benchmarks")
    page = _read("docs/benchmarks.md")
    header = re.search(r"\(NVIDIA H200, (\d{4}-\d\d-\d\d), main at ([0-9a-f]{7})\)", readme)
    assert header and f"{header.group(1)}, main at {header.group(2)}" in page
    measured = {float(x.replace(",", "")) for x in re.findall(r"\d[\d,]*\.\d+", page)}
    figures = re.findall(r"(\d+\.\d+) ms", readme)
    assert len(figures) >= 6
    for figure in figures:
        digits = len(figure.split(".")[1])
        assert any(round(m, digits) == float(figure) for m in measured), figure
