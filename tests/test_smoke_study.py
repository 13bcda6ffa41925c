"""The smoke study end to end (`params/smoke.yaml`, the real embedded models): its report, a
killed run resumed, its review bundle in a browser and its PDF. The study is built once per
`pytest` run and shared (tests/smoke.py); tests/test_smoke_seeds.py reads it too."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest
from smoke import ROOT, copy_run

from rlxf_utils.compare import compare_runs
from rlxf_utils.pipeline import run_study
from rlxf_utils.report.wording import ci, typeset_minus


@pytest.mark.slow
def test_smoke_study_renders_the_report(smoke_run: Path, tmp_path: Path) -> None:
    """The smoke run's report: both files, figures embedded, no holes, numbers equal the artifacts.
    On a copy of the shared run, which its reruns below rewrite (manifest, notebook 05, report)."""

    import pandas as pd
    import pypdf

    from rlxf_utils.report.render import load_variables, render_report

    run_dir = copy_run(smoke_run, tmp_path / "smoke")
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
    # history's descriptions follow generated text's cut rule, and the finished share is a
    # family of its own beside every gain (issue 78)
    from rlxf_utils.config import load_config

    cap = load_config(ROOT / "params/smoke.yaml").eval_max_new_tokens
    samples = pd.read_parquet(run_dir / "eval/samples.parquet")
    hist = samples[samples["policy"].isin(["history_met", "history_nonmet", "random_policy"])]
    assert len(hist) and hist["finished"].notna().all()
    assert (hist["finished"].astype(bool) == (hist["n_tokens"] <= cap)).all()
    assert (hist.loc[~hist["finished"].astype(bool), "reward"] == 0).all()
    assert all(f"finished_gain_{k}" in ev["ppo"] for k in ("low", "high", "verdict"))
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

    run_dir = copy_run(smoke_run, tmp_path / "killed")
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
def test_the_smoke_review_bundle_in_a_browser(smoke_run: Path, tmp_path: Path) -> None:
    """The smoke run's review bundle (`rlxf publish`): every table and figure of the paper links
    to the notebook cell that wrote it and to its data, and every page, opened from disk and
    from a static server in headless Chromium, fires no dialog, fetches nothing from outside,
    loads every image, lands every link and anchor and contents link, logs no console error."""
    from test_publish_browser import need_browser, static_server

    from rlxf_utils.report.publish import publish_bundle
    from rlxf_utils.report.publish_check import browser_problems

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

    if shutil.which("pdftotext") is None:
        pytest.skip("pdftotext not found (Debian: apt-get install poppler-utils, as .ci/run does)")
    assert pdf_problems(smoke_run / "report/rlxf_report.pdf") == []
