"""Render the working paper (`reports/rlxf_report.qmd`) from a run directory's artifacts.

The source uses Quarto's `{{< var key >}}` and `{{< include file >}}` shortcodes; `build_sources`
writes `_variables.yml` (every number the prose quotes, read from the run dir) and
`_generated/*.md` (tables, stage notes) beside a copy of the source. With Quarto on PATH,
`quarto render` makes the HTML and the PDF (Typst). Without it, the same source is expanded
here and rendered by pandoc (HTML, and Typst source that the `typst` package compiles to PDF),
with `reports/crossref.lua` doing Quarto's cross-referencing.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlxf_utils.artifacts import ArtifactMissing, NotARun, RunDir, atomic_path, read_manifest
from rlxf_utils.config import PROJECT_ROOT
from rlxf_utils.markdown import markdown_table
from rlxf_utils.names import map_strings
from rlxf_utils.report.control import control_section
from rlxf_utils.report.data import (
    data_section,
    pool_duplicates_sentence,
    pools_table,
    split_sizes_table,
)
from rlxf_utils.report.evaluation import eval_section
from rlxf_utils.report.findings import findings_section
from rlxf_utils.report.forensic import forensic_section
from rlxf_utils.report.ilhf import ilhf_section
from rlxf_utils.report.offline import offline_section
from rlxf_utils.report.overopt import overopt_section
from rlxf_utils.report.reward import reward_section
from rlxf_utils.report.risk import risk_section
from rlxf_utils.report.rl import rl_section
from rlxf_utils.report.rlgf import rlgf_section
from rlxf_utils.report.seeds import seeds_section
from rlxf_utils.report.sources import sources_table
from rlxf_utils.report.wording import name_table, pct, typeset_apostrophes, typeset_minus

log = logging.getLogger(__name__)


__all__ = ["ReportError", "RenderResult", "build_sources", "expand_shortcodes", "render_report"]


log = logging.getLogger(__name__)


REPORT_SRC = PROJECT_ROOT / "reports"


QMD = "rlxf_report.qmd"


SHORTCODE = re.compile(r"\{\{<\s*(var|include)\s+([^\s>]+)\s*>\}\}")


class ReportError(RuntimeError):
    """The report cannot be rendered; the message names the missing artifact or the failing tool."""


@dataclass
class RenderResult:
    html: Path | None
    pdf: Path | None
    engine: str
    seconds: dict[str, float] = field(default_factory=dict)


def _data_variables(run: RunDir) -> dict[str, Any]:
    s = run.read_json("data/summary.json", stage="notebook 01_data_exploration")
    dups = {d["protocol"]: d for d in s["duplicates"]}
    sizes = {(r["protocol"], r["part"]): r for r in s["split_sizes"]}
    ctx = {c["split"]: c for c in s["contexts"]}
    return {
        "rows_read": f"{s['rows_read']:,}",
        "rows_used": f"{s['rows_used']:,}",
        "labelled": f"{s['labelled']:,}",
        "met": f"{s['met']:,}",
        "non_met": f"{s['non_met']:,}",
        "met_share": pct(s["met_share"]),
        "excluded": f"{s['excluded']:,}",
        "countries": str(s["countries"]),
        "programmes": str(s["programmes"]),
        "first_approval_year": str(s["approval_years"][0]),
        "last_approval_year": str(s["approval_years"][1]),
        "dup_random_exact": pct(dups["random"]["exact_share"]),
        "dup_random_near": pct(dups["random"]["near_share"]),
        "dup_grouped_near": pct(dups["grouped"]["near_share"]),
        "dup_temporal_near": pct(dups["temporal"]["near_share"]),
        "random_test_rows": f"{sizes[('random', 'test')]['rows']:,}",
        "temporal_test_met_share": pct(sizes[("temporal", "test")]["met_share"]),
        "temporal_train_met_share": pct(sizes[("temporal", "train")]["met_share"]),
        "contexts_train": f"{ctx['train']['contexts']:,}",
        "contexts_eval": f"{ctx['eval']['contexts']:,}",
        "countries_eval": str(ctx["eval"]["countries"]),
        "pool_duplicates": pool_duplicates_sentence(s.get("pool_duplicates") or []),
        **_pool_variables(s),
    }


def _pool_variables(s: dict[str, Any]) -> dict[str, str]:
    """The disjoint pools' sizes (`data.splits.pool_table`): rows and share of the training
    countries' rows for the reward model (train + val), the audit and the policies."""
    if "pools" not in s:
        raise ArtifactMissing("data/summary.json has no 'pools'; rerun notebook 01")
    p = {r["pool"]: r for r in s["pools"]}
    out = {"policy_contexts": f"{s['policy_contexts']:,}"}
    for name, parts in (("reward", ("reward_train", "reward_val")),
                        ("audit", ("audit_train", "audit_val")), ("policy", ("policy",))):  # fmt: skip
        out[f"pool_{name}_rows"] = f"{sum(p[k]['rows'] for k in parts):,}"
        out[f"pool_{name}_share"] = pct(sum(p[k]["share_of_training_countries"] for k in parts))
        out[f"pool_{name}_arrangements"] = str(sum(p[k]["arrangements"] for k in parts))
    return out


