"""GRPO and RLOO through TRL on a tiny model; shared log schema and adapter layout; contexts."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from test_ppo import dense_reward, small_cfg, tiny_tokenizer, toy_contexts, toy_reward
from tiny import tiny_llama

from rlxf_utils.config import LoraSettings, PolicyConfig
from rlxf_utils.data.contexts import load_contexts
from rlxf_utils.models.generation import autocast, postprocess_response
from rlxf_utils.rl import trl_runs
from rlxf_utils.rl.core import LOG_COLUMNS, prompt_schedule
from rlxf_utils.rl.stage import run_algorithm
from rlxf_utils.rl.tables import summary_table, training_curves_figure
from rlxf_utils.rl.trainer import TrainJob
from rlxf_utils.rl.trl_runs import run_trl, trl_reward_function

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny_base():
    tok = tiny_tokenizer()
    return tiny_llama(tok, 0), tok


@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_trl_one_step(tmp_path, algo):
    model, tok = _tiny_base()
    prompts, contexts = toy_contexts(8)
    rl = small_cfg(steps=1, batch_size=4, num_generations=2, minibatch_size=4)
    policy = PolicyConfig(lora=LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    # a reward that differs within a prompt's group, so the group baseline leaves an advantage
    log = run_trl(TrainJob(algo, model, tok, prompts, contexts, dense_reward, rl, policy,
                           tmp_path / algo, progress=False))  # fmt: skip
    assert list(log.columns) == list(LOG_COLUMNS)
    assert len(log) == 1 and log.algo.iloc[0] == algo
    assert np.isfinite(log.reward_mean.iloc[0]) and np.isfinite(log.kl_per_token.iloc[0])
    assert (tmp_path / algo / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / algo / "train_log.parquet").is_file()
    assert (tmp_path / algo / "samples.jsonl").is_file()
    # the step learned: LoRA's B matrices start at zero and the update moved them
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / algo / "adapter" / "adapter_model.safetensors"))
    b = [w for k, w in weights.items() if "lora_B" in k]
    assert b and any(w.abs().max() > 0 for w in b)


@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_trl_reads_the_ppo_prompt_schedule(tmp_path, algo):
    """TRL answers the prompts PPO would, at the same step, each num_generations times."""
    model, tok = _tiny_base()
    prompts, contexts = toy_contexts(6)
    rl = small_cfg(steps=2, batch_size=4, num_generations=2, minibatch_size=4, update_epochs=2)
    policy = PolicyConfig(lora=LoraSettings(rank=2, alpha=4, target_modules=["q_proj"]))
    calls = []

    def reward(ctx, texts):
        calls.append([c["country"] for c in ctx])
        return toy_reward(ctx, texts)

    log = run_trl(TrainJob(algo, model, tok, prompts, contexts, reward, rl, policy,
                           tmp_path / algo, seed=4, progress=False))  # fmt: skip
    sched = prompt_schedule(len(prompts), rl.steps, rl.prompts_per_step, seed=4)
    want = [[contexts[i]["country"] for i in s for _ in range(rl.num_generations)] for s in sched]
    assert calls[: rl.steps] == want  # (then run_trl's after-training samples)
    assert list(log.step) == [1, 2]
    settings = json.loads((tmp_path / algo / "settings.json").read_text())
    assert settings["prompts_per_step"] == 2 and settings["responses_per_prompt"] == 2
    assert settings["optimizer_steps_per_batch"] == rl.optimizer_steps_per_batch == 2


def test_trl_reward_wrapper_passes_context_and_postprocess():
    seen = {}

    def fn(contexts, texts):
        seen["c"], seen["t"] = contexts, texts
        return np.array([0.25] * len(texts))

    wrapped = trl_reward_function(fn, "strip_boilerplate")
    out = wrapped(
        prompts=["p"], completions=["Assistant: raise VAT<|im_end|>"], country=["Kenya"],
        arrangement_type=["ECF"], econ_descriptor=["1.1 Tax"], trainer_state=None,
    )  # fmt: skip
    assert out == [0.25]
    assert seen["t"] == ["raise VAT"]
    assert seen["c"] == [
        {"country": "Kenya", "arrangement_type": "ECF", "econ_descriptor": "1.1 Tax"}
    ]


def test_postprocess_modes():
    assert (
        postprocess_response("  <|im_start|>assistant: Cut spending. ", "strip_boilerplate")
        == "Cut spending."
    )
    assert postprocess_response(" x ", "none") == " x "
    with pytest.raises(ValueError, match="response_postprocess"):
        postprocess_response("x", "bogus")


def test_load_contexts_train_only(tmp_path):
    df = pd.DataFrame(
        {
            "country": ["A", "B", "C"], "arrangement_type": ["SBA"] * 3,
            "econ_descriptor": ["1.1 Fiscal"] * 3, "econ_area": ["fiscal"] * 3,
            "n": [3, 4, 5], "n_met": [1, 2, 3], "met_rate": [0.3, 0.5, 0.6],
            "split": ["train", "eval", "train"],
        }
    )  # fmt: skip
    (tmp_path / "data").mkdir()
    df.to_parquet(tmp_path / "data" / "contexts.parquet")
    ctx = load_contexts(tmp_path)
    assert [c["country"] for c in ctx] == ["A", "C"]
    assert all(c["split"] == "train" for c in ctx)
    # with the policy pool's counts: only the training contexts the pool has rows of
    df.assign(policy_rows=[0, 5, 2]).to_parquet(tmp_path / "data" / "contexts.parquet")
    assert [c["country"] for c in load_contexts(tmp_path)] == ["C"]
    assert [c["country"] for c in load_contexts(tmp_path, "eval")] == ["B"]


def test_profiles_use_the_papers_template():
    from rlxf_utils.config import PROJECT_ROOT, RLConfig, load_config
    from rlxf_utils.prompts import PAPER_PROMPT_TEMPLATE

    assert RLConfig().prompt_template == PAPER_PROMPT_TEMPLATE
    for name in ("smoke", "default", "paper"):
        cfg = load_config(PROJECT_ROOT / "params" / f"{name}.yaml")
        assert cfg.rl.prompt_template == PAPER_PROMPT_TEMPLATE
        assert cfg.rl.algorithm


def test_summary_table_reads_the_critic_from_an_interval() -> None:
    def logs(ev: list[float]) -> pd.DataFrame:
        n = len(ev)
        return pd.DataFrame({"algo": "ppo", "step": range(1, n + 1), "reward_mean": 0.5, "kl": 1.0,
                             "entropy": 2.0, "explained_variance": ev, "kl_coef": 0.05,
                             "step_time_s": 1.0, "tokens_per_s": 10.0})  # fmt: skip

    clear = summary_table(logs([-1.0] * 6 + [0.30, 0.32, 0.31]), alpha=0.05).iloc[0]
    assert clear["explained_variance_last_third"] == pytest.approx(0.31)
    assert 0 < clear["explained_variance_low"] < 0.31 < clear["explained_variance_high"]
    noisy = summary_table(logs([0.0] * 6 + [0.5, -0.4, 0.3]), alpha=0.05).iloc[0]
    assert noisy["explained_variance_last_third"] > 0 > noisy["explained_variance_low"]
    assert np.isnan(noisy["explained_variance_prior_last_third"])  # logs without a prior
    prior = logs([0.5] * 9).assign(explained_variance_prior=[0.9] * 6 + [0.4, 0.5, 0.6])
    assert summary_table(prior).iloc[0]["explained_variance_prior_last_third"] == pytest.approx(0.5)


def test_summary_table_counts_the_steps_beta_sat_at_each_bound() -> None:
    """β's trace in the table: first, last, range reached, and steps at the adaptive controller's
    floor and ceiling (issue 78: the report says how long each arm sat at a bound)."""
    trace = [0.05, 0.05, 0.075, 0.1125, 100.0, 100.0, 100.0, 0.05 * 1.5**0.5]
    logs = pd.DataFrame({"algo": "grpo", "step": range(1, 9), "reward_mean": 0.5, "kl": 1.0,
                         "entropy": 2.0, "explained_variance": np.nan, "kl_coef": trace,
                         "step_time_s": 1.0, "tokens_per_s": 10.0})  # fmt: skip
    row = summary_table(logs, beta_range=(0.05, 100.0)).iloc[0]
    assert (row["beta_steps_at_floor"], row["beta_steps_at_ceiling"]) == (2, 3)
    assert (row["beta_min"], row["beta_max"], row["beta_last"]) == (0.05, 100.0, trace[-1])
    fixed = summary_table(logs).iloc[0]  # no controller's range: no bound to sit at
    assert np.isnan(fixed["beta_steps_at_floor"]) and np.isnan(fixed["beta_steps_at_ceiling"])


def test_a_finished_algorithm_is_reused_only_while_its_inputs_are_unchanged(tmp_path, monkeypatch):
    """policy/<algo>/complete.json holds the settings and the hashes of the data, the reward and
    the start policy: a retrained reward (or new data, or another SFT) retrains the algorithm."""
    from pathlib import Path

    from rlxf_utils.config import load_config

    cfg = load_config(Path(__file__).resolve().parent.parent / "params/smoke.yaml")
    run_dir = tmp_path / "run"
    for rel, text in (("data/contexts.parquet", "c"), ("reward_model/bundle.json", "{}"),
                      ("policy/sft/adapter/adapter_model.safetensors", "w")):  # fmt: skip
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text(text)
    calls = []

    def fake_ppo(job):
        calls.append(len(job.prompts))
        out = job.output_dir
        frame = pd.DataFrame({"algo": ["ppo"], "step": [1], "reward_mean": [0.5]})
        out.mkdir(parents=True, exist_ok=True)
        frame.to_parquet(out / "train_log.parquet")
        (out / "settings.json").write_text('{"update_epochs": 2}')
        return frame

    monkeypatch.setattr("rlxf_utils.rl.stage.load_start_policy", lambda *a, **k: (None, None))
    monkeypatch.setattr(
        "rlxf_utils.rl.stage.build_prompts", lambda contexts, *a, **k: [str(c) for c in contexts]
    )
    monkeypatch.setattr("rlxf_utils.rl.ppo.run_ppo", fake_ppo)  # the registry's trainer
    contexts = [{"country": "KENYA", "arrangement_type": "SBA", "econ_descriptor": "1.1",
                 "split": "train"}] * 3  # fmt: skip

    def run() -> None:
        run_algorithm("ppo", cfg, run_dir, toy_reward, contexts=contexts, progress=False)

    run()
    run()
    assert len(calls) == 1  # finished with the same settings and inputs: reused
    # what it trained on: its step's contexts, num_generations responses each (rl.experience)
    used = json.loads((run_dir / "policy/ppo/experience.json").read_text())
    assert used["sequences"] == cfg.rl.batch_size and used["passes"] == 2
    assert used["optimizer_steps"] == 0 and "resumed" not in used  # the fake steps no optimiser
    marker = json.loads((run_dir / "policy/ppo/complete.json").read_text())
    assert marker["inputs"]["reward_model/bundle.json"] and marker["inputs"]["data"]
    ckpt = run_dir / "policy/ppo/checkpoints/step_000001"
    ckpt.mkdir(parents=True)
    (run_dir / "policy/ppo/complete.json").unlink()  # as if interrupted after a checkpoint
    run()
    assert len(calls) == 2 and ckpt.is_dir()  # same run: its checkpoint is kept for the resume
    (run_dir / "policy/ppo/snapshots/step_000001").mkdir(parents=True)
    (run_dir / "policy/ppo/pool.parquet").write_text("RFT's candidates, scored by the old reward")
    (run_dir / "reward_model/bundle.json").write_text('{"retrained": true}')
    run()
    assert len(calls) == 3  # the reward changed: retrained
    assert not ckpt.exists() and not (run_dir / "policy/ppo/snapshots").exists()  # nothing stale
    assert not (run_dir / "policy/ppo/pool.parquet").exists()
    (run_dir / "policy/sft/adapter/adapter_model.safetensors").write_text("other sft")
    run()
    run()
    assert len(calls) == 4  # the start policy changed: retrained once, then reused


def test_the_kernel_computes_the_marker_once_and_reads_what_the_worker_wrote(tmp_path, monkeypatch):
    """Notebook 03 (issue 42): per algorithm, the kernel computes the marker once, starts the
    worker only when `complete.json` does not record it, then reads the worker's log (no second
    `run_algorithm`); a worker that ends without writing the marker is an error naming the file."""
    from pathlib import Path

    from rlxf_utils.artifacts import RunDir
    from rlxf_utils.config import load_config
    from rlxf_utils.rl import launch, stage

    cfg = load_config(Path(__file__).resolve().parent.parent / "params/smoke.yaml")
    run = RunDir(tmp_path / "run")
    markers, launched = [], []
    monkeypatch.setattr(stage, "algorithm_marker",
                        lambda algo, *a, **k: markers.append(algo) or {"algo": algo, "v": 1})  # fmt: skip
    monkeypatch.setattr(stage, "run_algorithm", lambda *a, **k: pytest.fail("trained twice"))

    def worker(cfg, params_file, run_dir, stage_name, algo, writes=True, **_):
        launched.append(algo)
        out = Path(run_dir) / "policy" / algo
        out.mkdir(parents=True, exist_ok=True)
        pd.DataFrame({"algo": [algo], "step": [1]}).to_parquet(out / "train_log.parquet")
        if writes:
            (out / "complete.json").write_text(json.dumps({"algo": algo, "v": 1}))

    monkeypatch.setattr(launch, "run_stage", worker)
    go = lambda: stage.train_or_read("ppo", cfg, "p.yaml", run, toy_reward, [{}])  # noqa: E731
    assert go()["algo"].tolist() == ["ppo"]
    assert (markers, launched) == (["ppo"], ["ppo"])
    assert go()["step"].tolist() == [1]  # up to date: read, not launched again
    assert (markers, launched) == (["ppo", "ppo"], ["ppo"])
    (run.path("policy/ppo/complete.json")).write_text(json.dumps({"algo": "ppo", "v": 0}))
    monkeypatch.setattr(launch, "run_stage", lambda *a, **k: worker(*a, **k, writes=False))
    with pytest.raises(RuntimeError, match="ppo: its training process ended without writing .*complete.json"):  # fmt: skip
        go()
    # `compute.processes: kernel`: trained in this process, with the marker computed here
    kernel = cfg.model_copy(
        update={"compute": cfg.compute.model_copy(update={"processes": "kernel"})}
    )
    monkeypatch.setattr(stage, "run_algorithm", lambda *a, marker, **k: pd.DataFrame([marker]))
    assert stage.train_or_read("grpo", kernel, "p.yaml", run, toy_reward, [{}])["algo"].tolist() == ["grpo"]  # fmt: skip


@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_trl_resumes_an_interrupted_run_where_it_stopped(tmp_path, algo):
    """Killed during its second batch, GRPO/RLOO resume from the Trainer checkpoint of the first
    (adapter, optimiser, RNG, data position, log rows) and end where an uninterrupted run ends."""
    from safetensors.torch import load_file

    prompts, contexts = toy_contexts(6)
    rl_cfg = small_cfg(
        steps=2, batch_size=4, num_generations=2, minibatch_size=4, checkpoint_every=1
    )
    policy = PolicyConfig(lora=LoraSettings(rank=2, alpha=4, target_modules=["q_proj"]))

    def go(out, reward):
        model, tok = _tiny_base()
        return run_trl(TrainJob(algo, model, tok, prompts, contexts, reward, rl_cfg, policy, out,
                                seed=3, progress=False))  # fmt: skip

    counted = []

    def counting(ctx, texts):
        counted.append(1)
        return toy_reward(ctx, texts)

    whole = go(tmp_path / "whole", counting)
    assert len(counted) == 3  # two batches, then run_trl's after-training samples
    calls = []

    def dies_in_batch_two(ctx, texts):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return toy_reward(ctx, texts)

    with pytest.raises(KeyboardInterrupt):
        go(tmp_path / "cut", dies_in_batch_two)
    assert list((tmp_path / "cut" / "trl").glob("checkpoint-*/rlxf_history.json"))
    counted.clear()
    resumed = go(tmp_path / "cut", counting)
    assert len(counted) == 2  # only batch two was generated again: it resumed, not restarted
    assert list(resumed.step) == [1, 2]
    pd.testing.assert_series_equal(resumed.reward_mean, whole.reward_mean)
    a = load_file(str(tmp_path / "whole" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "adapter" / "adapter_model.safetensors"))
    for k in a:
        np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), atol=1e-6, err_msg=k)


def test_training_curves_show_the_critic_prior_beside_the_critic():
    """The critic panel draws each PPO-family critic's EV and, dashed in its colour, the
    reward-model prior's EV alone; an algorithm without a critic (GRPO) draws neither."""
    import matplotlib.pyplot as plt

    steps = [1, 2, 3]
    logs = pd.concat([
        pd.DataFrame({"algo": "ppo", "step": steps, "reward_mean": 0.5, "kl": 0.1, "kl_coef": 0.05,
                      "explained_variance": [0.2, 0.4, 0.5], "explained_variance_prior": [0.1, 0.3, 0.5]}),
        pd.DataFrame({"algo": "grpo", "step": steps, "reward_mean": 0.5, "kl": 0.1, "kl_coef": 0.05,
                      "explained_variance": np.nan, "explained_variance_prior": np.nan}),
    ])  # fmt: skip
    fig = training_curves_figure(logs)
    critic = fig.axes[2]
    lines = {ln.get_label(): ln for ln in critic.get_lines() if not ln.get_label().startswith("_")}
    assert sorted(lines) == ["PPO", "PPO: prior alone"]
    assert lines["PPO: prior alone"].get_linestyle() == "--"
    assert lines["PPO: prior alone"].get_color() == lines["PPO"].get_color()
    assert list(lines["PPO: prior alone"].get_ydata()) == [0.1, 0.3, 0.5]
    plt.close(fig)


