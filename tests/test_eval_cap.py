"""Evaluation's own token cap (`evaluation.max_new_tokens`) and the rule for responses still cut
at it (`evaluation.cut_responses`), fixed before any result is read."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from rlxf_utils.config import ConfigError, load_config
from rlxf_utils.evaluation.sampling import add_rewards, apply_cut_rule
from rlxf_utils.models.generation import sampling_kwargs

ROOT = Path(__file__).resolve().parent.parent


def _params(tmp_path: Path, **evaluation) -> Path:
    raw = load_config(ROOT / "params" / "smoke.yaml").resolved()
    raw["evaluation"].update(evaluation)
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_the_eval_cap_below_rls_is_refused_naming_file_and_field(tmp_path: Path) -> None:
    rl_cap = load_config(ROOT / "params" / "smoke.yaml").rl.max_new_tokens
    p = _params(tmp_path, max_new_tokens=rl_cap - 1)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert str(p) in msg
    assert f"evaluation.max_new_tokens={rl_cap - 1}" in msg and "rl.max_new_tokens" in msg
    with pytest.raises(ConfigError, match="evaluation.max_new_tokens"):
        load_config(_params(tmp_path, max_new_tokens=0))
    with pytest.raises(ConfigError, match="evaluation.cut_responses"):
        load_config(_params(tmp_path, cut_responses="dropped"))


def test_every_evaluated_policy_samples_at_the_eval_cap(tmp_path: Path) -> None:
    cfg = load_config(_params(tmp_path, max_new_tokens=None))
    assert cfg.eval_max_new_tokens == cfg.rl.max_new_tokens  # null: RL's cap
    cfg = load_config(_params(tmp_path, max_new_tokens=cfg.rl.max_new_tokens + 40))
    assert cfg.eval_max_new_tokens == cfg.rl.max_new_tokens + 40
    for trained in (False, True):  # the start policy, best-of-N's pool and the RL policies alike
        assert sampling_kwargs(cfg, trained=trained)["max_new_tokens"] == cfg.rl.max_new_tokens + 40


def test_the_profiles_evaluate_longer_than_rl_trains() -> None:
    for name in ("default", "smoke", "full", "paper"):
        cfg = load_config(ROOT / "params" / f"{name}.yaml")
        assert cfg.eval_max_new_tokens > cfg.rl.max_new_tokens, name
        assert cfg.evaluation.cut_responses == "failed", name


class _Judge:
    """A judge that scores every response 0.7 (the audit) or 0.6 (the reward model)."""

    def __init__(self, value: float):
        self.value = value

    def score(self, contexts, texts, batch_size: int = 64) -> np.ndarray:
        return np.full(len(texts), self.value)


def _samples() -> pd.DataFrame:
    return pd.DataFrame({"policy": ["sft", "sft", "ppo", "ppo", "history_met"],
                         "prompt_id": [0, 0, 0, 0, 0], "response": ["a", "b", "c", "d", "e"],
                         "finished": [True, False, True, False, None]})  # fmt: skip


def test_a_cut_response_fails_under_both_judges_and_keeps_its_score_as_written() -> None:
    contexts = [{"country": "X", "arrangement_type": "SBA", "econ_descriptor": "1.1"}]
    out = add_rewards(_samples(), contexts, _Judge(0.6), _Judge(0.7), 4, cut_responses="failed")
    cut = out["finished"].eq(False)
    assert (out.loc[cut, "reward"] == 0).all() and (out.loc[cut, "audit_reward"] == 0).all()
    # every other response (one without a `finished` value too) keeps its scores; every row keeps
    # them as written
    assert (out.loc[~cut, "reward"] == 0.6).all() and (out.loc[~cut, "audit_reward"] == 0.7).all()
    assert (out["reward_as_written"] == 0.6).all() and (out["audit_reward_as_written"] == 0.7).all()
    assert not out["reward_truncated"].any()  # these judges read every word
    plain = add_rewards(
        _samples(), contexts, _Judge(0.6), _Judge(0.7), 4, cut_responses="as_written"
    )
    assert (plain["reward"] == 0.6).all() and (plain["audit_reward"] == 0.7).all()
    with pytest.raises(ValueError, match="evaluation.cut_responses='drop'"):
        apply_cut_rule(_samples().assign(reward=0.5), "drop")


def test_the_reward_models_truncated_inputs_are_flagged() -> None:
    from rlxf_utils.evaluation.sampling import reward_input_truncated

    class Tok:
        def __call__(self, texts, truncation=False):
            return {"input_ids": [t.split() for t in texts]}

    judge = _Judge(0.5)
    judge.tokenizer, judge.max_length = Tok(), 12
    contexts = [{"country": "X", "arrangement_type": "SBA", "econ_descriptor": "1.1"}]
    df = pd.DataFrame({"prompt_id": [0, 0], "response": ["short", " ".join(["w"] * 20)]})
    assert reward_input_truncated(df, contexts, judge).tolist() == [False, True]


class _Ender(torch.nn.Module):
    """A model whose every row writes token 1 until its next token sits at absolute position
    `end`, then the end token 0: rows with shorter prompts write longer answers. It records how
    many rows each forward call computes (the decode loop's cost)."""

    def __init__(self, end: int):
        from transformers import LlamaConfig

        super().__init__()
        self.config = LlamaConfig(vocab_size=4, hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1)  # fmt: skip
        self.w = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.end, self.rows = end, []

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, **_):
        b, n = input_ids.shape
        past_key_values.update(torch.zeros(b, 1, n, 1), torch.zeros(b, 1, n, 1), 0)
        self.rows.append(b)
        logits = torch.full((b, n, 4), -1e9)
        ends = position_ids[:, -1] + 1 >= self.end
        logits[ends, -1, 0] = 0.0
        logits[~ends, -1, 1] = 0.0
        return SimpleNamespace(logits=logits)


