#!/usr/bin/env python3
"""Instructor's dry run: execute every notebook with papermill into build/executed/ and print seconds per notebook.

    python tools/run_all.py                         notebooks/ with their defaults
    python tools/run_all.py --solutions             solutions/ too
    python tools/run_all.py -p QUICK False -p WORLD_SIZE 4 notebooks/03_ddp.ipynb
"""
from __future__ import annotations

import argparse
import ast
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _show(path: Path) -> str:
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def main(argv=None) -> int:
    import papermill as pm
    from tqdm import tqdm

    from course_lib import COURSE_KERNEL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook in notebooks/")
    ap.add_argument("--solutions", action="store_true", help="also run solutions/")
    ap.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                    help="override a parameter of the 'parameters' cell (papermill)")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "executed")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = ap.parse_args(argv)

    paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    if args.solutions and not args.notebooks:
        paths += sorted((ROOT / "solutions").glob("*.ipynb"))
    params = {k: _value(v) for k, v in args.parameter}
    args.out.mkdir(parents=True, exist_ok=True)
    rows, failed = [], 0
    bar = tqdm(paths, unit="notebook", desc="executing")
    for path in bar:
        bar.set_postfix_str(path.name)
        target = args.out / path.parent.name / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            pm.execute_notebook(str(path), str(target), parameters=params, kernel_name=COURSE_KERNEL,
                                progress_bar=False, execution_timeout=args.timeout, cwd=str(path.parent))
            status = "ok"
        except Exception as e:  # papermill stores the failing cell in the output notebook
            status, failed = f"FAILED: {type(e).__name__}", failed + 1
        rows.append((_show(path), time.perf_counter() - t0, status))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'notebook':<{width}}  {'seconds':>8}  status")
    for name, secs, status in rows:
        print(f"{name:<{width}}  {secs:>8.1f}  {status}")
    print(f"{'total':<{width}}  {sum(r[1] for r in rows):>8.1f}")
    print(f"executed notebooks are in {_show(args.out)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
