"""Notebooks are committed clean, and the runner executes them with papermill (smoke profile)."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import nbformat
import pytest

from rlxf_utils.compare import compare_runs
from rlxf_utils.pipeline import NotebookFailed, discover_notebooks, run_study
from rlxf_utils.report.wording import ci, typeset_minus

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_committed_clean_with_parameters_cell(nb_path: Path) -> None:
    nb = nbformat.read(nb_path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "outputs committed"
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    names = {line.split("=")[0].strip() for line in params[0].source.splitlines() if "=" in line}
    assert names == {"params_file", "run_dir"}
    assert nb.metadata["kernelspec"]["name"] == "rlxf"


def test_discover_in_number_order_and_only() -> None:
    names = [p.name for p in discover_notebooks()]
    assert names == sorted(names) and names[0] == "01_data_exploration.ipynb"
    assert [p.name for p in discover_notebooks(only=["1"])] == ["01_data_exploration.ipynb"]
    with pytest.raises(ValueError, match="99"):
        discover_notebooks(only=["99"])


def _tiny_notebook(path: Path, body: str) -> None:
    nb = nbformat.v4.new_notebook()
    p = nbformat.v4.new_code_cell('params_file = ""\nrun_dir = ""')
    p.metadata["tags"] = ["parameters"]
    nb.cells = [p, nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "rlxf", "display_name": "rlxf", "language": "python"}
    nbformat.write(nb, path)


@pytest.mark.slow
def test_runner_reports_the_failing_cell(tmp_path: Path) -> None:
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    _tiny_notebook(
        nbdir / "01_ok.ipynb",
        "from pathlib import Path\nPath(run_dir, 'ran.txt').write_text(params_file)",
    )
    _tiny_notebook(nbdir / "02_bad.ipynb", "raise ValueError('boom in cell')")
    _tiny_notebook(nbdir / "03_never.ipynb", "x = 2")
    run_dir = tmp_path / "run"
    with pytest.raises(NotebookFailed) as ei:
        run_study(ROOT / "params/smoke.yaml", run_dir, notebook_dir=nbdir, progress=False)
    msg = str(ei.value)
    assert "02_bad.ipynb" in msg and "ValueError: boom in cell" in msg and "raise ValueError" in msg
    assert (run_dir / "ran.txt").read_text() == str(run_dir / "params.yaml")  # the frozen copy
    manifest = json.loads((run_dir / "manifest.json").read_text())
    status = {n["name"]: n["status"] for n in manifest["notebooks"]}
    assert status == {"01_ok": "ok", "02_bad": "failed"}


def _declare(path: Path, **rlxf: list[str]) -> None:
    nb = nbformat.read(path, as_version=4)
    nb.metadata["rlxf"] = rlxf
    nbformat.write(nb, path)


@pytest.mark.slow
def test_runner_skips_what_is_up_to_date_and_reruns_what_changed(tmp_path: Path) -> None:
    """Fingerprints: nothing changed -> skipped; a param, an output, a failure or --force/--from
    rerun exactly that notebook and every later one; the manifest says which were reused."""
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    _tiny_notebook(
        nbdir / "01_make.ipynb",
        "from pathlib import Path\nfrom rlxf_utils.config import load_config\n"
        "Path(run_dir, 'a').mkdir(exist_ok=True)\n"
        "Path(run_dir, 'a', 'x.txt').write_text(str(load_config(params_file).run.seed))\n"
        "log = Path(run_dir, 'log.txt'); log.write_text(log.read_text() + '01 ' if log.exists() else '01 ')",
    )
    _declare(nbdir / "01_make.ipynb", params=["run.seed"], inputs=[], outputs=["a"])
    _tiny_notebook(
        nbdir / "02_use.ipynb",
        "import os\nfrom pathlib import Path\nfrom rlxf_utils.config import load_config\n"
        "assert not Path(run_dir, 'fail').exists(), 'failing on purpose'\n"
        "Path(run_dir, 'b').mkdir(exist_ok=True)\n"
        "x = Path(run_dir, 'a', 'x.txt').read_text()\n"
        "Path(run_dir, 'b', 'y.txt').write_text(x + str(load_config(params_file).rl.steps))\n"
        "log = Path(run_dir, 'log.txt'); log.write_text(log.read_text() + '02 ')",
    )
    _declare(nbdir / "02_use.ipynb", params=["rl.steps"], inputs=["a"], outputs=["b"])
    _tiny_notebook(  # no metadata: reads every parameter
        nbdir / "03_last.ipynb",
        "from pathlib import Path\nlog = Path(run_dir, 'log.txt'); log.write_text(log.read_text() + '03 ')",
    )
    (tmp_path / "params").mkdir()
    (tmp_path / "data").symlink_to(ROOT / "data")  # the profile's relative paths still resolve
    params = tmp_path / "params" / "p.yaml"
    params.write_text(f"extends: {ROOT / 'params/smoke.yaml'}\nrun: {{name: t}}\n")
    run_dir = tmp_path / "run"
    log = run_dir / "log.txt"

    def run(**kw) -> list[str]:
        before = log.read_text() if log.exists() else ""
        run_study(params, run_dir, notebook_dir=nbdir, progress=False, **kw)
        return log.read_text()[len(before) :].split()

    assert run() == ["01", "02", "03"]
    assert run() == []  # nothing changed: every notebook reused
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert {n["name"]: n["how"] for n in manifest["notebooks"]} == dict.fromkeys(
        ["01_make", "02_use", "03_last"], "reused"
    )
    assert all(n["reused_from"] for n in manifest["notebooks"])
    # a parameter only 02 (and 03, which reads everything) depends on
    params.write_text(params.read_text() + "rl: {steps: 3}\n")
    assert run() == ["02", "03"]
    assert (run_dir / "b" / "y.txt").read_text().endswith("3")
    # an output edited by hand is not up to date
    (run_dir / "b" / "y.txt").write_text("tampered")
    assert run() == ["02", "03"]
    # a notebook that fails leaves no completion record; the rerun resumes there
    (run_dir / "a" / "x.txt").write_text("changed input")  # 01's output: 01 reruns first
    (run_dir / "fail").write_text("")
    with pytest.raises(NotebookFailed, match="failing on purpose"):
        run()
    assert not (run_dir / ".rlxf/stages/02_use.json").exists()
    (run_dir / "fail").unlink()
    assert run() == ["02", "03"]
    assert run(from_="03") == ["03"] and run(force=True) == ["01", "02", "03"]
    with pytest.raises(ValueError, match="--from 7"):
        run(from_="7")


@pytest.mark.slow
def test_smoke_study_notebook_01(tmp_path: Path) -> None:
    run_dir = run_study(ROOT / "params/smoke.yaml", tmp_path / "smoke", only=["01"], progress=False)
    m = json.loads((run_dir / "manifest.json").read_text())
    assert m["data"]["sha256"] == "df8a2a242868460ebf302904c19b7fa6be95a9249cbc140972d56476d0c20a2a"
    assert m["params"]["run"]["name"] == "smoke"
    assert m["environment"]["packages"]["torch"].startswith("2.13.0")
    assert (
        m["notebooks"][0]["name"] == "01_data_exploration" and m["notebooks"][0]["status"] == "ok"
    )
    assert m["notebooks"][0]["seconds"] > 0 and m["git"].keys() == {"commit", "dirty"}
    for rel in [
        "data/conditions.parquet",
        "data/splits.json",
        "data/contexts.parquet",
        "figures/met_rate_by_year.png",
        "tables/status_mapping.csv",
        "tables/table2_sample.md",
        "notebooks/01_data_exploration.ipynb",
    ]:
        assert (run_dir / rel).is_file(), rel
    summary = json.loads((run_dir / "data/summary.json").read_text())
    assert (
        summary["rows_used"] <= 600 and summary["labelled"] == summary["met"] + summary["non_met"]
    )
    executed = nbformat.read(run_dir / "notebooks/01_data_exploration.ipynb", as_version=4)
    assert not any(
        o.get("output_type") == "error" for c in executed.cells for o in c.get("outputs", [])
    )


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole smoke study, run once, uninterrupted (shared by the tests below)."""
    return run_study(
        ROOT / "params/smoke.yaml", tmp_path_factory.mktemp("smoke") / "smoke", progress=False
    )


