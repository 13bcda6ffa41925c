"""`rlxf` command line: run the study, render its report, inspect a MONA file.

rlxf run --params params/default.yaml [--run-dir runs/default] [--only 01,02] [--force | --from 03]
rlxf report --run-dir runs/default [--engine auto|quarto|pandoc]
rlxf publish --run-dir runs/default [--out DIR] [--check] [--readme [ROOT]]
rlxf seeds --run-dir runs/default --seeds 1 2 [--algorithms grpo,ppo] [--quiet]
rlxf data summary data/raw/MONA_From2002.csv [--params params/default.yaml] [--unrecognised ...]
rlxf compare runs/a runs/b

Exit codes: 0 done; 1 a notebook failed (its cell and error are printed); 2 bad input (a
parameters file, a data file, a run directory), nothing computed; 130 stopped by Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import logging
import sys

from rlxf_utils.config import ConfigError, DataChecks, LabelConfig, load_config

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
            from_=args.from_, force_only=not args.skip_fresh,
        )  # fmt: skip
    except (ConfigError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, NotebookFailed) else EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return _interrupted("rlxf run")
    print(f"run complete: {run_dir}")
    return 0


EXIT_INTERRUPTED = 130  # what a shell reports for a command Ctrl-C stopped (128 + SIGINT)


def _interrupted(command: str) -> int:
    """One line for Ctrl-C, not a traceback: what was kept and how to go on."""
    print(f"\ninterrupted: {command} stopped (Ctrl-C); finished work is kept in the run dir and "
          "the same command resumes it", file=sys.stderr)  # fmt: skip
    return EXIT_INTERRUPTED


def _cmd_data_summary(args: argparse.Namespace) -> int:
    from rlxf_utils.data.checks import data_problems
    from rlxf_utils.data.mona import load_mona
    from rlxf_utils.data.schema import DataError

    try:
        data = load_config(args.params).data if args.params else None
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    labels = data.labels if data else LabelConfig()
    checks = data.checks if data else DataChecks()
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
    problems = data_problems(table, checks)
    for p in problems:
        print(f"error: {args.file}: {p}", file=sys.stderr)
    return EXIT_BAD_INPUT if problems else 0


def _cmd_report(args: argparse.Namespace) -> int:
    from rlxf_utils.artifacts import ArtifactMissing, NotARun
    from rlxf_utils.report.render import ReportError, render_report

    try:
        res = render_report(args.run_dir, engine=args.engine)
    except (ReportError, ArtifactMissing, NotARun) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    timing = ", ".join(f"{k} {v:.1f} s" for k, v in res.seconds.items())
    print(f"report rendered with {res.engine} ({timing}):\n  {res.html}\n  {res.pdf}")
    return 0


def _cmd_publish(args: argparse.Namespace) -> int:
    from rlxf_utils.artifacts import ArtifactMissing, NotARun
    from rlxf_utils.report.publish import PublishError, publish_bundle

    if args.readme is not None:
        from rlxf_utils.config import PROJECT_ROOT
        from rlxf_utils.report.readme import ReadmeError, write_readme_results

        try:
            res = write_readme_results(args.run_dir, args.readme or PROJECT_ROOT)
        except (ReadmeError, NotARun, ArtifactMissing, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(f"README results from run {res.stamp['run']} (commit {res.stamp['commit'][:7]}, "
              f"{res.stamp['date']}):\n  " + "\n  ".join(str(f) for f in res.files))  # fmt: skip
        return 0
    try:
        bundle = publish_bundle(args.run_dir, args.out)
    except (PublishError, NotARun) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    size = sum(f.stat().st_size for f in bundle.root.rglob("*") if f.is_file())
    print(f"review bundle: {bundle.root}/index.html ({len(bundle.pages)} pages, "
          f"{size / 2**20:.1f} MiB; copy the folder to any static host)")  # fmt: skip
    if bundle.unlinked:
        print(
            f"warning: not linked to their sources: {', '.join(bundle.unlinked)}", file=sys.stderr
        )
    if not args.check:
        return 0
    from rlxf_utils.report.publish_check import browser_problems, pdf_problems

    problems = browser_problems(bundle.root)
    if (bundle.root / "paper/rlxf_report.pdf").is_file():
        problems += pdf_problems(bundle.root / "paper/rlxf_report.pdf")
    for p in problems:
        print(f"problem: {p}", file=sys.stderr)
    print("every page and the PDF pass" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


RUN_HELP = """Execute the study's notebooks (notebooks/NN_*.ipynb, in number order) with papermill.

