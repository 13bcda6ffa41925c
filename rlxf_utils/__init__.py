"""rlxf_utils: the tested logic behind the RLXF study's notebooks.

One room per job (docs/architecture.md's table): `data/`, `reward/`, `models/`, `rl/`,
`evaluation/`, `risk/` and `report/` for the stages, `stats/`, `config/`, `algorithms`,
`artifacts`, `runtime`, `prompts`, `plots`, `freshness`, `compare` beneath them, `pipeline` and
`cli` on top. Notebooks import from here, never the other way round.
"""

__version__ = "0.1.0"