@pytest.mark.slow
def test_smoke_study_renders_the_report(smoke_run: Path) -> None:
    """The smoke run's report: both files, figures embedded, no holes, numbers equal the artifacts."""

    import pandas as pd
    import pypdf

    from rlxf_utils.report.render import load_variables, render_report

    run_dir = smoke_run
    # run again with nothing changed: every notebook is up to date (no notebook rewrites an
    # earlier one's declared outputs), and the report below reads the same artifacts
    run_study(ROOT / "params/smoke.yaml", run_dir, progress=False)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert [n["how"] for n in manifest["notebooks"]] == ["reused"] * 5, manifest["notebooks"]
    # notebook 05 rerun on the same inputs writes the same tables, byte for byte
    risk_tables = {f.name: f.read_bytes() for f in (run_dir / "tables").glob("risk_*.csv")}
    run_study(ROOT / "params/smoke.yaml", run_dir, progress=False, from_="05")
    assert {f.name: f.read_bytes() for f in (run_dir / "tables").glob("risk_*.csv")} == risk_tables
    res = render_report(run_dir, engine="pandoc")
    assert res.engine == "pandoc+typst"
    html = res.html.read_text(encoding="utf-8")
    n_figures = html.count('src="data:image/png;base64,')
    referenced = len(
        re.findall(r"!\[[^\]]*\]\(figures/", (ROOT / "reports/rlxf_report.qmd").read_text())
    )
    assert n_figures == referenced > 0
    for hole in ("{{<", "??", "citation not found", "<strong>fig-", "@tbl-", "@fig-", "@sec-"):
        assert hole not in html, hole
    summary = json.loads((run_dir / "data/summary.json").read_text())
    variables = load_variables(run_dir)
    assert variables["data"]["labelled"] == f"{summary['labelled']:,}"
    assert variables["data"]["met_share"] == f"{100 * summary['met_share']:.1f}%"
    assert f"{summary['labelled']:,} labelled conditions" in html
    text = " ".join(p.extract_text() for p in pypdf.PdfReader(res.pdf).pages)
    text = " ".join(text.split())
    for heading in (
        "Key findings",
        "Introduction",
        "Data: the experience in MONA",
        "The reward model",
        "Fine-tuning the policy with experience feedback",
        "Results: does experience feedback align the policy?",
        "Risks, measured",
        "Conclusion",
        "Reproducibility",
        "References",
    ):
        assert heading in text, heading
    assert f"{summary['met']:,} MET and {summary['non_met']:,} Non-MET" in text
    assert "Table 1" in text and "Figure 1" in text and "Equation 2" in text

    # the reward-metrics table, with the numbers of reward/metrics.json
    metrics = json.loads((run_dir / "reward/metrics.json").read_text())["metrics"]
    enc = next(m for m in metrics if m["protocol"] == "grouped" and m["model"] == "encoder")
    tfidf = next(m for m in metrics if m["protocol"] == "random" and m["model"] == "tfidf")
    assert "fine-tuned encoder" in text and "TF-IDF + LR" in text
    assert f"{enc['accuracy']:.3f} {enc['precision']:.3f} {enc['recall']:.3f}" in text
    assert f"{tfidf['roc_auc']:.3f}" in text
    assert variables["reward"]["main_accuracy"] == f"{100 * enc['accuracy']:.1f}%"
    # evaluation: Ave(R) of base and its CI as in eval/summary.json, sentence chosen by the test
    ev = {
        r["policy"]: r for r in json.loads((run_dir / "eval/summary.json").read_text())["summary"]
    }
    base = ev["base"]
    assert f"{base['ave_r']:.3f} [{base['ave_r_low']:.3f}, {base['ave_r_high']:.3f}]" in text
    # verdict sentences: the report prints the one its section computed from the run's tests
    # (the rules themselves are unit-tested with injected verdicts, e.g. test_reward.py)
    ppo_sentence = next(
        x for x in variables["eval"]["algo_sentences"].split("; ") if x.startswith("PPO ")
    )
    assert ppo_sentence.split(" Ave(R)")[0] in {
        "PPO raised",
        "PPO lowered",
        "PPO did not significantly change",
    }
    assert ppo_sentence.split(" on the held-out")[0] in text
    for key in ("calibration_verdict", "within_context_auc"):
        assert variables["reward"][key] in text, key
    assert variables["data"]["trend_sentence"].split(" (")[0] in text
    alpha = json.loads((run_dir / "manifest.json").read_text())["params"]["evaluation"]["alpha"]
    assert variables["reward"]["level"] == variables["data"]["level"] == f"{1 - alpha:.0%}"
    # risks: the country-swap headline equals risk/summary.json
    risk = json.loads((run_dir / "risk/summary.json").read_text())
    hist = next(r for r in risk["country_swap"]["by_source"] if r["source"] == "historical")
    assert variables["risk"]["swap_mean_abs_delta"] == f"{hist['mean_abs_delta']:.4f}"
    assert f"by {hist['mean_abs_delta']:.4f} on average" in text

    # the abstract states the findings with the run's numbers (issue 33)
    after_title = html.split('class="abstract-title">Abstract</div>')[1].split("</div>")[0]
    abstract = " ".join(__import__("html").unescape(re.sub(r"<[^>]+>", " ", after_title)).split())
    main = next(m for m in metrics if m["protocol"] == "grouped" and m["model"] == "encoder")
    auc = f"{main['roc_auc']:.3f} [{main['roc_auc_low']:.3f}, {main['roc_auc_high']:.3f}]"
    assert auc in abstract, abstract
    chance = main["roc_auc_low"] <= 0.5 <= main["roc_auc_high"]
    assert ("not distinguishable from chance" in abstract) == chance
    methods = pd.read_csv(run_dir / "tables/eval_methods.csv")
    bon = methods[methods["group"] == "best-of-N"].iloc[0]
    bon_gain = ci(bon["gain"], bon["gain_low"], bon["gain_high"], signed=True)
    assert typeset_minus(f"gains {bon_gain}") in abstract
    for _, r in methods[methods["group"].isin(["RL", "ILHF"])].iterrows():
        # as the reader sees it: true minus signs (the format itself is tested in test_findings)
        gain = ci(r["gain"], r["gain_low"], r["gain_high"], signed=True)
        named = typeset_minus(f"{r['method']} ({gain})")
        assert (named in abstract) == (r["gain_low"] > 0 or r["gain_high"] < 0), named
        if r["gain_high"] < 0:  # a method that lowered the reward is said to have lowered it
            assert re.search(re.escape(named) + r"[^;]* lowered it", abstract), named
    # about 200 words, the JEL codes and keywords after it not counted
    words = abstract.split("JEL codes:")[0].split()
    assert len(words) <= 220, len(words)
    # display names: no internal id reaches the reader (the quoted parameters file aside)
    from rlxf_utils.names import DISPLAY_NAMES, ENGLISH_WORDS

    shown = re.sub(r"<(pre|script|style)\b.*?</\1>", " ", html, flags=re.S)
    shown = __import__("html").unescape(re.sub(r"<[^>]+>", " ", shown))
    leaks = [n for n in DISPLAY_NAMES if n not in ENGLISH_WORDS
             and re.search(rf"(?<![\w/.-]){re.escape(n)}(?![\w/-])", shown)]  # fmt: skip
    assert not leaks, leaks

    # like for like: every algorithm started from sft, saved snapshots and its settings, and
    # took the same prompts, responses and optimiser steps per batch
    algos = json.loads((run_dir / "manifest.json").read_text())["params"]["rl"]["algorithm"]
    assert {"ppo", "grpo", "rloo", "d2lols"} <= set(algos)  # the smoke profile runs RLGF too
    assert {"ilhf_history", "ilhf_online"} <= set(algos)  # and both ILHF variants
    # ILHF from history learns from historical pairs, not from sampled prompts: its own regime
    offline = ("kto", "dpo", "rft")
    assert set(offline) <= set(algos)  # and the three offline methods
    sampled = [a for a in algos if a != "ilhf_history" and a not in offline]
    settings = [json.loads((run_dir / f"policy/{a}/settings.json").read_text()) for a in sampled]
    shared = ("prompts_per_step", "responses_per_prompt", "optimizer_steps_per_batch", "steps")
    assert all(s_[k] == settings[0][k] for s_ in settings for k in shared)
    # the offline methods: RL's optimiser steps, of RL's minibatch, on as many sequences as RL
    # trains on
    rl_cfg = json.loads((run_dir / "manifest.json").read_text())["params"]["rl"]
    for algo in offline:
        st = json.loads((run_dir / f"policy/{algo}/settings.json").read_text())
        assert st["optimizer_steps"] == rl_cfg["steps"] * settings[0]["optimizer_steps_per_batch"]
        assert st["minibatch_size"] == rl_cfg["minibatch_size"]
        assert st["training_sequences"] == rl_cfg["steps"] * rl_cfg["batch_size"]
    for algo in algos:
        if algo.startswith("ilhf"):  # an ensemble of particles, evaluated by Thompson sampling
            marker = json.loads((run_dir / f"policy/{algo}/adapter/ensemble.json").read_text())
            assert len(marker["particles"]) >= 2
            continue
        assert list((run_dir / f"policy/{algo}/snapshots").glob("step_*/adapter_model.safetensors"))
    pairs = __import__("pandas").read_parquet(run_dir / "policy/ilhf_history/pairs.parquet")
    assert len(pairs) and set(pairs["p_a"]) <= {0.0, 0.5, 1.0}
    # D²LOLS ran both schemes (AggreVaTeD first) and kept the guide's critic
    d2 = __import__("pandas").read_parquet(run_dir / "policy/d2lols/train_log.parquet")
    assert d2["scheme"].tolist()[0] == "aggrevated" and d2["scheme"].tolist()[-1] == "ppo_pp"
    assert (run_dir / "policy/d2lols/guide_value_head.safetensors").is_file()
    assert (run_dir / "policy/sft/adapter/adapter_model.safetensors").is_file()
    meta = json.loads((run_dir / "eval/summary.json").read_text())
    assert meta["start_policy"] == "sft"
    assert {r["policy"] for r in meta["vs_best_of_n"]} == set(algos)
    frontier = __import__("pandas").read_parquet(run_dir / "eval/frontier.parquet")
    assert set(frontier["algo"]) >= {"sft", "best_of_n", *algos}
    # the RLGF section's tables were written and the report says which algorithm was guided
    for t in ("eval_rlgf", "eval_guidance", "eval_easy_hard"):
        assert (run_dir / f"tables/{t}.csv").is_file(), t
    assert "D²LOLS" in text
    assert sorted(frontier.loc[frontier["algo"] == "best_of_n", "step"]) == [1, 2, 4]