Before any work: the parameters, the run directory and the data file (its sha256 and data.checks)
are checked. The run directory is locked while the run lasts (a second run into it stops), and
the resolved parameters are frozen into <run-dir>/params.yaml, which every notebook and stage
reads. A rerun skips each notebook whose parameters, inputs, code and outputs are unchanged since
it last finished; the first that changed reruns, and every later one. An interrupted run resumes:
finished reward protocols, SFT policies and RL algorithms are reused, an interrupted RL algorithm
continues from its last checkpoint.

exit codes: 0 the study ran; 1 a notebook failed (its cell and error are printed, the executed
copy keeps the traceback); 2 bad input (parameters, data, run directory, a run already in the
folder), nothing computed; 130 stopped by Ctrl-C (the manifest records the notebook as
interrupted; the same command resumes)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlxf", description="Rerunnable RLXF study (IMF WP/24/114).",
                                epilog="exit codes: 0 done; 1 a notebook failed; 2 bad input")  # fmt: skip
    p.add_argument("--version", action="version", version=f"%(prog)s {md.version('rlxf-study')}")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="execute the study's notebooks with papermill", description=RUN_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    r.add_argument("--params", required=True, help="parameters file, e.g. params/default.yaml")
    r.add_argument("--run-dir", default=None, help="output folder (default runs/<run.name>)")
    r.add_argument("--only", default=None, help="comma-separated notebook numbers, e.g. 01,02")
    r.add_argument(
        "--skip-fresh", action="store_true",
        help="with --only: skip each named notebook that is up to date (make study's control)",
    )  # fmt: skip
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
    rp.add_argument(
        "--engine", choices=["auto", "quarto", "pandoc"], default="auto",
        help="auto: Quarto when it is on PATH, else pandoc (HTML) and pandoc + Typst (PDF); "
        "quarto or pandoc: that one (quarto fails when it is not installed)",
    )  # fmt: skip
    rp.set_defaults(func=_cmd_report)

    pb = sub.add_parser(
        "publish", help="write the review bundle: paper, executed notebooks and tables, linked",
        description="One folder for a static host: the rendered paper (HTML, PDF), every "
        "executed notebook as a read-only page, the run's tables as pages and CSV, manifest.json "
        "and an index; every table and figure of the paper links to the notebook cell that wrote "
        "it and to its data. Render the report first (rlxf report).",
        epilog="exit codes: 0 written (and, with --check, every check passed); 1 --check found a "
        "problem; 2 bad input (no run or no rendered report; with --readme, a run refused)",
    )  # fmt: skip
    pb.add_argument("--run-dir", required=True, help="a rendered run folder, e.g. runs/default")
    pb.add_argument(
        "--out", default=None, help="the bundle's folder (default <run-dir>/report/review)"
    )
    pb.add_argument("--check", action="store_true",
                    help="open every page in headless Chromium and read the PDF's layout "
                    "(needs playwright, chromium and pdftotext)")  # fmt: skip
    pb.add_argument("--readme", nargs="?", const="", default=None, metavar="ROOT",
                    help="instead of the bundle: the run's figure and table of methods, stamped "
                    "with its commit, date, profile and machine, into ROOT/docs/results/ and "
                    "ROOT/README.md's results section (ROOT: this checkout); refuses a run with "
                    "uncommitted changes, without a commit or without its report")  # fmt: skip
    pb.set_defaults(func=_cmd_publish)

    d = sub.add_parser("data", help="inspect MONA data")
    dsub = d.add_subparsers(dest="data_command", required=True)
    s = dsub.add_parser("summary", help="what the loader makes of a MONA file (CSV or .xlsx)",
                        epilog="exit code 2 when the file fails data.checks (printed after the "
                        "summary)")  # fmt: skip
    s.add_argument("file", help="a MONA CSV (comma, semicolon or tab) or .xlsx workbook")
    s.add_argument("--params", default=None,
                   help="read data.labels and data.checks from this parameters file (default: the "
                   "paper's labels and the default checks)")  # fmt: skip
    s.add_argument(
        "--unrecognised",
        choices=["non_met", "exclude", "error"],
        default=None,
        help="what a status that is no MONA code becomes (data.labels.unrecognised; "
        "default non_met, the paper's grouping)",
    )
    s.set_defaults(func=_cmd_data_summary)

    sd = sub.add_parser(
        "seeds", help="train and evaluate further RL seeds of a finished run",
        description="Train the run's RL algorithms with each further rl.seed and evaluate them "
        "(notebooks 03 and 04 in <run-dir>/seeds/seed_<s>/, reusing the run's data, reward and "
        "audit models and SFT policies; a finished seed is skipped), then write the across-seed "
        "table tables/eval_seeds.csv and figure into the run. Render the report again "
        "(rlxf report) to include it.",
    )  # fmt: skip
    sd.add_argument("--run-dir", required=True, help="a finished run folder, e.g. runs/default")
    sd.add_argument("--seeds", required=True, nargs="+", type=int, help="training seeds to add")
    sd.add_argument("--algorithms", default=None,
                    help="comma-separated ids of the run's rl.algorithm to train and evaluate "
                    "for the further seeds (default: the RL and ILHF algorithms; an offline method "
                    "only when named); the across-seed table pools only "
                    "algorithms with two seeds or more")  # fmt: skip
    sd.add_argument("--quiet", action="store_true", help="no per-cell progress bar")
    sd.set_defaults(func=_cmd_seeds)

    c = sub.add_parser("compare", help="compare two run directories artifact by artifact",
                       epilog="exit code 1 when an artifact differs (timings aside)")  # fmt: skip
    c.add_argument("before", help="the reference run dir")
    c.add_argument("after", help="the run dir to check against it")
    c.add_argument("--out", default=None, help="also write the per-artifact result as JSON")
    c.set_defaults(func=_cmd_compare)
    return p


