"""A further training seed of the shared smoke study (tests/smoke.py). A file of its own, which
the suite's second worker reaches after the other files (tests/conftest.py): it waits there for
the study the first worker builds, then trains beside that worker's other smoke tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from smoke import copy_run


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

    run_dir = copy_run(smoke_run, tmp_path / "smoke")
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