def _copy_run(src: Path, dst: Path) -> Path:
    """A copy of a finished run whose weights are hard links (the run writes weights to a new
    file and renames it) and whose other files are copies: papermill's notebooks, the lock,
    the manifest and the report are rewritten in place, which through a link would change the
    smoke run itself (and hide a difference from `compare_runs`)."""
    import os
    import shutil

    def copy(a: str, b: str) -> None:
        (os.link if a.endswith((".safetensors", ".pt", ".bin")) else shutil.copy2)(a, b)

    shutil.copytree(src, dst, copy_function=copy)
    return dst


@pytest.mark.slow
def test_a_killed_study_resumes_to_the_same_artifacts(smoke_run: Path, tmp_path: Path) -> None:
    """Kill notebook 03 (runner, kernel and the training process) in the middle of PPO, rerun it:
    the finished algorithms are reused, PPO resumes from its checkpoint, and every artifact
    equals the uninterrupted run's (timings aside; `rlxf_utils.compare`). The killed run starts
    from a hard-linked copy of the smoke run without PPO and DPO, so only notebook 03 reruns: the
    same resume path as a killed whole study (01 and 02 reused), for a tenth of its minutes.
    The smoke profile trains in two side-by-side lanes (`compute.parallel_stages`): in the
    rerun PPO and DPO train beside each other, in the smoke run DPO trained in PPO's lane after
    ILHF-online: the same artifacts, so nothing one algorithm leaves in a warm process, and
    nothing a lane beside it does, reaches the next."""
    import os
    import shutil
    import subprocess
    import sys
    import time

    import psutil

    run_dir = _copy_run(smoke_run, tmp_path / "killed")
    shutil.rmtree(run_dir / "policy/ppo")
    shutil.rmtree(run_dir / "policy/dpo")
    cmd = [sys.executable, "-m", "rlxf_utils.cli", "run", "--params",
           str(ROOT / "params/smoke.yaml"), "--run-dir", str(run_dir), "--only", "03"]  # fmt: skip
    log = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=os.environ)
    deadline = time.monotonic() + 1200
    while not list(run_dir.glob("policy/ppo/checkpoints/step_*")):
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "PPO never wrote a checkpoint"
        time.sleep(0.2)
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:  # as a pre-empted job dies: everything at once
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(tree, timeout=60)
    log.close()
    assert not (run_dir / "policy/ppo/complete.json").exists()

    run_study(ROOT / "params/smoke.yaml", run_dir, only=["03"], progress=False)
    launch = (run_dir / "policy/ppo/launch.log").read_text()
    assert "resumed ppo from" in launch, launch[-3000:]
    for algo in ("ppo_mle", "grpo", "kto"):  # finished before the kill: reused, not retrained
        assert (run_dir / f"policy/{algo}/adapter/adapter_model.safetensors").samefile(
            smoke_run / f"policy/{algo}/adapter/adapter_model.safetensors"
        ), algo
    result = compare_runs(smoke_run, run_dir)
    assert result.same, {s: result.paths(s) for s in ("differs", "missing", "extra")}
    for algo in ("ppo", "dpo"):
        assert any(p.startswith(f"policy/{algo}/") for p in result.paths("identical")), algo


