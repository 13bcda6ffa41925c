"""`rlxf` command line: run the study, inspect a MONA file.

rlxf run --params params/default.yaml [--run-dir runs/default] [--only 01,02]
rlxf data summary data/raw/MONA_From2002.csv [--unrecognised non_met|exclude|error]
"""

from __future__ import annotations

import argparse
import logging
import sys

from rlxf_utils.config import ConfigError, LabelConfig

__all__ = ["main"]

EXIT_BAD_INPUT = 2


# Each command imports what it runs when it runs: `rlxf --help` answers without loading pandas,
# papermill or the report's renderers.
def _cmd_run(args: argparse.Namespace) -> int:
    from rlxf_utils.pipeline import NotebookFailed, run_study

    only = args.only.split(",") if args.only else None
    try:
        run_dir = run_study(
            args.params, args.run_dir, only=only, progress=not args.quiet, force=args.force,
            from_=args.from_,
        )  # fmt: skip
    except (ConfigError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, NotebookFailed) else EXIT_BAD_INPUT
    print(f"run complete: {run_dir}")
    return 0


def _cmd_data_summary(args: argparse.Namespace) -> int:
    from rlxf_utils.data.mona import load_mona
    from rlxf_utils.data.schema import DataError

    labels = LabelConfig()
    try:
        table = load_mona(
            args.file,
            met=labels.met,
            not_assessed=labels.not_assessed,
            unrecognised=args.unrecognised or labels.unrecognised,
        )
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(table.report.render())
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from rlxf_utils.artifacts import ArtifactMissing
    from rlxf_utils.report.render import ReportError, render_report

    try:
        res = render_report(args.run_dir, engine=args.engine)
    except (ReportError, ArtifactMissing) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    timing = ", ".join(f"{k} {v:.1f} s" for k, v in res.seconds.items())
    print(f"report rendered with {res.engine} ({timing}):\n  {res.html}\n  {res.pdf}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlxf", description="Rerunnable RLXF study (IMF WP/24/114).")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="execute the study's notebooks with papermill")
    r.add_argument("--params", required=True, help="parameters file, e.g. params/default.yaml")
    r.add_argument("--run-dir", default=None, help="output folder (default runs/<run.name>)")
    r.add_argument("--only", default=None, help="comma-separated notebook numbers, e.g. 01,02")
    r.add_argument("--quiet", action="store_true", help="no per-cell progress bar")
    r.add_argument(
        "--force", action="store_true", help="rerun every notebook, even those up to date"
    )
    r.add_argument(
        "--from", dest="from_", default=None, metavar="NN",
        help="rerun notebook NN and every later one (earlier ones are skipped if up to date)",
    )  # fmt: skip
    r.set_defaults(func=_cmd_run)

    rp = sub.add_parser("report", help="render the working paper from a run dir (HTML + PDF)")
    rp.add_argument("--run-dir", required=True, help="a run folder, e.g. runs/default")
    rp.add_argument("--engine", choices=["auto", "quarto", "pandoc"], default="auto")
    rp.set_defaults(func=_cmd_report)

    d = sub.add_parser("data", help="inspect MONA data")
    dsub = d.add_subparsers(dest="data_command", required=True)
    s = dsub.add_parser("summary", help="what the loader makes of a MONA file (CSV or .xlsx)")
    s.add_argument("file", help="a MONA CSV (comma, semicolon or tab) or .xlsx workbook")
    s.add_argument(
        "--unrecognised",
        choices=["non_met", "exclude", "error"],
        default=None,
        help="what a status that is no MONA code becomes (data.labels.unrecognised; "
        "default non_met, the paper's grouping)",
    )
    s.set_defaults(func=_cmd_data_summary)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
