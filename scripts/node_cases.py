"""Run ONNX node test cases through plugrt.InferenceSession and print what fails.

usage: python scripts/node_cases.py [--ops Conv,Max*] [--names test_conv*] [-v]
"""

from __future__ import annotations

import argparse
import collections
import sys

from plugrt.conformance.node_cases import iter_node_cases, run_case


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default="", help="comma-separated op patterns (fnmatch)")
    parser.add_argument("--names", default="", help="comma-separated case-name patterns")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every case")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    ops = [p for p in args.ops.split(",") if p]
    names = [p for p in args.names.split(",") if p]
    counts: collections.Counter[str] = collections.Counter()
    for case in iter_node_cases(ops or None, names or None):
        result = run_case(case, timeout=args.timeout)
        counts[result.status] += 1
        if args.verbose or result.status != "passed":
            print(f"{result.status:11s} {result.name}  {result.detail}")
    total = sum(counts.values())
    print(f"\n{counts['passed']}/{total} passed; " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()) if k != "passed"))
    return 0 if counts["passed"] == total else 1


if __name__ == "__main__":
    sys.exit(main())