def _manifest_variables(run: RunDir) -> dict[str, Any]:
    m = run.read_json("manifest.json", stage="rlxf run")
    env = m.get("environment", {})
    git = m.get("git", {})
    commit = git.get("commit") or "unknown"
    return {
        "run_name": m.get("run_name", ""),
        "date": (m.get("updated") or "")[:10],
        "commit": commit[:12] + (" (uncommitted changes)" if git.get("dirty") else ""),
        "data_sha256": m["data"]["sha256"],
        "python": env.get("python", ""),
        "platform": env.get("platform", ""),
        "cpu_count": str(env.get("cpu_count", "")),
        "memory_gib": str(env.get("memory_gib", "")),
        "title": m["params"]["run"]["title"],
        "authors": ", ".join(m["params"]["run"]["authors"]),
        "wp_number": m["params"]["run"]["wp_number"],
    }


def _manifest_tables(run: RunDir) -> dict[str, str]:
    m = run.read_json("manifest.json", stage="rlxf run")
    import pandas as pd

    nb = pd.DataFrame(m.get("notebooks", []))
    timings = (
        markdown_table(nb[["name", "status", "started", "seconds"]], floatfmt=".1f")
        if len(nb)
        else "*No notebook has run in this run directory.*\n"
    )
    pk = m["environment"]["packages"]
    versions = markdown_table(
        pd.DataFrame({"package": list(pk), "version": [v or "not installed" for v in pk.values()]})
    )
    params = "```yaml\n" + yaml.safe_dump(m["params"], sort_keys=False, width=88) + "```\n"
    return {"timings.md": timings, "versions.md": versions, "params.md": params}


#: Tables the report includes: generated file -> (run-dir table, stage that writes it).
TABLE_INCLUDES = {
    "status_mapping.md": ("status_mapping", "notebook 01_data_exploration"),
    "table2_sample.md": ("table2_sample", "notebook 01_data_exploration"),
    "split_duplicates.md": ("split_duplicates", "notebook 01_data_exploration"),
    "met_rate_by_arrangement_type.md": (
        "met_rate_by_arrangement_type",
        "notebook 01_data_exploration",
    ),
}


def for_reader(markdown: str) -> str:
    """Markdown as the reader sees it: minus signs (`wording.typeset_minus`) and possessive
    apostrophes (`wording.typeset_apostrophes`). Display names are written where the text is (the
    templates' `name` filter, `wording.name_cells` and `wording.name_table` on a table)."""
    return typeset_apostrophes(typeset_minus(markdown))


def build_sources(run: RunDir, build: Path, src: Path = REPORT_SRC) -> dict[str, Any]:
    """Copy the report source into `build` with `_variables.yml`, `_generated/` and `figures/`."""
    if build.exists():
        shutil.rmtree(build)
    shutil.copytree(
        src,
        build,
        ignore=shutil.ignore_patterns("_build", ".quarto", "*.html", "*.pdf", "templates"),
    )

    variables = {
        "run": _manifest_variables(run),
        "data": {**_data_variables(run), **data_section(run)},
    }
    params = run.read_json("manifest.json", stage="rlxf run")["params"]
    includes: dict[str, str] = {"data_pools.md": pools_table(run),
                                "split_sizes.md": split_sizes_table(run)}  # fmt: skip
    for key, (vals, files) in (
        ("reward", reward_section(run)),
        ("forensic", forensic_section(run, params)),
        ("rl", rl_section(run, params)),
        ("eval", eval_section(run, params.get("evaluation", {}).get("alpha", 0.05))),
        ("overopt", overopt_section(run)),
        ("control", control_section(run)),
        ("offline", offline_section(run)),
        ("findings", findings_section(run)),
        ("seeds", seeds_section(run)),
        ("rlgf", rlgf_section(run, params)),
        ("ilhf", ilhf_section(run, params)),
        ("risk", risk_section(run)),
    ):
        variables[key] = vals
        includes.update(files)
    variables = map_strings(variables, for_reader)
    with atomic_path(build / "_variables.yml") as tmp:
        tmp.write_text(yaml.safe_dump(variables, sort_keys=True, allow_unicode=True))
    qmd = build / QMD
    qmd.write_text(for_reader(qmd.read_text(encoding="utf-8")), encoding="utf-8")
    gen = build / "_generated"
    gen.mkdir(exist_ok=True)
    for name, text in includes.items():
        (gen / name).write_text(for_reader(text), encoding="utf-8")
    for name, (table, stage) in TABLE_INCLUDES.items():
        md = run.require(f"tables/{table}.md", stage).read_text(encoding="utf-8")
        (gen / name).write_text(for_reader(name_table(md)), encoding="utf-8")
    for name, text in _manifest_tables(run).items():
        (gen / name).write_text(for_reader(text), encoding="utf-8")
    copies = {Path(k).stem: t for k, (t, _) in TABLE_INCLUDES.items()}
    sources = sources_table(qmd.read_text(encoding="utf-8"), run, copies, gen)
    (gen / "sources.md").write_text(sources, encoding="utf-8")
    figs = run.root / "figures"
    if figs.is_dir():
        shutil.copytree(figs, build / "figures")
    placeholder_figures(build / "figures", OPTIONAL_FIGURES)
    return variables