def _decode(model: torch.nn.Module, cap: int):
    from rlxf_utils.models.decode import sample_compact

    ids = torch.full((3, 6), 2, dtype=torch.long)
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]])
    return sample_compact(model, ids, mask, max_new_tokens=cap, temperature=1.0, top_p=1.0,
                          stop_ids=[0], pad_id=3, seed=0)  # fmt: skip


def test_finished_rows_leave_the_batch_so_a_longer_cap_costs_only_the_tokens_answers_use() -> None:
    """The compact loop (`models.decode.sample_compact`, evaluation's sampler): answers of 5, 7
    and 9 tokens cost 21 row-steps and 9 forward calls at a cap of 48 or 128 alike; the batch
    shrinks as rows end. A row that never ends runs to the cap."""
    for cap in (48, 128):
        model = _Ender(end=10)
        out = _decode(model, cap)
        lengths = (out.ids != 3).sum(1).tolist()
        assert lengths == [5, 7, 9]
        assert model.rows == [3] * 5 + [2] * 2 + [1] * 2, cap  # 21 row-steps, 9 calls
    model = _Ender(end=10_000)
    assert _decode(model, 128).ids.shape == (3, 128) and len(model.rows) == 128


def test_a_longer_cap_keeps_every_rows_first_draws() -> None:
    """A row's uniforms at cap 128 begin with its uniforms at cap 48: an answer that ended
    within 48 tokens is drawn the same under the longer cap (the finished share can only rise)."""
    from rlxf_utils.models.decode import row_uniforms

    short, long = row_uniforms(20240514, [0, 5, 77], 48), row_uniforms(20240514, [0, 5, 77], 128)
    assert torch.equal(short, long[:, :48])