@pytest.mark.slow
def test_a_further_seed_of_the_smoke_run(smoke_run: Path, tmp_path: Path) -> None:
    """`rlxf seeds --algorithms ppo` on a copy of the smoke run: one further training seed trains
    PPO again on the run's reward model and SFT policies, which it does not retrain, evaluates
    it on the same prompts with its own sampling seed (the `sft` samples stay shared, for
    pairing), and the run gets the across-seed table of the algorithms with two seeds; the
    report includes it."""

    import pandas as pd

    from rlxf_utils.cli import main
    from rlxf_utils.report.render import load_variables, render_report

    run_dir = _copy_run(smoke_run, tmp_path / "smoke")
    args = ["seeds", "--run-dir", str(run_dir), "--seeds", "11", "--algorithms", "ppo", "--quiet"]
    assert main(args) == 0
    seed = run_dir / "seeds" / "seed_11"
    for rel in ("reward_model/bundle.json", "policy/sft/adapter/adapter_model.safetensors"):
        assert (seed / rel).samefile(run_dir / rel), rel  # reused, not retrained
    a = pd.read_parquet(run_dir / "policy/ppo/train_log.parquet")
    b = pd.read_parquet(seed / "policy/ppo/train_log.parquet")
    assert not a["reward_mean"].equals(b["reward_mean"])  # another training seed
    same = ["prompt_id", "sample_id"]
    sa = pd.read_parquet(run_dir / "eval/samples.parquet")
    sb = pd.read_parquet(seed / "eval/samples.parquet")
    base_a, base_b = (s[s.policy == "sft"][[*same, "response"]] for s in (sa, sb))
    assert base_a.reset_index(drop=True).equals(
        base_b.reset_index(drop=True)
    )  # same prompts, seeds
    ppo_a, ppo_b = (s[s.policy == "ppo"].reset_index(drop=True) for s in (sa, sb))
    assert ppo_a[same].equals(ppo_b[same]) and not ppo_a["response"].equals(ppo_b["response"])
    # the draws that do not depend on the training seed are read back from the run's, not drawn
    import json

    reused = json.loads((seed / "eval/summary.json").read_text(encoding="utf-8"))["reused_draws"]
    assert {"samples base", "samples sft", "samples sft_met", "best-of-N pool"} <= set(reused)
    kept = {f"{part} {p}" for part in ("table 3", "held-out perplexity") for p in ("base", "sft")}
    assert kept <= set(reused)  # ... and so are the passes of the policies it did not train
    assert not {"samples ppo", "table 3 ppo", "held-out perplexity ppo"} & set(reused)
    run_draws = json.loads((run_dir / "eval/summary.json").read_text(encoding="utf-8"))
    assert run_draws["reused_draws"] == []  # the run drew its own
    assert not (seed / "policy/grpo").exists()  # only the algorithms asked for
    table = pd.read_csv(run_dir / "tables/eval_seeds.csv")
    pooled = table[table["seed"] == "pooled"]
    assert set(pooled["algorithm"]) == {"ppo"} and (pooled["seeds"] == 2).all()
    assert pooled["gain_low"].notna().all() and (pooled["gain_low"] <= pooled["gain_high"]).all()
    render_report(run_dir, engine="pandoc")
    assert load_variables(run_dir)["seeds"]["seeds"] == "2"


