"""`tokenmill-conformance`: certify one platform plugin from the command line.

    tokenmill-conformance --platform NAME [--tier T0..T5] [--report cert.json]
                          [--markdown cert.md] [--quick] [--plugin SPEC]

Runs the suite with pytest and writes the certificate. Exit code 0 only when every
required tier that ran passed (a full run: the plugin is certified); 1 when one failed;
2 on a usage error. `--tier` runs a subset (e.g. T1 or T0-T3); such a certificate is
marked incomplete and never certifies. `--quick` runs the same shapes with smaller
property-test and benchmark budgets: it is labelled "quick check, not a certificate" and
never certifies either.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import pytest

from tokenmill_conformance.tiers import parse_tiers

SUITE_DIR = Path(__file__).with_name("suite")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill-conformance", description="certify a tokenmill platform plugin"
    )
    parser.add_argument("--platform", required=True, help="the plugin's entry point name")
    parser.add_argument(
        "--plugin",
        metavar="SPEC",
        help="register the plugin in-process from 'pkg.module[:attr]' or 'file.py' instead "
        "of its installed entry point (for development)",
    )
    parser.add_argument("--tier", help="run only these tiers: T1, T0-T3, T0..T2, T1,T2")
    parser.add_argument("--report", help="write the JSON certificate here")
    parser.add_argument("--markdown", help="write the Markdown certificate here")
    parser.add_argument(
        "--quick", action="store_true",
        help="smaller property-test and benchmark budgets, the same shapes: a quick check, "
        "not a certificate"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="less pytest output")
    parser.add_argument(
        "pytest_args", nargs="*", help="extra pytest arguments, after `--` (e.g. -- -x -k attention)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tier:
        try:
            parse_tiers(args.tier)
        except ValueError as exc:
            print(f"tokenmill-conformance: {exc}", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="tokenmill-conformance-") as tmp:
        report = args.report or str(Path(tmp) / "certificate.json")
        pytest_args = [
            str(SUITE_DIR),
            "-c", str(SUITE_DIR / "pytest.ini"),
            "--rootdir", str(SUITE_DIR),
            "-p", "no:cacheprovider",
            "--tokenmill-platform", args.platform,
            "--tokenmill-report", report,
            "-q" if args.quiet else "-v",
            "-rfE",
        ]
        for option, value in (
            ("--tokenmill-plugin", args.plugin),
            ("--tokenmill-tier", args.tier),
            ("--tokenmill-markdown", args.markdown),
        ):
            if value:
                pytest_args += [option, value]
        if args.quick:
            pytest_args.append("--tokenmill-quick")
        status = pytest.main(pytest_args + args.pytest_args)
        if not Path(report).exists():
            print(f"tokenmill-conformance: pytest exited with {status} before the certificate "
                  "was written", file=sys.stderr)
            return 2 if status in (pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.INTERNAL_ERROR) else 1
        certificate = json.loads(Path(report).read_text())
    failed = [t["tier"] for t in certificate["tiers"] if t["required"] and t["status"] == "failed"]
    empty = [t["tier"] for t in certificate["tiers"] if t["required"] and t["status"] == "empty"]
    if failed or empty:
        print(f"tokenmill-conformance: {args.platform!r} REFUSED: failing required tiers "
              f"{failed + empty}")
        for failure in certificate["failures"]:
            print(f"  [{failure['tier']}] {failure['id']}")
        return 1
    print(f"tokenmill-conformance: {args.platform!r} {certificate['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