#: Figures that a run dir older than their stage's code lacks: figure -> stage that writes it.
#: The report shows a placeholder naming the stage instead of failing on such a run.
OPTIONAL_FIGURES = {
    "eval_reward_perplexity": "notebook 04_evaluation",
    "eval_easy_hard": "notebook 04_evaluation",
    "eval_reward_uncertainty": "notebook 04_evaluation",
    "eval_inclusive": "notebook 04_evaluation",
    "eval_methods": "notebook 04_evaluation",
    "eval_kl_budgets": "notebook 04_evaluation",
    "reward_encoders": "notebook 02_reward_model",
}


def placeholder_figures(folder: Path, figures: dict[str, str]) -> list[str]:
    """Write `<name>.png` for every figure of `figures` that `folder` lacks: a blank panel saying
    which stage writes it. Returns the names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, stage in figures.items():
        target = folder / f"{name}.png"
        if target.exists():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(6, 1.2))
        ax.axis("off")
        ax.text(0.5, 0.5, f"Not in this run directory: rerun {stage} to draw {name}.",
                ha="center", va="center", fontsize=9)  # fmt: skip
        fig.savefig(target, dpi=100)
        plt.close(fig)
        written.append(name)
    return written


def expand_shortcodes(text: str, variables: dict[str, Any], base: Path, depth: int = 0) -> str:
    """Replace Quarto's `var` and `include` shortcodes as Quarto would (pandoc path): an include
    inside an included file resolves from the main file's folder (`base`), as in Quarto."""
    if depth > 5:
        raise ReportError("include nesting deeper than 5 levels")

    def sub(m: re.Match[str]) -> str:
        kind, arg = m.group(1), m.group(2)
        if kind == "include":
            path = base / arg
            if not path.is_file():
                raise ReportError(f"report source includes {arg}, which was not generated ({path})")
            return expand_shortcodes(path.read_text(encoding="utf-8"), variables, base, depth + 1)
        value: Any = variables
        for part in arg.split("."):
            if not isinstance(value, dict) or part not in value:
                raise ReportError(
                    f"report source uses variable '{arg}', which the run does not provide"
                )
            value = value[part]
        return str(value)

    return SHORTCODE.sub(sub, text)


def _pandoc() -> str:
    try:
        import pypandoc

        return pypandoc.get_pandoc_path()
    except (ImportError, OSError) as exc:
        raise ReportError(f"pandoc not available (pip install pypandoc-binary): {exc}") from None


