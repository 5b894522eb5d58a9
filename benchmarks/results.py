"""Benchmark results files: gather a GPU run's figures into rows, and render them as markdown.

    # after a GPU run: its archive (or the folder it was unpacked into) -> benchmarks/results/<date>-<device>.json
    python benchmarks/results.py collect runs/benchmarks/gpu/gpu_run.tar.gz --commit 7ba7e64
    # the tables for docs/benchmarks.md
    python benchmarks/results.py render benchmarks/results/2026-11-27-h100.json
    # the README's table, from every file in benchmarks/results/
    python benchmarks/results.py readme

``collect`` reads the archive's ``layer.json`` and ``compiled.json`` (``suite.py --sections
layer``) and ``models.json`` (``benchmarks/model_table.py``); the rows and their fields are
described in ``fp8_suite/results.py``. ``--commit`` records the commit where the device machine
had no git checkout (its JSON says "unknown"); ``--output`` overrides the file name.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fp8_suite (benchmarks/)

from fp8_suite import results  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True)
    collect = commands.add_parser("collect", help="a GPU run's archive or folder -> a results file")
    collect.add_argument("source", type=Path, help="gpu_run.tar.gz, or the folder it was unpacked into")
    collect.add_argument("--commit", help="the commit the device machine ran, where its JSON says 'unknown'")
    collect.add_argument("--output", type=Path, help=f"default {RESULTS_DIR.name}/<date>-<device>.json")
    render = commands.add_parser("render", help="a results file -> markdown tables on stdout")
    render.add_argument("results", type=Path)
    readme = commands.add_parser("readme", help="every results file -> the README's table of GPU results")
    readme.add_argument("--readme", type=Path, default=RESULTS_DIR.parents[1] / "README.md")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "render":
        print(results.render_markdown(json.loads(args.results.read_text())), end="")
        return 0
    if args.command == "readme":
        runs = [json.loads(p.read_text()) for p in sorted(RESULTS_DIR.glob("*.json"))]
        args.readme.write_text(results.with_readme_table(args.readme.read_text(), results.readme_markdown(runs)))
        print(f"written: the GPU results table of {args.readme} ({len(runs)} run(s))")
        return 0
    if not args.source.exists():
        print(f"results.py collect: {args.source} does not exist", file=sys.stderr)
        return 2
    rows = results.collect(args.source, args.commit)
    if not rows:
        print(f"results.py collect: no layer.json, compiled.json or models.json in {args.source}", file=sys.stderr)
        return 1
    output = args.output or results.results_path(rows, RESULTS_DIR)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{len(rows)} rows written to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
