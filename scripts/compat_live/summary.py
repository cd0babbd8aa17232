"""Render the live compatibility results (``compat-live/*.json`` and the project tests'
JUnit files) as the Markdown table between the markers of ``docs/compat.md``.

Each ``<lib>.json`` written by ``scripts/compat_live/<lib>/check.py`` holds::

    {"library": "trl", "versions": {"trl": "1.16.0", ...},
     "rows": [{"check": "...", "result": "pass" | "fail" | "documented",
               "detail": "..."}, ...]}

``documented`` marks a difference that is intentional and explained in docs/compat.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import xml.etree.ElementTree as ET

BEGIN, END = "<!-- live-check:begin -->", "<!-- live-check:end -->"


def _project_tests(path: pathlib.Path) -> str:
    if not path.exists():
        return "not run"
    suite = ET.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    total, fail, err, skip = (
        int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")
    )
    return f"{total - fail - err - skip} passed, {fail + err} failed, {skip} skipped"


def table(out_dir: pathlib.Path) -> str:
    lines = ["| library | versions | check | result | detail |", "|---|---|---|---|---|"]
    for path in sorted(out_dir.glob("*.json")):
        data = json.loads(path.read_text())
        lib = data["library"]
        versions = ", ".join(f"{k} {v}" for k, v in data.get("versions", {}).items())
        project = _project_tests(out_dir / f"{lib}.project-tests.xml")
        rows = [
            {
                "check": f"tests/test_compat_{lib}.py",
                "result": "pass" if " 0 failed" in project else "fail",
                "detail": project,
            }
        ]
        for row in rows + data["rows"]:
            detail = str(row.get("detail", "")).replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {lib} | {versions} | {row['check']} | {row['result']} | {detail} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=pathlib.Path)
    parser.add_argument("--write", type=pathlib.Path, help="Markdown file with the markers")
    args = parser.parse_args()
    stamp = f"Run on {datetime.date.today().isoformat()} (`bash scripts/test-compat-live.sh`)."
    body = f"{stamp}\n\n{table(args.out_dir)}"
    print(body)
    if args.write:
        text = args.write.read_text() if args.write.exists() else f"{BEGIN}\n{END}\n"
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        args.write.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")


if __name__ == "__main__":
    main()