def _cmd_seeds(args: argparse.Namespace) -> int:
    from rlxf_utils.artifacts import ArtifactMissing
    from rlxf_utils.pipeline import NotebookFailed
    from rlxf_utils.seeds import run_seeds

    try:
        algos = (
            None
            if args.algorithms is None
            else [a.strip() for a in args.algorithms.split(",") if a.strip()]
        )
        table = run_seeds(args.run_dir, args.seeds, progress=not args.quiet, algorithms=algos)
    except (ConfigError, ValueError, RuntimeError, ArtifactMissing) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, NotebookFailed) else EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return _interrupted("rlxf seeds")
    pooled = table[table["seed"] == "pooled"] if len(table) else table
    for _, r in pooled.iterrows():
        print(f"{r['label']}: gain {r['gain']:+.4f} (seed SD {r['gain_seed_sd']:.4f}), audit gain "
              f"{r['audit_gain']:+.4f}, KL {r['kl']:.2f} over {int(r['seeds'])} seeds")  # fmt: skip
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rlxf_utils.compare import compare_runs, content_differences

    for d in (args.before, args.after):
        if not (Path(d) / "manifest.json").is_file():
            print(f"error: {d}: not a run directory (no manifest.json)", file=sys.stderr)
            return EXIT_BAD_INPUT
    result = compare_runs(args.before, args.after)
    print(", ".join(f"{k} {v}" for k, v in result.counts().items()))
    changes = {p: content_differences(Path(args.before, p), Path(args.after, p))
               for p in result.paths("differs")}  # fmt: skip
    for status in ("differs", "missing", "extra"):
        for path in result.paths(status):
            print(f"{status}: {path}" + _change_line(changes.get(path)))
    print("every artifact equal (timings aside)" if result.same else "artifacts differ")
    if args.out:
        from rlxf_utils.artifacts import write_json

        commits = [json.loads((Path(d) / "manifest.json").read_text(encoding="utf-8"))
                   .get("git", {}).get("commit") for d in (args.before, args.after)]  # fmt: skip
        write_json(args.out, {"before": str(args.before), "after": str(args.after),
                              "commits": commits, "counts": result.counts(), "same": result.same,
                              "status": result.status, "changes": changes,
                              "volatile": result.volatile})  # fmt: skip
    return 0 if result.same else 1


def _change_line(change: dict | None) -> str:
    """A differing table's or JSON's change, in brief (`compare.content_differences`)."""
    if not change:
        return ""
    parts = []
    if change["largest"] is not None:
        big = change["largest"]
        parts.append(f"{change['numbers_changed']} numbers, the largest {big['where']}: "
                     f"{big['before']!r} -> {big['after']!r}")  # fmt: skip
    if change["other_values_changed"]:
        key, before, after = change["first_other_changes"][0]
        parts.append(f"{change['other_values_changed']} other values, first {key}: "
                     f"{before!r} -> {after!r}")  # fmt: skip
    if change["only_in_one"]:
        parts.append(f"{change['only_in_one']} cells or keys in one run only")
    return f" ({'; '.join(parts)})" if parts else ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