def _run(cmd: list[str], cwd: Path) -> None:
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    for line in res.stderr.splitlines():
        log.warning("%s: %s", Path(cmd[0]).name, line)
    if res.returncode != 0:
        raise ReportError(f"{' '.join(cmd[:2])} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    if "unresolved reference" in res.stderr or re.search(r"citation \S+ not found", res.stderr):
        raise ReportError(f"unresolved cross-reference in the report:\n{res.stderr[-2000:]}")


#: pandoc's markdown without raw HTML and raw blocks: the report places no HTML of its own, so
#: nothing in the text can become an element, fetch a URL or embed a file (`--embed-resources`
#: embeds only the figures the source names).
READER = "markdown-raw_html-raw_attribute"
#: Typst source with pandoc's own quotes and apostrophes as characters: left to Typst's smart
#: quotes (`typst`), "ILHF (history)'s" came out with an opening quote (U+2018) even where
#: pandoc's reader, and so the HTML, had an apostrophe (`for_reader` settles the reader's side)
TYPST_WRITER = "typst-smart"


def _pandoc_args(md: Path) -> list[str]:
    return [
        _pandoc(),
        md.name,
        f"--from={READER}",
        "--number-sections",
        "--toc",
        "--lua-filter=crossref.lua",  # before citeproc, which would take @fig-x for a citation
        "--citeproc",
        "--bibliography=references.bib",
        "--metadata=link-citations:true",
        "--resource-path=.",
    ]


def pandoc_html(md: Path, html: Path) -> Path:
    """`md` (in the report's build folder, beside crossref.lua, references.bib and report.css)
    rendered to a self-contained `html`, written atomically."""
    with atomic_path(html, ".html") as tmp:
        _run(
            [
                *_pandoc_args(md),
                "--to=html5",
                "--standalone",
                "--embed-resources",
                "--mathml",
                "--css=report.css",  # side contents, tables that scroll in their box (reports/)
                f"--output={tmp}",
            ],
            md.parent,
        )
    return html


def pandoc_typst(md: Path) -> Path:
    """`md` rendered to Typst source beside it (`rlxf_report.typ` for `rlxf_report.md`)."""
    typ = md.with_suffix(".typ")
    _run(
        [
            *_pandoc_args(md),
            f"--to={TYPST_WRITER}",
            "--standalone",
            "--include-in-header=typst-header.typ",
            "--variable=papersize:a4",
            f"--output={typ.name}",
        ],
        md.parent,
    )
    return typ


def _render_pandoc(build: Path, variables: dict[str, Any], out_dir: Path) -> RenderResult:
    text = (build / QMD).read_text(encoding="utf-8")
    md = build / "rlxf_report.md"
    md.write_text(expand_shortcodes(text, variables, build), encoding="utf-8")
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    html = pandoc_html(md, out_dir / "rlxf_report.html")
    seconds["html"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    typ = pandoc_typst(md)
    import typst

    pdf = out_dir / "rlxf_report.pdf"
    try:
        with atomic_path(pdf, ".pdf") as tmp:
            typst.compile(str(typ), output=str(tmp), root=str(build))
    except typst.TypstError as exc:
        raise ReportError(f"typst failed on {typ}: {exc.message} {exc.hints}") from None
    seconds["pdf"] = time.perf_counter() - t0
    return RenderResult(html, pdf, "pandoc+typst", seconds)


def _render_quarto(quarto: str, build: Path, out_dir: Path) -> RenderResult:
    t0 = time.perf_counter()
    _run([quarto, "render", QMD, "--to", "html,typst"], build)
    html, pdf = out_dir / "rlxf_report.html", out_dir / "rlxf_report.pdf"
    shutil.copyfile(build / "rlxf_report.html", html)
    shutil.copyfile(build / "rlxf_report.pdf", pdf)
    return RenderResult(html, pdf, "quarto", {"total": time.perf_counter() - t0})


def render_report(
    run_dir: str | Path,
    engine: str = "auto",
    src: Path = REPORT_SRC,
    which: Callable[[str], str | None] = shutil.which,
) -> RenderResult:
    """Render `<run_dir>/report/rlxf_report.{html,pdf}`; `engine` is auto, quarto or pandoc."""
    _check_finished(run_dir)  # before anything is written there
    quarto = which("quarto") if engine in ("auto", "quarto") else None
    if engine == "quarto" and not quarto:
        raise ReportError("engine 'quarto' requested but quarto is not on PATH")
    run = RunDir(run_dir)
    out_dir = run.root / "report"
    build = out_dir / "_build"
    made = not out_dir.exists()
    try:
        variables = build_sources(run, build, src)
    except Exception:  # a missing artifact: leave no half-built sources behind
        shutil.rmtree(out_dir if made else build, ignore_errors=True)
        raise
    if quarto:
        log.info("rendering with Quarto (%s)", quarto)
        result = _render_quarto(quarto, build, out_dir)
    else:
        log.info("Quarto not on PATH: rendering with pandoc (HTML) and pandoc + typst (PDF)")
        result = _render_pandoc(build, variables, out_dir)
    run.write_json("report/render.json", {"engine": result.engine, "seconds": result.seconds})
    return result


def _check_finished(run_dir: str | Path) -> None:
    """`run_dir` is a run whose every recorded notebook finished, or a `NotARun` naming the
    manifest and the notebook that did not."""
    manifest = read_manifest(run_dir)
    unfinished = [n for n in manifest["notebooks"] if n.get("status") != "ok"]
    if unfinished or not manifest["notebooks"]:
        what = (f"notebook {unfinished[0].get('name')} is {unfinished[0].get('status')!r}"
                if unfinished else "no notebook has run")  # fmt: skip
        raise NotARun(
            f"{Path(run_dir) / 'manifest.json'}: {what}; expected a finished run: rerun "
            "`rlxf run` with the same parameters and --run-dir to finish it"
        )


def load_variables(run_dir: str | Path) -> dict[str, Any]:
    """The variables of the last render (tests compare them with the artifacts)."""
    return yaml.safe_load((Path(run_dir) / "report/_build/_variables.yml").read_text())


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2)
