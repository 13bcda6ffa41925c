"""The README's results, from one finished run: `rlxf publish --run-dir RUN --readme`.

`write_readme_results(run_dir, root)` writes into `<root>/docs/results/`:

    eval_methods.png   the run's figure of every method's gain (`figures/eval_methods.png`)
    eval_methods.md    its table of methods, in the report's own format (`tables.yaml`'s
                       `eval_methods` over `tables/eval_methods.csv`), columns this run left
                       empty dropped
    run.json           the stamp: commit, dirty flag, date, profile and machine as the run
                       recorded them, and the settings the caption quotes

and replaces the README's section between `BEGIN` and `END` with `readme_section(stamp, table)`,
a pure function of those two files, so `tests/test_docs.py` can check that the README shows what
`docs/results/` holds and that the stamped commit is in the history. A run made from
uncommitted changes, one without a commit, or one not finished (a notebook not `ok`, or no
rendered report) is refused with the file and the field that say so.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlxf_utils.artifacts import RunDir, read_manifest, write_text
from rlxf_utils.names import CELL_SEPARATOR
from rlxf_utils.report.evaluation import family_level
from rlxf_utils.report.wording import display_name, table

__all__ = [
    "BEGIN",
    "END",
    "FIGURE",
    "RESULTS",
    "STAMP",
    "TABLE",
    "ReadmeError",
    "ReadmeResults",
    "readme_section",
    "replace_section",
    "run_stamp",
    "write_readme_results",
]

#: Where the results go, relative to the project's root.
RESULTS = "docs/results"
FIGURE = "eval_methods.png"
TABLE = "eval_methods.md"
STAMP = "run.json"
#: The README's generated section lies between these two lines.
BEGIN = "<!-- results: written by `rlxf publish --run-dir RUN --readme`; not edited by hand -->"
END = "<!-- end of results -->"
#: A cell that says nothing (the report's mark for a value this run does not have).
_EMPTY = frozenset(("", "·"))
_STAGE = "notebook 04_evaluation"


class ReadmeError(ValueError):
    """The run cannot stand as the README's results; the message names the file and field."""


def _machine(env: dict[str, Any]) -> str:
    """What the run recorded about its machine (a run before the manifest named its CPU says so)."""
    if not env:
        return "not recorded"
    bf16 = {True: "native bf16", False: "no native bf16 (fp32)"}.get(env.get("native_bf16"))
    cpus = f"{env['cpu_count']} CPUs" if env.get("cpu_count") else None
    gpus = ", ".join(env.get("gpus") or []) or ("no GPU" if env.get("cuda") is False else None)
    memory = f"{env['memory_gib']} GiB memory" if env.get("memory_gib") else None
    bits = [env.get("cpu") or env.get("machine"), cpus, bf16, memory, gpus]
    said = ", ".join(str(b) for b in bits if b)
    if said and not env.get("cpu"):
        said += " (CPU model not recorded)"
    return said or "not recorded"


def _ran_elsewhere(entry: dict[str, Any], commit: str) -> bool:
    """A manifest entry of a notebook that ran at another commit than the run's, or that was
    reused from an earlier run whose commit the entry does not record."""
    ran_at = entry.get("commit")
    return ran_at != commit if ran_at else entry.get("how") == "reused"


def run_stamp(run_dir: str | Path) -> dict[str, Any]:
    """The stamp of a finished run made from committed code, or `ReadmeError` saying why not."""
    root = Path(run_dir)
    manifest = read_manifest(root)  # NotARun when it is no run
    where = root / "manifest.json"
    git = manifest.get("git") or {}
    commit = git.get("commit")
    if not commit or commit == "unknown":
        raise ReadmeError(f"{where}: git.commit is missing: the run does not say what code made it")
    if git.get("dirty") is not False:
        said = "true" if git.get("dirty") else "missing"
        raise ReadmeError(f"{where}: git.dirty is {said}: rerun the study from committed code")
    unfinished = [n.get("name", "?") for n in manifest.get("notebooks", []) if n.get("status") != "ok"]  # fmt: skip
    if unfinished or not manifest.get("notebooks"):
        raise ReadmeError(
            f"{where}: notebooks: not finished ({', '.join(unfinished) or 'none ran'})"
        )
    report = root / "report/rlxf_report.html"
    if not report.is_file():
        raise ReadmeError(
            f"{report} is missing: the run is unfinished (rlxf report --run-dir {root})"
        )
    params = manifest.get("params", {})
    summary = RunDir(root).read_json("eval/summary.json", stage=_STAGE)
    source = Path(manifest.get("params_source") or manifest.get("params_file") or "")
    profile = (
        f"{source.parent.name}/{source.name}" if source.parent.name == "params" else source.name
    )
    return {
        "run": manifest.get("run_name") or params.get("run", {}).get("name", ""),
        "profile": profile or "not recorded",
        "commit": commit,
        "dirty": False,
        "date": manifest.get("updated", ""),
        "machine": _machine(manifest.get("environment") or {}),
        "max_rows": params.get("data", {}).get("max_rows"),
        "rl_steps": params.get("rl", {}).get("steps"),
        "prompts": summary.get("n_prompts"),
        "samples": summary.get("samples_per_prompt"),
        "start": display_name(summary.get("start_policy", "sft")),
        "level": family_level(RunDir(root).read_table("eval_paired", _STAGE)),
        "figure": f"figures/{FIGURE}",
        "table": "tables/eval_methods.csv",
        "earlier": [
            {"name": n.get("name", "?"), "commit": n.get("commit")}
            for n in manifest.get("notebooks", [])
            if _ran_elsewhere(n, commit)
        ],  # fmt: skip
    }


