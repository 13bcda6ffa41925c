"""Further training seeds of a finished run, and the across-seed comparison.

One training seed per algorithm cannot tell an algorithm's effect from its seed's. `rlxf seeds`
trains the run's RL algorithms (or those `algorithms` names) again with other `rl.seed`s and
evaluates them, each seed in `<run>/seeds/seed_<s>/`, reusing what does not depend on the
training seed: the data, the reward and audit models and the SFT policies are the run's own files
(hard links: nothing is copied, and every artifact is replaced atomically, so a seed never changes
the run's files). Evaluation draws the same prompts, and the start policy's and the references'
samples with the same sampling seeds (`run.seed`: the same texts, shared for pairing; read back
from the run's `eval/draws/` rather than drawn again, `evaluation.draws`), while each seed's
trained policies sample with their own training seed (`models.generation.sampling_kwargs`), so the
seeds are replications, not one draw counted again. Then `seed_table` sets every
algorithm's gain over the start policy (reward model and audit), KL and finished share side by
side per seed and, for every algorithm with two seeds or more, pooled over seeds with an interval
that carries both the seed-to-seed spread and the evaluation's error (`stats.replicated_gain`)
and the seeds a target MDE needs (`stats.seeds_for_mde`), into the run's `tables/eval_seeds.csv`
and `figures/eval_seeds.png`, which the report includes when present.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml
from scipy import stats

from rlxf_utils.algorithms import OFFLINE_ALGORITHMS, algorithm_label
from rlxf_utils.artifacts import FROZEN_PARAMS, NotARun, RunDir, atomic_path, read_manifest
from rlxf_utils.config import load_config
from rlxf_utils.evaluation.tables import finished_only
from rlxf_utils.pipeline import run_study
from rlxf_utils.stats import family_alpha, level, mde, replicated_gain, seeds_for_mde
from rlxf_utils.stats.intervals import level_span

log = logging.getLogger(__name__)

#: What a seed reuses from its run: everything the training seed does not change.
REUSED = ("data", "reward", "reward_model", "policy/sft", "policy/sft_met",
          "eval/historical_index", "eval/draws", "tables", "figures")  # fmt: skip
#: The notebooks a seed runs: RL and evaluation.
SEED_NOTEBOOKS = ("03", "04")
#: Per algorithm and seed, the columns of `eval/summary.json`'s summary the table carries.
MEASURES = {"gain": "reward-model gain over the start policy", "audit_gain": "audit gain",
            "gain_finished": "reward-model gain among finished responses",
            "audit_gain_finished": "audit gain among finished responses",
            "kl": "KL to the start policy (nats)", "finished": "finished share"}  # fmt: skip
#: The gains pooled with `stats.replicated_gain`: table column -> (the samples' score column,
#: whether among finished responses only, `evaluation.tables.finished_only`: a gain of a policy
#: whose responses the token cap cuts may come from their length, and this is its check).
GAINS = {"gain": ("reward", False), "audit_gain": ("audit_reward", False),
         "gain_finished": ("reward", True), "audit_gain_finished": ("audit_reward", True)}  # fmt: skip


def seed_dir(run_dir: str | Path, seed: int) -> Path:
    """Where seed `seed` of the run lives."""
    return Path(run_dir) / "seeds" / f"seed_{seed}"


def _link_tree(src: Path, dst: Path) -> None:
    """Hard-link every file of `src` into `dst` (a copy where links are not possible)."""
    if src.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
        return
    for path in src.rglob("*"):
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(src).parts):
            _link_tree(path, dst / path.relative_to(src))


def prepare_seed(run_dir: str | Path, seed: int, algorithms: Sequence[str] | None = None) -> Path:
    """`<run>/seeds/seed_<seed>/` with the run's reusable outputs linked in and a parameters file
    (the run's frozen parameters with `rl.seed` and the run name changed, and `rl.algorithm`
    cut to `algorithms` when given: ids among the run's, kept in the run's order; else to the
    run's RL and ILHF algorithms, whose seeds the across-seed section is about: an offline method
    trains for a further seed only when named); returns that file."""
    run = RunDir(run_dir)
    frozen = run.require(FROZEN_PARAMS, stage="rlxf run (the run the seeds extend)")
    cfg = load_config(frozen)
    keep = list(cfg.rl.algorithm)
    if algorithms is None:
        keep = [a for a in keep if a not in OFFLINE_ALGORITHMS]
        if not keep:
            raise ValueError(
                f"{frozen}: rl.algorithm {list(cfg.rl.algorithm)} holds no RL algorithm; name the "
                "offline methods to train for further seeds with --algorithms"
            )
    else:
        unknown = sorted(set(algorithms) - set(keep))
        if unknown or not algorithms:
            raise ValueError(
                f"{frozen}: --algorithms {','.join(algorithms)}: {unknown or 'none given'}; "
                f"expected one or more of the run's rl.algorithm {keep}"
            )
        keep = [a for a in keep if a in set(algorithms)]
    if cfg.training_seed == seed:
        raise ValueError(f"seed {seed} is the run's own training seed; choose another")
    missing = [
        p for p in ("data", "reward_model", f"policy/{cfg.rl.start_policy}") if not run.exists(p)
    ]
    if missing:
        raise ValueError(
            f"{run.root}: {missing} missing; finish notebooks 01-03 of the run before its seeds"
        )
    out = seed_dir(run.root, seed)
    for rel in REUSED:
        if run.exists(rel):
            _link_tree(run.path(rel), out / rel)
    raw = cfg.resolved()
    raw["rl"]["seed"] = int(seed)
    raw["rl"]["algorithm"] = keep
    raw["run"]["name"] = f"{cfg.run.name}-seed{seed}"
    params = out.parent / f"params_seed_{seed}.yaml"
    with atomic_path(params) as tmp:
        head = f"# {frozen} with rl.seed = {seed}: written by `rlxf seeds`\n"
        tmp.write_text(head + yaml.safe_dump(raw, sort_keys=False, allow_unicode=True), "utf-8")
    load_config(params)  # it must validate before any compute
    return params


#: What a run must have before `rlxf seeds` extends it: file -> what writes it.
FINISHED = {FROZEN_PARAMS: "rlxf run", "data": "notebook 01", "reward_model": "notebook 02",
            "eval/summary.json": "notebook 04"}  # fmt: skip


def check_finished(run_dir: str | Path) -> None:
    """`run_dir` is a run `rlxf run` took through notebook 04, or a `NotARun` naming what is
    missing. Reads only: a missing folder is not created."""
    read_manifest(run_dir)
    missing = [f"{p} ({by})" for p, by in FINISHED.items() if not (Path(run_dir) / p).exists()]
    if missing:
        raise NotARun(
            f"{run_dir}: not a finished run, {', '.join(missing)} missing; expected a folder "
            "where `rlxf run` finished notebooks 01-04"
        )


def run_seeds(
    run_dir: str | Path,
    seeds: Sequence[int],
    progress: bool = True,
    algorithms: Sequence[str] | None = None,
) -> pd.DataFrame:
    """Train and evaluate the run's algorithms (those of `algorithms`, when given) with each of
    `seeds` (notebooks 03 and 04 in `seeds/seed_<s>/`; finished seeds are skipped by the
    pipeline's own freshness), then write and return the across-seed table."""
    check_finished(run_dir)
    for s in seeds:
        params = prepare_seed(run_dir, s, algorithms)
        log.info("seed %d: %s", s, seed_dir(run_dir, s))
        run_study(params, seed_dir(run_dir, s), only=list(SEED_NOTEBOOKS), progress=progress,
                  force_only=False)  # fmt: skip
    return write_seed_table(run_dir)


def seed_runs(run_dir: str | Path) -> dict[int, Path]:
    """The run and every evaluated seed under it: training seed -> run directory."""
    run = RunDir(run_dir)
    cfg = load_config(run.require(FROZEN_PARAMS, stage="rlxf run"))
    out = {cfg.training_seed: run.root}
    for d in sorted((run.root / "seeds").glob("seed_*")):
        if (d / "eval" / "summary.json").is_file():
            out[int(d.name.split("_", 1)[1])] = d
    return out


def seed_differences(samples: pd.DataFrame, algo: str, start: str, col: str) -> pd.DataFrame:
    """One seed's per-prompt paired difference of `algo` from `start` under score `col`: the mean
    of its samples minus the start policy's on each prompt both have (columns `country`,
    `prompt`, `diff`)."""
    means = samples[samples["policy"].isin([algo, start])].pivot_table(
        index=["country", "prompt_id"], columns="policy", values=col, aggfunc="mean"
    )
    if algo not in means or start not in means:
        return pd.DataFrame(columns=["country", "prompt", "diff"])
    d = (means[algo] - means[start]).dropna().rename("diff").reset_index()
    return d.rename(columns={"prompt_id": "prompt"})


def seed_table(run_dir: str | Path, alpha: float = 0.05) -> pd.DataFrame:
    """Per algorithm and training seed: gain over the start policy (with its interval), audit
    gain, KL and finished share; then, for every algorithm with two seeds or more (the others
    leave the table), the seeds pooled ('pooled' rows).

    A pooled gain (reward model and audit) is the mean over seeds of each seed's mean paired
    difference over the prompts, with `stats.replicated_gain`'s interval, which carries the
    seed-to-seed spread and the evaluation's own error (`<m>_se`, `<m>_df`; `<m>_seed_sd`, the
    SD of the seeds' estimates; `<m>_shared_sd`, the standard error over countries of the
    seed-averaged evaluation), its MDE at the run's power (`<m>_mde`) and the seeds the run's
    `evaluation.target_mde` needs (`<m>_seeds_needed`, NaN when no number of seeds reaches it:
    `<m>_mde_floor`, the MDE with infinitely many seeds, lies above it). KL and finished share
    are pooled with a t interval over seeds. Every interval follows the study's one
    multiplicity rule (`stats.family_alpha`): each measure asked of the m pooled algorithms is
    one family, so every interval is at level 1 - alpha / m (`ci_level`); a seed's own row keeps
    the level of its evaluation's vs-start family, at which its intervals were computed."""
    rows, samples = [], {}
    runs = seed_runs(run_dir)
    own = RunDir(run_dir).read_json("eval/summary.json", stage="notebook 04_evaluation")
    for seed, d in runs.items():
        meta = RunDir(d).read_json("eval/summary.json", stage="notebook 04_evaluation")
        s = pd.DataFrame(meta["summary"]).set_index("policy")
        for algo in meta["algorithms"]:
            if algo not in s.index:
                continue
            r = s.loc[algo]
            cols = [*MEASURES, *(f"{m}_{end}" for m in GAINS for end in ("low", "high"))]
            # the level of this seed's own intervals: its evaluation's vs-start family's (NaN
            # for a summary from before it listed the family)
            m_seed = len(meta.get("families", {}).get("vs_start", []))
            a_seed = family_alpha(meta.get("alpha", alpha), m_seed) if m_seed else math.nan
            # a measure the summary has no number for (null in the JSON, or absent): NaN
            rows.append({"algorithm": algo, "label": algorithm_label(algo), "seed": str(seed),
                         "ci_level": 1 - a_seed,
                         **{c: float(pd.to_numeric(r.get(c), errors="coerce")) for c in cols}})  # fmt: skip
    per_seed = pd.DataFrame(rows)
    if per_seed.empty:
        return per_seed
    counts = per_seed.groupby("algorithm")["seed"].nunique()
    per_seed = per_seed[per_seed["algorithm"].map(counts) >= 2].reset_index(drop=True)
    if per_seed.empty:
        return per_seed
    start = own.get("start_policy", "sft")
    power, target = float(own.get("power", 0.8)), own.get("target_mde")
    for seed, d in runs.items():
        samples[str(seed)] = RunDir(d).read_parquet(
            "eval/samples.parquet", "notebook 04_evaluation"
        )
    pooled = []
    m_family = per_seed["algorithm"].nunique()
    a_family = family_alpha(alpha, m_family)
    for algo, g in per_seed.groupby("algorithm", sort=False):
        rec: dict[str, Any] = {"algorithm": algo, "label": algorithm_label(algo), "seed": "pooled",
                               "seeds": len(g), "ci_level": 1 - a_family,
                               "method": "t over seeds and countries (seeds as replications)"}  # fmt: skip
        for m, (col, done) in GAINS.items():
            diffs = pd.concat([seed_differences(finished_only(samples[s]) if done else samples[s],
                                                algo, start, col).assign(seed=s)
                               for s in g["seed"]], ignore_index=True)  # fmt: skip
            if diffs.empty:  # no prompt where both finished a response, at any seed
                rec.update({m: math.nan, f"{m}_low": math.nan, f"{m}_high": math.nan})
                continue
            r = replicated_gain(diffs, a_family)
            need = (
                seeds_for_mde(
                    r["between_var"],
                    r["shared_var"],
                    r["shared_df"],
                    float(target),
                    a_family,
                    power,
                )  # fmt: skip
                if target is not None
                else {"seeds": math.nan, "floor": math.nan}
            )
            rec.update({m: r["mean"], f"{m}_low": r["low"], f"{m}_high": r["high"],
                        f"{m}_se": r["se"], f"{m}_df": r["df"],
                        f"{m}_seed_sd": math.sqrt(r["between_var"]),
                        f"{m}_shared_sd": math.sqrt(r["shared_var"]),
                        f"{m}_mde": mde(r["se"], m_family, alpha, power, r["df"]),
                        f"{m}_seeds_needed": need["seeds"], f"{m}_mde_floor": need["floor"],
                        f"{m}_prompts": r["prompts"]})  # fmt: skip
        for m in set(MEASURES) - set(GAINS):
            v = g[m].dropna().to_numpy(float)
            mean = float(v.mean()) if v.size else math.nan
            sd = float(v.std(ddof=1)) if v.size > 1 else math.nan
            half = (
                stats.t.ppf(1 - a_family / 2, v.size - 1) * sd / math.sqrt(v.size)
                if v.size > 1
                else math.nan
            )
            rec.update(
                {m: mean, f"{m}_seed_sd": sd, f"{m}_low": mean - half, f"{m}_high": mean + half}
            )
        rec["target_mde"] = math.nan if target is None else float(target)
        pooled.append(rec)
    return pd.concat([per_seed.assign(seeds=1), pd.DataFrame(pooled)], ignore_index=True)


def plot_seeds(table: pd.DataFrame, start: str) -> Any:
    """Per algorithm: each seed's gain under the reward model and the audit with its interval
    within that seed's evaluation (dots), and the mean over seeds with its simultaneous interval
    over seeds and countries (squares). The axis spans the seeds' own intervals: an interval over
    few seeds can be many times wider, and is then cut at the axis with its half-width written
    there."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    per = table[table["seed"] != "pooled"]
    pooled = table[table["seed"] == "pooled"].reset_index(drop=True)
    cols = (("gain", "reward model"), ("audit_gain", "audit"))
    seen = np.concatenate(
        [per[[c, f"{c}_low", f"{c}_high"]].to_numpy(float).ravel() for c, _ in cols]
    )
    seen = seen[np.isfinite(seen)]
    low, high = (min(seen.min(), 0.0), max(seen.max(), 0.0)) if seen.size else (-1.0, 1.0)
    pad = 0.15 * (high - low or 1.0)
    low, high = low - pad, high + pad
    for ax, (col, title) in zip(axes, cols, strict=True):
        ax.axhline(0, color="black", lw=0.8)
        for i, r in pooled.iterrows():
            pts = per[per["algorithm"] == r["algorithm"]]
            x = np.full(len(pts), i) + np.linspace(-0.12, 0.12, len(pts))
            y = pts[col].to_numpy(float)
            err = [y - pts[f"{col}_low"].to_numpy(float), pts[f"{col}_high"].to_numpy(float) - y]
            ax.errorbar(x, y, yerr=err, fmt="o", ms=4, lw=0.8, alpha=0.8, color=f"C{i % 10}")
            if math.isfinite(r[f"{col}_low"]):
                ax.errorbar(i + 0.3, r[col], yerr=[[r[col] - r[f"{col}_low"]], [r[f"{col}_high"] - r[col]]],
                            fmt="s", color="black", capsize=3)  # fmt: skip
                if r[f"{col}_low"] < low or r[f"{col}_high"] > high:  # cut at the axis
                    ax.annotate(f"±{(r[f'{col}_high'] - r[f'{col}_low']) / 2:.2f}", (i + 0.3, high),
                                xytext=(2, -2), textcoords="offset points", ha="left", va="top",
                                fontsize=6.5, rotation=90)  # fmt: skip
        ax.set_ylim(low, high)
        ax.set_xticks(range(len(pooled)), pooled["label"], rotation=20, ha="right")
        ax.set(title=f"gain over {start}: {title}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("P(MET) difference")
    lvl = level(1 - float(pooled["ci_level"].iloc[0])) if len(pooled) else ""
    own = level_span(per.get("ci_level", []))  # each seed's evaluation's family level
    fig.suptitle(f"Across training seeds: each seed with its own {own} simultaneous cluster t "
                 f"interval over countries (dots; its evaluation's family), the mean "
                 f"over seeds with its {lvl} simultaneous interval over seeds and countries "
                 "(squares; cut at the axis: ± half-width)", fontsize=9)  # fmt: skip
    fig.tight_layout()
    return fig


def write_seed_table(run_dir: str | Path) -> pd.DataFrame:
    """`tables/eval_seeds.{csv,md}` and `figures/eval_seeds.png` in the run (when any seed beyond
    the run's own was evaluated); returns the table."""
    import matplotlib.pyplot as plt

    run = RunDir(run_dir)
    meta = run.read_json("eval/summary.json", stage="notebook 04_evaluation")
    table = seed_table(run.root, meta.get("alpha", 0.05))
    if table.empty or not (table["seed"] == "pooled").any():  # no algorithm with two seeds
        return table
    run.write_table("eval_seeds", table)
    fig = plot_seeds(table, meta.get("start_policy", "sft"))
    run.write_figure("eval_seeds", fig)
    plt.close(fig)
    return table