@pytest.mark.slow
def test_the_smoke_review_bundle_in_a_browser(smoke_run: Path, tmp_path: Path) -> None:
    """The smoke run's review bundle (`rlxf publish`): every table and figure of the paper links
    to the notebook cell that wrote it and to its data, and every page, opened from disk and
    from a static server in headless Chromium, fires no dialog, fetches nothing from outside,
    loads every image, lands every link and anchor and contents link, logs no console error."""
    from test_publish_browser import need_browser, static_server

    from rlxf_utils.report.publish import publish_bundle
    from rlxf_utils.report.publish_check import browser_problems
    from rlxf_utils.report.render import render_report

    if not (smoke_run / "report/rlxf_report.html").is_file():
        render_report(smoke_run, engine="pandoc")
    bundle = publish_bundle(smoke_run, tmp_path / "review")
    assert not bundle.unlinked, bundle.unlinked
    notebooks = {s.written_by for s in bundle.sources if s.written_by.startswith("notebook")}
    assert notebooks >= {"notebook 01", "notebook 02", "notebook 03", "notebook 04"}, notebooks
    by_notebook = [s for s in bundle.sources if s.written_by.startswith("notebook")]
    assert all(s.notebook for s in by_notebook)  # every one links its notebook's page
    with_cell = [s for s in by_notebook if s.cell]  # ... and nearly every one the cell
    assert len(with_cell) >= 0.9 * len(by_notebook), [s.item for s in by_notebook if not s.cell]
    for s in bundle.sources:
        if s.artifact.startswith("tables/"):
            assert ("CSV", s.artifact) in s.data, s
    assert {p for p in bundle.pages if p.startswith("notebooks/")} == {
        f"notebooks/{nb.stem}.html" for nb in (smoke_run / "notebooks").glob("*.ipynb")
    }
    need_browser()
    assert browser_problems(bundle.root) == []
    with static_server(bundle.root) as url:
        assert browser_problems(bundle.root, base_url=url) == []


@pytest.mark.slow
def test_the_smoke_report_pdf_reads_whole(smoke_run: Path) -> None:
    """The PDF as a reader reads it: no table wider than its page (no word past the right
    margin, none over its neighbour) and every "Table N" and "Figure N" of the text captioned."""
    import shutil

    from rlxf_utils.report.publish_check import pdf_problems
    from rlxf_utils.report.render import render_report

    if shutil.which("pdftotext") is None:
        pytest.skip("pdftotext not found (Debian: apt-get install poppler-utils, as .ci/run does)")
    if not (smoke_run / "report/rlxf_report.pdf").is_file():
        render_report(smoke_run, engine="pandoc")
    assert pdf_problems(smoke_run / "report/rlxf_report.pdf") == []
