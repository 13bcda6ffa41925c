"""The three split protocols (random, grouped by arrangement, temporal), the evaluation holdout
nested in them, near duplicates across a split, and reading the splits back from a run."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.data.schema import DataError


def stratified_take(ids: np.ndarray, y: np.ndarray, frac: float, rng: np.random.Generator):
    """Split `ids` into (rest, taken) with `frac` of each label class taken."""
    taken = []
    for cls in np.unique(y):
        cls_ids = ids[y == cls].copy()
        rng.shuffle(cls_ids)
        k = round(len(cls_ids) * frac)
        taken.extend(cls_ids[:k].tolist())
    taken_set = set(taken)
    rest = [i for i in ids.tolist() if i not in taken_set]
    return sorted(rest), sorted(taken)


def grouped_take(ids: np.ndarray, groups: np.ndarray, frac: float, rng: np.random.Generator):
    """Split `ids` into (rest, taken) by whole groups, taking groups until `frac` of rows."""
    uniq = pd.unique(groups)
    order = rng.permutation(len(uniq))
    target = frac * len(ids)
    counts = pd.Series(groups).value_counts()
    chosen, n = set(), 0
    for j in order:
        g = uniq[j]
        if n >= target:
            break
        chosen.add(g)
        n += counts[g]
    mask = np.array([g in chosen for g in groups])
    return sorted(ids[~mask].tolist()), sorted(ids[mask].tolist())


def make_splits(
    labelled: pd.DataFrame,
    seed: int,
    test_fraction: float = 0.2,
    validation_fraction: float = 0.1,
    temporal_cutoff_year: int = 2010,
) -> dict[str, dict[str, list[int]]]:
    """The three protocols as row_id lists: random (stratified), grouped (by arrangement), temporal.

    Each has train/val/test; val is carved from the training side the same way the protocol
    separates train from test (stratified, by arrangement, or stratified within the past).
    """
    ids = labelled["row_id"].to_numpy()
    y = labelled["y"].astype(int).to_numpy()
    groups = labelled["arrangement_id"].astype(str).to_numpy()
    by_id = labelled.set_index("row_id")
    out: dict[str, dict[str, list[int]]] = {}

    rng = np.random.default_rng(seed)
    train, test = stratified_take(ids, y, test_fraction, rng)
    tr = np.array(train)
    train, val = stratified_take(
        tr, by_id.loc[tr, "y"].astype(int).to_numpy(), validation_fraction, rng
    )
    out["random"] = {"train": train, "val": val, "test": test}

    rng = np.random.default_rng(seed + 1)
    train, test = grouped_take(ids, groups, test_fraction, rng)
    tr = np.array(train)
    train, val = grouped_take(
        tr, by_id.loc[tr, "arrangement_id"].astype(str).to_numpy(), validation_fraction, rng
    )
    out["grouped"] = {"train": train, "val": val, "test": test}

    rng = np.random.default_rng(seed + 2)
    year = labelled["test_year"]
    known = year.notna().to_numpy()
    past = known & (year.fillna(-1).to_numpy() <= temporal_cutoff_year)
    future = known & (year.fillna(-1).to_numpy() > temporal_cutoff_year)
    tr = ids[past]
    train, val = stratified_take(tr, y[past], validation_fraction, rng)
    out["temporal"] = {"train": train, "val": val, "test": sorted(ids[future].tolist())}
    for name, parts in out.items():
        for part, rows in parts.items():
            if not rows:
                raise DataError(
                    f"split '{name}' has an empty '{part}' part ({len(labelled)} labelled rows); "
                    "check data.max_rows, data.splits.* fractions and temporal_cutoff_year"
                )
    return out


def nest_evaluation_holdout(
    labelled: pd.DataFrame,
    splits: dict[str, dict[str, list[int]]],
    protocol: str,
    eval_countries: Iterable[str],
    seed: int,
    validation_fraction: float = 0.1,
) -> tuple[dict[str, dict[str, list[int]]], dict[str, Any]]:
    """Nest the RL evaluation inside the reward protocol's test split; carve a disjoint audit slice.

    RL is evaluated on the contexts of held-out countries, and its history references (real MET
    and Non-MET descriptions) come from those countries. So that neither the reward model nor the
    audit model ever trained on a reference, every row of an evaluation country moves from the
    reward protocol's train/val into its test part (whole countries, hence whole arrangements: the
    grouped protocol stays grouped). The rest of that test part, the held-out rows of training
    countries, trains the audit model, split by arrangement into `audit_train` / `audit_val`; it
    shares no row with the reward model's training data. Returns (new splits, holdout), holdout
    holding row_id lists `reference`, `audit_train`, `audit_val` and the country list.
    """
    if protocol not in splits:
        raise DataError(
            f"reward.reward_protocol is {protocol!r} but the splits are {sorted(splits)}"
        )
    held = sorted({str(c) for c in eval_countries})
    country = labelled.set_index("row_id")["country"].astype(str)
    in_eval = set(country.index[country.isin(held)].tolist())
    sp = splits[protocol]
    nested = {
        "train": [i for i in sp["train"] if i not in in_eval],
        "val": [i for i in sp["val"] if i not in in_eval],
        "test": sorted(set(sp["test"]) | in_eval),
    }
    audit = np.array([i for i in nested["test"] if i not in in_eval], dtype=np.int64)
    arr = labelled.set_index("row_id").loc[audit, "arrangement_id"].astype(str).to_numpy()
    audit_train, audit_val = grouped_take(
        audit, arr, validation_fraction, np.random.default_rng(seed + 4)
    )
    holdout = {
        "reward_protocol": protocol,
        "eval_countries": held,
        "reference": sorted(in_eval),
        "audit_train": audit_train,
        "audit_val": audit_val,
    }
    for name in ("train", "val"):
        if not nested[name]:
            raise DataError(
                f"reward protocol {protocol!r} has no {name} rows once the evaluation countries "
                "are held out; lower data.splits.context_eval_fraction"
            )
    for name in ("reference", "audit_train"):
        if not holdout[name]:
            raise DataError(
                f"the evaluation holdout has no {name!r} rows ({len(labelled)} labelled rows); "
                "check data.splits.test_fraction and context_eval_fraction"
            )
    out = dict(splits)
    out[protocol] = nested
    return out, holdout


#: The pools of rows, in the order the tables list them (`pool_of_rows`).
POOLS = ("reward_train", "reward_val", "audit_train", "audit_val", "policy", "reference", "unused")


def carve_policy_pool(
    labelled: pd.DataFrame,
    splits: dict[str, dict[str, list[int]]],
    holdout: dict[str, Any],
    policy_fraction: float,
    seed: int,
) -> tuple[dict[str, dict[str, list[int]]], dict[str, Any]]:
    """Give the policies their own rows, so that no policy imitates a judge's training rows.

    `policy_fraction` of the training countries' labelled rows, as whole arrangements (MONA
    repeats a condition across one arrangement's reviews: a copy must not sit in two pools), are
    drawn from the reward protocol's training side (train + val), seeded, never from an
    arrangement of the grouped protocol's val part (a few whole arrangements that pick the
    checkpoint and fit the calibration: a smoke run's could not lose one). They leave every
    protocol's train and val parts (no reward model learns
    from them; every test part is unchanged, so a protocol's test metrics compare before and
    after), and the audit's rows of
    those arrangements leave the audit (they are in no pool: `unused`). Returns (new splits,
    holdout with `policy` and `policy_fraction` added), after `nest_evaluation_holdout`.
    """
    protocol = holdout["reward_protocol"]
    sp = splits[protocol]
    reference = set(holdout["reference"])
    n_train_countries = int((~labelled["row_id"].isin(reference)).sum())
    arr = labelled.set_index("row_id")["arrangement_id"].astype(str)
    grouped_val = set(arr.loc[splits.get("grouped", {}).get("val", [])])
    side = np.array(sorted(i for i in set(sp["train"]) | set(sp["val"])
                           if arr.loc[i] not in grouped_val), dtype=np.int64)  # fmt: skip
    frac = policy_fraction * n_train_countries / max(len(side), 1)
    if frac >= 1:
        raise DataError(
            f"data.splits.policy_fraction={policy_fraction} asks for "
            f"{policy_fraction * n_train_countries:.0f} of the training countries' "
            f"{n_train_countries} rows, but the {protocol!r} protocol's training side holds "
            f"{len(side)}: lower data.splits.policy_fraction or data.splits.test_fraction"
        )
    _, policy = grouped_take(side, arr.loc[side].to_numpy(), frac, np.random.default_rng(seed + 5))
    taken = set(policy)
    out = {p: {k: (v if k == "test" else [i for i in v if i not in taken]) for k, v in parts.items()}
           for p, parts in splits.items()}  # fmt: skip
    policy_arr = set(arr.loc[policy])
    h = dict(holdout)
    for part in ("audit_train", "audit_val"):
        h[part] = [i for i in holdout[part] if arr.loc[i] not in policy_arr]
    h["policy"] = sorted(policy)
    h["policy_fraction"] = policy_fraction
    y = labelled.set_index("row_id")["y"]
    for name, ids in (("policy", h["policy"]), (f"{protocol}.train", out[protocol]["train"]),
                      ("audit_train", h["audit_train"])):  # fmt: skip
        if y.loc[ids].nunique() < 2:
            raise DataError(
                f"with data.splits.policy_fraction={policy_fraction}, the {name} rows "
                f"({len(ids)}) hold {'no rows' if not ids else 'one outcome only'}; "
                "change data.splits.policy_fraction or data.max_rows"
            )
    return out, h


def pool_of_rows(
    labelled: pd.DataFrame, splits: dict[str, dict[str, list[int]]], holdout: dict[str, Any]
) -> pd.DataFrame:
    """Each labelled row's pool (`POOLS`): which model learns from it. `reward_*`: the reward
    protocol's train / val parts; `audit_*`: the audit (gold judge); `policy`: SFT, `sft_met`, the
    offline methods, ILHF's pairs, the MLE references and RL's contexts; `reference`: the
    evaluation countries (no model learns from them); `unused`: no model learns from them either
    (the audit's rows of policy arrangements, and under the temporal protocol rows of unknown year).
    Raises when a row is in two pools."""
    sp = splits[holdout["reward_protocol"]]
    parts = {"reward_train": sp["train"], "reward_val": sp["val"],
             "audit_train": holdout["audit_train"], "audit_val": holdout["audit_val"],
             "policy": holdout.get("policy", []), "reference": holdout["reference"]}  # fmt: skip
    pool = pd.Series("unused", index=labelled["row_id"].to_numpy(), dtype=object)
    seen: dict[int, str] = {}
    for name, ids in parts.items():
        for i in ids:
            if i in seen:
                raise DataError(f"row_id {i} is in two pools: {seen[i]!r} and {name!r}")
            seen[i] = name
        pool.loc[list(ids)] = name
    return pd.DataFrame({"row_id": pool.index, "pool": pool.to_numpy()})


def pool_table(labelled: pd.DataFrame, pools: pd.DataFrame) -> pd.DataFrame:
    """Per pool: rows, share of the labelled rows and of the training countries' rows, countries,
    arrangements, (country, arrangement type, descriptor) contexts and MET share."""
    lab = labelled.merge(pools, on="row_id", validate="one_to_one")
    n_train_countries = int((lab["pool"] != "reference").sum())
    rows = []
    for name in POOLS:
        sub = lab[lab["pool"] == name]
        rows.append({
            "pool": name,
            "rows": len(sub),
            "share": len(sub) / len(lab),
            "share_of_training_countries": (len(sub) / n_train_countries
                                            if name != "reference" else float("nan")),
            "countries": int(sub["country"].nunique()),
            "arrangements": int(sub["arrangement_id"].nunique()),
            "contexts": int(sub[["country", "arrangement_type", "econ_descriptor"]]
                            .drop_duplicates().shape[0]),
            "met_share": float(sub["y"].astype(float).mean()) if len(sub) else float("nan"),
        })  # fmt: skip
    return pd.DataFrame(rows)


def load_holdout(run: Any) -> dict[str, Any]:
    """`data/holdout.json` (see `nest_evaluation_holdout`), written by notebook 01."""
    h = run.read_json("data/holdout.json", "notebook 01_data_exploration")
    missing = [k for k in ("reference", "audit_train", "audit_val", "policy", "eval_countries")
               if k not in h]  # fmt: skip
    if missing:
        raise DataError(
            f"{run.path('data/holdout.json')}: fields {missing} missing; rerun notebook 01"
        )
    return h


def near_duplicates_across(
    train_texts: list[str], test_texts: list[str], threshold: float = 0.9
) -> dict[str, float]:
    """How many test descriptions have an exact or near duplicate (TF-IDF cosine ≥ threshold) in train."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    norm = [" ".join(t.lower().split()) for t in train_texts]
    norm_test = [" ".join(t.lower().split()) for t in test_texts]
    train_set = set(norm)
    exact = sum(t in train_set for t in norm_test)
    vec = TfidfVectorizer(ngram_range=(1, 2), min_df=1, sublinear_tf=True).fit(norm + norm_test)
    a, b = vec.transform(norm_test), vec.transform(norm)
    best = np.zeros(len(norm_test))
    for start in range(0, len(norm_test), 512):
        sims = (a[start : start + 512] @ b.T).toarray()
        best[start : start + 512] = sims.max(axis=1) if sims.shape[1] else 0.0
    near = int((best >= threshold).sum())
    n = max(len(norm_test), 1)
    return {
        "test_rows": len(norm_test),
        "exact_in_train": int(exact),
        "exact_share": exact / n,
        "near_in_train": near,
        "near_share": near / n,
        "threshold": threshold,
    }


#: The three pools whose texts are compared (`pool_near_duplicates`): each model's rows, as
#: the pools of `pool_of_rows` give them.
POOL_GROUPS = {"policy": ("policy",), "reward": ("reward_train", "reward_val"),
               "audit": ("audit_train", "audit_val")}  # fmt: skip
#: The ordered pairs measured: (pool whose rows are counted, pool searched for a copy).
POOL_PAIRS = (("policy", "reward"), ("policy", "audit"), ("audit", "reward"))


def pool_near_duplicates(
    labelled: pd.DataFrame, pools: pd.DataFrame, threshold: float = 0.9
) -> pd.DataFrame:
    """How many rows of one pool have an exact (after lower-casing and whitespace) or near copy
    (TF-IDF cosine ≥ `threshold`, the measure of the protocols' `near_duplicates_across`) in
    another: the policies' rows in the reward model's and in the audit's, the audit's in the
    reward model's (`POOL_PAIRS`). A policy that learned such a text is scored by a judge that
    learned (nearly) the same one. One row per pair: `pool`, `other`, `rows`, `exact_in_other`,
    `exact_share`, `near_in_other`, `near_share`, `threshold` (shares NaN for an empty pool)."""
    text = labelled.merge(pools, on="row_id", validate="one_to_one").set_index("pool")
    by_group = {g: text.loc[text.index.isin(parts), "description"].astype(str).tolist()
                for g, parts in POOL_GROUPS.items()}  # fmt: skip
    rows = []
    for pool, other in POOL_PAIRS:
        mine, theirs = by_group[pool], by_group[other]
        if mine and theirs:
            r = near_duplicates_across(theirs, mine, threshold)
        else:
            r = dict.fromkeys(("exact_in_train", "near_in_train"), 0)
            r |= {"test_rows": len(mine), "exact_share": np.nan, "near_share": np.nan}
        rows.append({"pool": pool, "other": other, "rows": int(r["test_rows"]),
                     "exact_in_other": int(r["exact_in_train"]), "exact_share": r["exact_share"],
                     "near_in_other": int(r["near_in_train"]), "near_share": r["near_share"],
                     "threshold": threshold})  # fmt: skip
    return pd.DataFrame(rows)


def split_summary(labelled: pd.DataFrame, splits: dict[str, dict[str, list[int]]]) -> pd.DataFrame:
    """Rows, MET share and arrangements per protocol and part (train/val/test)."""
    by_id = labelled.set_index("row_id")
    rows = []
    for protocol, parts in splits.items():
        for part, ids in parts.items():
            sub = by_id.loc[ids]
            rows.append(
                {
                    "protocol": protocol,
                    "part": part,
                    "rows": len(sub),
                    "met_share": float(sub["y"].astype(float).mean()),
                    "arrangements": int(sub["arrangement_id"].nunique()),
                    "years": f"{int(sub['test_year'].min())}–{int(sub['test_year'].max())}",
                }
            )
    return pd.DataFrame(rows)


def load_splits(run: Any) -> tuple[pd.DataFrame, dict[str, dict[str, list[int]]]]:
    """The labelled conditions and the splits written by notebook 01 (for later stages)."""
    stage = "notebook 01_data_exploration"
    cond = run.read_parquet("data/conditions.parquet", stage)
    labelled = cond[cond["label"] != "excluded"].reset_index(drop=True)
    return labelled, run.read_json("data/splits.json", stage)