def test_trl_fused_head_scores_only_labelled_positions_on_the_cpu(monkeypatch):
    """TRL's fused LM head on the CPU, made to score only the labelled positions, gives their
    log-probabilities and the parameters' gradients as the full layout does (up to float32
    summation order), zeros elsewhere; the patch is idempotent, leaves other devices to TRL, and
    is skipped, with False, when TRL's module lacks the switch."""
    import trl.trainer.utils as trl_utils

    original = getattr(trl_utils._use_triton, "__wrapped__", trl_utils._use_triton)
    monkeypatch.setattr(trl_utils, "_use_triton", original)
    tok = tiny_tokenizer()
    model = tiny_llama(tok, init=0.5)
    trl_utils.add_fused_lm_head(model)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 5, 6, 7, 8]])
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt
    labels[1, :4] = -100  # padding and a prompt

    def run():
        model.zero_grad()
        with autocast("bfloat16", "cpu"):
            out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.log_probs.detach().float(), grads

    full, full_grads = run()
    assert not trl_utils._use_triton(torch.device("cpu"))
    assert trl_runs.score_labelled_positions_only() and trl_runs.score_labelled_positions_only()
    assert trl_utils._use_triton(torch.device("cpu"))
    assert trl_utils._use_triton.__wrapped__ is original  # not wrapped twice
    assert trl_utils._use_triton(torch.device("meta")) == original(torch.device("meta"))
    compact, compact_grads = run()
    labelled = labels[:, 1:] != -100
    assert (full[labelled] != 0).all() and (compact[~labelled] == 0).all()
    torch.testing.assert_close(compact, full, rtol=0, atol=1e-5)
    assert compact_grads.keys() == full_grads.keys()
    for name, grad in compact_grads.items():
        torch.testing.assert_close(grad, full_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    monkeypatch.delattr(trl_utils, "_use_triton")
    assert not trl_runs.score_labelled_positions_only()


def test_training_reward_is_the_learners_own_in_the_curves_the_table_and_the_sentence() -> None:
    """D²LOLS: AggreVaTeD steps (the guide finishes every response: no learner-only reward), then
    PPO++ steps where the guide-written prefixes score high. The curves, the summary and the
    report's sentence read the learner's own responses (`reward_learner`), not the mixed mean."""
    import matplotlib.pyplot as plt

    from rlxf_utils.report.rl import moves_context

    n = 8
    own = [np.nan] * 4 + [0.30, 0.32, 0.40, 0.44]
    d2 = pd.DataFrame({"algo": "d2lols", "step": range(1, n + 1), "reward_mean": [0.9] * n,
                       "reward_learner": own, "kl": 1.0, "entropy": 2.0,
                       "explained_variance": 0.1, "kl_coef": 0.05, "step_time_s": 1.0,
                       "tokens_per_s": 10.0, "kl_estimator": "k1"})  # fmt: skip
    row = summary_table(d2, window=2).iloc[0]
    assert row["reward_first"] == pytest.approx(0.31) and row["reward_last"] == pytest.approx(0.42)
    assert row["reward_first_step"] == 5
    (said,) = moves_context(summary_table(d2, window=2).set_index("algorithm"))["moved"]
    assert said["first"] == pytest.approx(0.31) and said["last"] == pytest.approx(0.42)
    assert said["first_step"] == 5  # the sentence says from which step
    fig = training_curves_figure(d2)
    (line,) = fig.axes[0].get_lines()
    np.testing.assert_array_equal(line.get_ydata(), np.array(own))
    plt.close(fig)
    ppo = d2.assign(algo="ppo", reward_learner=0.5)  # every response the learner's own
    assert summary_table(ppo).iloc[0]["reward_first_step"] == 1
    (said,) = moves_context(summary_table(ppo).set_index("algorithm"))["moved"]
    assert said["first_step"] == 1


def test_the_settings_table_writes_a_group_of_settings_as_words(tmp_path):
    """Notebook 03's settings side by side: the optimiser's settings read 'eps 1e-05, weight
    decay 0, ...', not a Python dict (the report printed "{'eps': 1e-05, ...}")."""
    from rlxf_utils.artifacts import RunDir
    from rlxf_utils.rl.tables import settings_table

    run = RunDir(tmp_path)
    for algo in ("ppo", "grpo"):
        run.write_json(f"policy/{algo}/settings.json", {
            "algo": algo, "learning_rate": 0.001, "temperature": None,
            "optimizer": {"eps": 1e-05, "weight_decay": 0.0, "lr_schedule": "constant"}})  # fmt: skip
    table = settings_table(tmp_path, ["ppo", "grpo"]).set_index("setting")
    assert list(table.columns) == ["PPO", "GRPO"]
    assert table.loc["optimizer", "PPO"] == "eps 1e-05, weight decay 0, lr schedule constant"
    assert (table.loc["learning_rate", "GRPO"], table.loc["temperature", "GRPO"]) == ("0.001", "·")
