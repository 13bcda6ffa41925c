"""Further training seeds of a finished run: what a seed reuses, its parameters, the across-seed
table and its report section."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from rlxf_utils.artifacts import RunDir
from rlxf_utils.config import PROJECT_ROOT, load_config
from rlxf_utils.pipeline import freeze_params
from rlxf_utils.report.seeds import _by_verdict, seed_finding, seeds_section
from rlxf_utils.seeds import plot_seeds, prepare_seed, seed_dir, seed_table, write_seed_table


def _run(tmp_path):
    cfg = load_config(PROJECT_ROOT / "params/smoke.yaml")
    run = RunDir(tmp_path / "run")
    freeze_params(cfg, run)
    return cfg, run


def _summary(run: RunDir, algos, gains, start="sft"):
    rows = [{"policy": start, "gain": math.nan, "audit_gain": math.nan, "kl": 0.0, "finished": 0.9}]
    for a, g in zip(algos, gains, strict=True):
        rows.append({"policy": a, "gain": g, "gain_low": g - 0.01, "gain_high": g + 0.01,
                     "audit_gain": g / 2, "audit_gain_low": g / 2 - 0.01,
                     "audit_gain_high": g / 2 + 0.01, "kl": 1.0, "finished": 0.8})  # fmt: skip
    run.write_json("eval/summary.json", {"algorithms": list(algos), "start_policy": start,
                                         "alpha": 0.05, "summary": rows})  # fmt: skip


def test_a_seed_reuses_the_runs_files_and_changes_only_the_training_seed(tmp_path):
    cfg, run = _run(tmp_path)
    run.write_text("data/contexts.parquet", "contexts")
    run.write_text("reward_model/bundle.json", "{}")
    run.write_text("policy/sft/adapter/adapter_model.safetensors", "w")
    run.write_text("policy/ppo/adapter/adapter_model.safetensors", "trained with the run's seed")
    params = prepare_seed(run.root, 7)
    seed_cfg = load_config(params)
    assert seed_cfg.rl.seed == 7 and seed_cfg.run.seed == cfg.run.seed
    assert seed_cfg.run.name == f"{cfg.run.name}-seed7"
    assert seed_cfg.model_dump(exclude={"rl", "run"}) == cfg.model_dump(exclude={"rl", "run"})
    out = seed_dir(run.root, 7)
    for rel in ("data/contexts.parquet", "reward_model/bundle.json",
                "policy/sft/adapter/adapter_model.safetensors"):  # fmt: skip
        assert (out / rel).samefile(run.path(rel)), rel  # a hard link, nothing copied
    assert not (out / "policy/ppo").exists()  # what the seed retrains is not carried over
    with pytest.raises(ValueError, match="the run's own training seed"):
        prepare_seed(run.root, cfg.run.seed)


def test_a_seed_needs_a_finished_run(tmp_path):
    _, run = _run(tmp_path)
    with pytest.raises(ValueError, match="finish notebooks 01-03"):
        prepare_seed(run.root, 3)


def test_seed_table_pools_seeds_with_their_spread(tmp_path):
    cfg, run = _run(tmp_path)
    _summary(run, ["ppo", "grpo"], [0.02, 0.05])
    assert write_seed_table(run.root).loc[lambda t: t.seed == "pooled", "seeds"].max() == 1
    assert not run.exists("tables/eval_seeds.csv")  # one seed: nothing to compare
    for s, gains in ((11, [0.021, 0.00]), (3, [0.019, 0.10])):
        d = RunDir(seed_dir(run.root, s))
        _summary(d, ["ppo", "grpo"], gains)
    table = seed_table(run.root)
    per = table[table.seed != "pooled"]
    assert sorted(per.seed.unique()) == sorted(["11", "3", str(cfg.run.seed)])
    grpo = table[(table.seed == "pooled") & (table.algorithm == "grpo")].iloc[0]
    assert grpo["seeds"] == 3 and grpo["gain"] == pytest.approx(0.05)
    assert grpo["gain_seed_sd"] == pytest.approx(np.std([0.05, 0.0, 0.1], ddof=1))
    assert grpo["gain_low"] < 0 < grpo["gain_high"]  # three seeds this far apart: not shown
    # the one multiplicity rule: one family per measure, 2 algorithms, each at 1 - 0.05 / 2
    assert grpo["ci_level"] == pytest.approx(0.975)
    half = stats.t.ppf(1 - 0.025 / 2, 2) * grpo["gain_seed_sd"] / np.sqrt(3)
    assert grpo["gain_high"] - grpo["gain"] == pytest.approx(half)
    ppo = table[(table.seed == "pooled") & (table.algorithm == "ppo")].iloc[0]
    assert ppo["gain"] == pytest.approx(0.02) and ppo["gain_low"] > 0  # close seeds: shown
    fig = plot_seeds(table, "sft")
    low, high = fig.axes[0].get_ylim()  # the axis follows the seeds' own intervals...
    assert high >= per["gain_high"].max() and low <= min(per["gain_low"].min(), 0.0)
    assert high < grpo["gain_high"] and low > grpo["gain_low"]  # ...not a t interval over 3 seeds
    write_seed_table(run.root)
    assert run.exists("tables/eval_seeds.csv") and run.exists("figures/eval_seeds.png")
    variables, files = seeds_section(run)
    assert variables["seeds"] == "3"
    sentence = variables["sentence"]
    reward, audit = sentence.split("; under the audit model, ")
    assert "under the reward model, PPO (mean gain +0.020 [" in reward
    assert reward.endswith("raised it, while GRPO did not distinguishably move it")
    assert audit.startswith("PPO (mean gain +0.010 [") and audit.endswith(
        "GRPO did not distinguishably move it"
    )
    flat = table[table.seed == "pooled"].assign(gain_low=-1.0)  # every interval covers zero
    assert _by_verdict(flat, "gain") == "none of the 2 algorithms distinguishably moved it"
    assert "97.5% simultaneous t intervals" in variables["sentence"]
    assert "| PPO" in files["eval_seeds.md"]
    assert "](figures/eval_seeds.png){#fig-seeds" in files["eval_seeds_figure.md"]
    assert "97.5% simultaneous t interval" in files["eval_seeds_figure.md"]
    ppo_rows = [
        row.split("|") for row in files["eval_seeds.md"].splitlines() if row.startswith("| PPO |")
    ]
    assert [r[2].strip() for r in ppo_rows] == [
        "3",
        "11",
        str(cfg.run.seed),
        "pooled",
    ]  # numeric order
    labels = [row.split("|")[1].strip() for row in files["eval_seeds.md"].splitlines()[2:]]
    assert labels == ["PPO"] * 4 + ["GRPO"] * 4  # the study's order, not the alphabet's
    assert seed_finding(run) is None  # no level for the seeds' own intervals: no finding

    # with the evaluation's family level, each seed's own interval is counted too
    pd.DataFrame({"measure": ["reward"], "ci_level": [0.99]}).to_csv(
        run.path("tables/eval_paired.csv"), index=False
    )
    sentence = seeds_section(run)[0]["sentence"]
    assert sentence.endswith(
        "Seed by seed, each with its own evaluation's 99% simultaneous interval, the gain under "
        "the reward model lay above zero at all 3 seeds for PPO; at 2 seeds for GRPO. Under the "
        "audit model it did at 2 seeds for GRPO; at 1 seed for PPO"
    )  # GRPO's 0.00 +- 0.01 covers zero; PPO's audit intervals are 0.0105, 0.0100, 0.0095 +- 0.01
    assert seed_finding(run) == (
        "Over 3 training seeds, each evaluated with its own 99% simultaneous intervals, the gain "
        "under the reward model lay above zero at every seed for PPO, and under the audit model "
        "for no algorithm; the mean gain over seeds (97.5% simultaneous t intervals) was "
        "distinguishable from zero under the reward model for PPO and under the audit model for PPO"
    )


def test_report_says_how_to_add_seeds_when_there_are_none(tmp_path):
    _, run = _run(tmp_path)
    _summary(run, ["ppo"], [0.01])
    variables, files = seeds_section(run)
    assert "rlxf seeds" in variables["sentence"] and variables["seeds"] == "1"
    assert "rlxf seeds" in files["eval_seeds.md"]
    assert files["eval_seeds_figure.md"] == ""  # no figure without further seeds