def test_the_summary_keeps_the_gains_as_written_beside_the_rules() -> None:
    """`ppo` finishes one response in three and writes what the start policy writes: under the
    rule its cut responses fail (a large loss under both judges); as written, no gain either way
    (the sensitivity rows of `eval_paired` and the summary's `*_as_written` gains)."""
    from rlxf_utils.evaluation.tables import summary_table

    df = apply_cut_rule(_one_in_three("sft", 0.02), "failed")
    s, paired = summary_table(df, ["sft", "ppo"], "sft", 4, n_boot=200, alpha=0.05, seed=0)
    r = s.set_index("policy").loc["ppo"]
    assert r["gain"] == pytest.approx(-0.5 * 2 / 3, abs=0.01) and r["gain_high"] < 0
    assert r["audit_gain"] == pytest.approx(-0.6 * 2 / 3, abs=0.01)
    for pre in ("gain_as_written", "audit_gain_as_written"):
        assert abs(r[pre]) < 0.01 and r[f"{pre}_low"] > -0.03  # no loss of the rule's size
    assert {"reward_as_written", "audit_reward_as_written"} <= set(paired["measure"])


def test_the_finished_share_is_a_family_of_its_own_beside_every_gain() -> None:
    """Issue 78: `ppo` finishes one response in three where the start policy finishes all: the
    share's change, -2/3 exactly on every prompt, is its own family against the start policy
    (`finished_gain`), so a reader sees how much of the gain under the cut rule is length."""
    from rlxf_utils.evaluation.tables import summary_table

    df = apply_cut_rule(_one_in_three("sft", 0.02), "failed")
    s, paired = summary_table(df, ["sft", "ppo"], "sft", 4, n_boot=200, alpha=0.05, seed=0)
    r = s.set_index("policy").loc["ppo"]
    assert r["finished_gain"] == pytest.approx(-2 / 3) and r["finished_gain_verdict"] == "below"
    assert r["finished"] == pytest.approx(1 / 3)
    assert "finished_share" in set(paired["measure"])
    assert np.isnan(s.set_index("policy").loc["sft", "finished_gain"])  # the start: no change
    # a reference without a cap (history's descriptions: no `finished`) is not in the family
    hist = df[df["policy"] == "sft"].assign(policy="history_met", finished=np.nan)
    s2, _ = summary_table(pd.concat([df, hist]), ["sft", "ppo"], "sft", 4, n_boot=200, alpha=0.05,
                          seed=0)  # fmt: skip
    assert np.isnan(s2.set_index("policy").loc["history_met", "finished_gain"])


def test_the_summary_gives_each_policys_bounds_among_finished_responses() -> None:
    """The evaluation's summary carries, per judge, Lee's bounds beside the finished-only gain:
    `ppo` finishes one response in three, the start policy all three, so the start policy's
    finished responses are trimmed to one per prompt and the bounds hold the untrimmed gain."""
    from rlxf_utils.evaluation.tables import summary_table

    s, _ = summary_table(_one_in_three("base", 0.05), ["base", "ppo"], "base", 4, n_boot=200, alpha=0.05,
                         seed=0)  # fmt: skip
    r = s.set_index("policy").loc["ppo"]
    for pre in ("gain_finished", "audit_gain_finished"):
        assert r[f"{pre}_lee_prompts"] == 30
        assert r[f"{pre}_lee_low"] < r[f"{pre}_lee_lower"] < r[pre] < r[f"{pre}_lee_upper"]
        assert r[f"{pre}_lee_upper"] < r[f"{pre}_lee_high"]
    assert np.isnan(s.set_index("policy").loc["base", "gain_finished_lee_lower"])


def _one_in_three(start: str, sd: float) -> pd.DataFrame:
    """`start` and `ppo` on 30 prompts in 10 countries, 3 samples each, scores around 0.5 (reward
    model) and 0.6 (audit) with noise `sd` (seeded): `start` finishes every response, `ppo` only
    its first."""
    rng = np.random.default_rng(0)
    rows = [
        {"policy": pol, "prompt_id": p, "sample_id": j, "reward": 0.5 + rng.normal(0, sd),
         "audit_reward": 0.6 + rng.normal(0, sd), "logp_policy": -5.0, "logp_ref": -5.0,
         "logp_base": -5.0, "n_tokens": 5, "finished": pol == start or j == 0,
         "response": f"w{p} w{j}", "country": f"C{p % 10}", "grounded_met_rate": 0.6,
         "max_sim": 0.5}
        for pol in (start, "ppo") for p in range(30) for j in range(3)
    ]  # fmt: skip
    return pd.DataFrame(rows)