def _drop_empty_columns(md: str) -> str:
    """A pipe table without the columns whose every cell says nothing."""
    rows = [[c.strip() for c in CELL_SEPARATOR.split(line.strip())[1:-1]]
            for line in md.strip().splitlines()]  # fmt: skip
    keep = [i for i in range(len(rows[0])) if any(r[i] not in _EMPTY for r in rows[2:])]
    return "\n".join("| " + " | ".join(r[i] for i in keep) + " |" for r in rows) + "\n"


def methods_table(run_dir: str | Path) -> str:
    """The run's table of methods as the report writes it (`tables.yaml`'s `eval_methods`)."""
    run = RunDir(run_dir)
    start = run.read_json("eval/summary.json", stage=_STAGE).get("start_policy", "sft")
    return _drop_empty_columns(table("eval_methods", run.read_table("eval_methods", _STAGE), start=start))  # fmt: skip


def _commit_said(commit: str | None) -> str:
    if not commit:
        return "commit not recorded"
    dirty = commit.endswith("-dirty")
    return f"commit {commit[:7]}" + (" with uncommitted changes" if dirty else "")


def readme_section(stamp: dict[str, Any], methods: str) -> str:
    """The README's results section (between the markers) from the stamp and the table."""
    rows = f"at most {stamp['max_rows']} MONA rows" if stamp["max_rows"] else "all of MONA"
    setting = (f"{rows}, {stamp['rl_steps']} RL steps per algorithm, {stamp['prompts']} held-out "
               f"prompts × {stamp['samples']} samples")  # fmt: skip
    name = Path(stamp["profile"]).stem
    if name == "default":
        caveat = f"The default profile's run (`{stamp['profile']}`: {setting})."
    elif name == "smoke":
        caveat = (
            f"**These are the smoke profile's numbers, not findings** (`{stamp['profile']}`: "
            f"{setting}): a check that every stage runs end to end. A default run published with "
            "the same command replaces them."
        )
    else:
        caveat = (f"**These are the {name} profile's numbers, not the default study's** "
                  f"(`{stamp['profile']}`: {setting}).")  # fmt: skip
    earlier = ""
    if stamp.get("earlier"):
        said = [f"{e['name']} ({_commit_said(e['commit'])})" for e in stamp["earlier"]]
        earlier = (f" Reused from an earlier run and not rerun at that commit: {', '.join(said)}"
                   " (the run's `manifest.json`).")  # fmt: skip
    return "\n".join([
        caveat,
        "",
        f"Run `{stamp['run']}`, commit `{stamp['commit'][:7]}` (no uncommitted changes), "
        f"{stamp['date'][:10]}; machine: {stamp['machine']}.{earlier} Written by "
        f"`rlxf publish --readme` from the run's `{stamp['figure']}` and `{stamp['table']}`; "
        f"the stamp: [{RESULTS}/{STAMP}]({RESULTS}/{STAMP}).",
        "",
        f"![Every method's gain over {stamp['start']} under the reward model and the audit]"
        f"({RESULTS}/{FIGURE})",
        "",
        methods.strip(),
        "",
        f"Gain over the start policy ({stamp['start']}) in P(MET) on held-out prompts, under the "
        "reward model the methods were tuned against and under the audit model none of them saw, "
        f"with {stamp['level']} simultaneous cluster t intervals over countries (the family's "
        "level); KL to the start policy in nats. The report's table of methods explains every "
        "column, and its Key findings read these intervals.",
    ])  # fmt: skip


def replace_section(readme: str, section: str) -> str:
    """`readme` with the text between `BEGIN` and `END` replaced by `section`."""
    head, begin, rest = readme.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ReadmeError(f"README.md: no results section (the lines {BEGIN!r} and {END!r})")
    return f"{head}{BEGIN}\n{section.strip()}\n{END}{tail}"


@dataclass(frozen=True)
class ReadmeResults:
    stamp: dict[str, Any]
    files: tuple[Path, ...]


def write_readme_results(run_dir: str | Path, root: str | Path) -> ReadmeResults:
    """Write `run_dir`'s figure, table of methods and stamp into `<root>/docs/results/` and its
    results section into `<root>/README.md`; nothing is written for a run that is refused."""
    stamp = run_stamp(run_dir)
    methods = methods_table(run_dir)
    figure = Path(run_dir) / stamp["figure"]
    if not figure.is_file():
        raise ReadmeError(f"{figure} is missing: notebook 04 writes it (rlxf run --only 04)")
    readme = Path(root) / "README.md"
    if not readme.is_file():
        raise ReadmeError(f"{readme} is missing: --readme writes into the project's checkout")
    text = replace_section(readme.read_text(encoding="utf-8"), readme_section(stamp, methods))
    out = Path(root) / RESULTS
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(figure, out / FIGURE)
    write_text(out / TABLE, methods)
    write_text(out / STAMP, json.dumps(stamp, indent=2, ensure_ascii=False) + "\n")
    write_text(readme, text)
    return ReadmeResults(stamp, (out / FIGURE, out / TABLE, out / STAMP, readme))
