from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlxf_utils.config import PROJECT_ROOT, ConfigError, StudyConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
PROFILES = sorted((ROOT / "params").glob("*.yaml"))


def write_params(tmp_path: Path, mutate) -> Path:
    """The smoke profile, resolved (every key written out, paths absolute), after `mutate`."""
    raw = load_config(ROOT / "params" / "smoke.yaml").resolved()
    mutate(raw)
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_every_profile_validates(profile: Path) -> None:
    cfg = load_config(profile)
    assert isinstance(cfg, StudyConfig)
    assert cfg.data.path.is_file()
    assert cfg.run.name == profile.stem
    assert cfg.resolved()["run"]["name"] == profile.stem


def test_profiles_are_the_four_of_the_design_and_the_control() -> None:
    """DESIGN.md's four, and the positive control (the default's pipeline on planted labels,
    run beside the default by `make study`)."""
    assert {p.stem for p in PROFILES} == {"smoke", "default", "full", "paper", "control"}


#: Every profile's resolved parameters (what the manifest and the frozen `params.yaml` record),
#: checkout paths written `<root>`. Rewrite them after a deliberate change of a value with
#: `PYTHONPATH=. python tests/test_config.py`.
GOLDEN = ROOT / "tests" / "golden" / "params"


def _resolved_text(profile: Path) -> str:
    """The profile's resolved parameters as JSON, in the order they resolve, paths under the
    checkout written `<root>/...`."""
    root = str(PROJECT_ROOT)

    def rel(node):
        if isinstance(node, dict):
            return {k: rel(v) for k, v in node.items()}
        if isinstance(node, list):
            return [rel(v) for v in node]
        return node.replace(root, "<root>", 1) if isinstance(node, str) else node

    return json.dumps(rel(load_config(profile).resolved()), indent=1, ensure_ascii=False) + "\n"


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_every_profile_resolves_to_its_golden_parameters(profile: Path, monkeypatch) -> None:
    """smoke, paper and full say only what differs from default (`extends:`); what they resolve
    to is, byte for byte, what they resolved to as full copies (on a machine with native bf16,
    where the 'auto' precisions resolve to the bf16 the profiles named before they were 'auto')."""
    monkeypatch.setenv("RLXF_NATIVE_BF16", "1")
    golden = GOLDEN / f"{profile.stem}.json"
    assert _resolved_text(profile) == golden.read_text(encoding="utf-8"), profile.name


@pytest.mark.parametrize("native", ["1", "0"])
def test_auto_precision_resolves_to_what_the_machine_runs_natively(tmp_path, monkeypatch, native):
    """The default's 'auto' precisions become bf16 where the machine runs bf16 natively and fp32
    where it does not (an AVX2-only CPU: bf16 products 55x slower there), when the parameters are
    read: the frozen parameters hold what ran. What a profile names explicitly is kept."""
    from rlxf_utils.config.precision import native_bf16
    from rlxf_utils.models.generation import autocast

    monkeypatch.setenv("RLXF_NATIVE_BF16", native)
    assert native_bf16("cpu") is (native == "1")
    raw = yaml.safe_load((ROOT / "params" / "default.yaml").read_text())
    assert (raw["policy"]["autocast"], raw["reward"]["train_precision"],
            raw["reward"]["score_precision"]) == ("auto", "auto", "auto")  # fmt: skip
    cfg = load_config(ROOT / "params" / "smoke.yaml")
    got = (cfg.policy.autocast, cfg.reward.train_precision, cfg.reward.score_precision)
    assert got == (("bfloat16", "bf16", "bf16") if native == "1" else (None, "fp32", "fp32"))
    frozen = cfg.resolved()
    assert (frozen["policy"]["autocast"], frozen["reward"]["train_precision"],
            frozen["reward"]["score_precision"]) == got  # fmt: skip
    assert load_config(write_params(tmp_path, lambda r: None)).policy.autocast == got[0]
    explicit = write_params(tmp_path, lambda r: r["reward"].update(train_precision="bf16"))
    assert load_config(explicit).reward.train_precision == "bf16"  # as written, on any machine
    mpnet = write_params(tmp_path, lambda r: r["reward"]["compare_encoders"][0].update(
        train_precision="auto"))  # fmt: skip
    assert load_config(mpnet).reward.compare_encoders[0].train_precision == got[1]
    with autocast("auto", "cpu"):  # a PolicyConfig read alone: resolved where it is used
        import torch

        x = torch.ones(2, 2) @ torch.ones(2, 2)
    assert x.dtype == (torch.bfloat16 if native == "1" else torch.float32)
    monkeypatch.setenv("RLXF_NATIVE_BF16", "yes")
    with pytest.raises(ValueError, match="RLXF_NATIVE_BF16='yes': expected '0' or '1'"):
        native_bf16("cpu")


def test_the_profiles_besides_default_extend_it() -> None:
    for name in ("smoke", "paper", "full"):
        raw = yaml.safe_load((ROOT / "params" / f"{name}.yaml").read_text())
        assert raw["extends"] == "default.yaml", name


def test_full_extends_default_and_lists_only_its_changes() -> None:
    full, default = (
        load_config(ROOT / "params/full.yaml"),
        load_config(ROOT / "params/default.yaml"),
    )
    from rlxf_utils.algorithms import ALGORITHMS

    assert set(full.rl.algorithm) == set(ALGORITHMS)  # every algorithm the study has
    assert full.rl.steps > default.rl.steps
    assert full.ilhf.particles > default.ilhf.particles
    # everything full.yaml does not name is default.yaml's
    assert full.rlgf == default.rlgf and full.sft == default.sft
    assert full.reward.model_dump(exclude={"compare_encoders"}) == default.reward.model_dump(
        exclude={"compare_encoders"}
    )
    # full trains the BERT-base-sized encoder on every protocol; the default, for its time, none
    ((mp_full,), default_compared) = full.reward.compare_encoders, default.reward.compare_encoders
    assert mp_full.encoder == "embedded:mpnet"
    assert full.reward.encoder_protocols(mp_full) == full.reward.protocols
    assert default_compared == []
    assert full.rl.model_dump(
        exclude={"algorithm", "steps", "checkpoint_every", "sample_every"}
    ) == (default.rl.model_dump(exclude={"algorithm", "steps", "checkpoint_every", "sample_every"}))


def test_extends_merges_sections_and_reports_loops(tmp_path: Path) -> None:
    base = write_params(tmp_path, lambda raw: None)
    child = tmp_path / "child.yaml"
    child.write_text("extends: p.yaml\nrun: {name: child}\nrl: {steps: 7}\n")
    cfg = load_config(child)
    assert cfg.run.name == "child" and cfg.rl.steps == 7
    assert cfg.run.seed == load_config(base).run.seed  # the rest of `run` comes from the parent
    assert cfg.rl.algorithm == load_config(base).rl.algorithm
    loop = tmp_path / "loop.yaml"
    loop.write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(loop)
    missing = tmp_path / "orphan.yaml"
    missing.write_text("extends: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="key 'extends': file not found"):
        load_config(missing)


def test_a_profile_elsewhere_inherits_its_parents_paths(tmp_path: Path) -> None:
    """Relative file paths a parent sets are read from the parent's folder; the child's own from
    the child's."""
    elsewhere = tmp_path / "mine"
    elsewhere.mkdir()
    child = elsewhere / "child.yaml"
    child.write_text(f"extends: {PROJECT_ROOT / 'params' / 'default.yaml'}\nrun: {{name: c}}\n")
    cfg, default = load_config(child), load_config(PROJECT_ROOT / "params" / "default.yaml")
    assert cfg.data.path == default.data.path and cfg.data.path.is_file()
    assert cfg.risk.regions_path == default.risk.regions_path
    (elsewhere / "regions.csv").write_text("country,region\nX,Y\n")
    child.write_text(child.read_text() + "risk: {regions_path: regions.csv}\n")
    assert load_config(child).risk.regions_path == (elsewhere / "regions.csv").resolve()


def test_guided_algorithms_need_the_guide_the_sft_stage_trains(tmp_path: Path) -> None:
    def mutate(raw):
        raw["sft"]["enabled"] = False
        raw["rl"]["start_policy"] = "base"
        raw["rl"]["algorithm"] = ["ppo", "d2lols"]

    with pytest.raises(ConfigError, match="needs the guide"):
        load_config(write_params(tmp_path, mutate))


@pytest.mark.parametrize("key, value", [("temperature", 0.7), ("top_p", 0.9)])
def test_sampling_must_be_the_distribution_kl_is_computed_for(tmp_path: Path, key, value) -> None:
    p = write_params(tmp_path, lambda r: r["rl"].update({key: value}))
    with pytest.raises(ConfigError, match=rf"'{key}': {value}.*expected rl.temperature: 1.0"):
        load_config(p)


def test_rl_seed_defaults_to_the_run_seed(tmp_path: Path) -> None:
    cfg = load_config(write_params(tmp_path, lambda r: None))
    assert cfg.rl.seed is None and cfg.training_seed == cfg.run.seed
    cfg = load_config(write_params(tmp_path, lambda r: r["rl"].update(seed=7)))
    assert cfg.training_seed == 7 and cfg.run.seed != 7


def test_unknown_key_names_file_key_and_allowed(tmp_path: Path) -> None:
    p = write_params(tmp_path, lambda r: r["data"]["splits"].update(test_fracton=0.3))
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert str(p) in msg
    assert "data.splits.test_fracton" in msg
    assert "unknown key" in msg and "test_fraction" in msg


@pytest.mark.parametrize("key", ["warmup_ratio", "weight_decay", "max_grad_norm"])
def test_sft_has_no_optimiser_of_its_own(tmp_path: Path, key: str) -> None:
    """SFT's old AdamW settings are refused, pointing at the one optimiser (rl.optimizer)."""
    p = write_params(tmp_path, lambda r: r["sft"].update({key: 0.1}))
    with pytest.raises(ConfigError, match=rf"sft\.{key} is no longer a setting.*rl\.optimizer"):
        load_config(p)


def test_unknown_top_level_section(tmp_path: Path) -> None:
    p = write_params(tmp_path, lambda r: r.update(rewrd={"epochs": 1}))
    with pytest.raises(ConfigError, match=r"'rewrd': unknown key; expected one of: .*data"):
        load_config(p)


@pytest.mark.parametrize("value", [0.0, 1.0, 1.5, -0.2])
def test_test_fraction_outside_unit_interval(tmp_path: Path, value: float) -> None:
    p = write_params(tmp_path, lambda r: r["data"]["splits"].update(test_fraction=value))
    with pytest.raises(ConfigError, match=r"data\.splits\.test_fraction.*(greater|less) than"):
        load_config(p)


def test_wrong_type(tmp_path: Path) -> None:
    p = write_params(tmp_path, lambda r: r["run"].update(seed="many"))
    with pytest.raises(ConfigError, match=r"run\.seed.*valid integer.*'many'"):
        load_config(p)


def test_negative_seed_and_rows(tmp_path: Path) -> None:
    p = write_params(tmp_path, lambda r: (r["run"].update(seed=-1), r["data"].update(max_rows=0)))
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert "run.seed" in str(ei.value) and "data.max_rows" in str(ei.value)


def test_missing_data_file(tmp_path: Path) -> None:
    p = write_params(tmp_path, lambda r: r["data"].update(path="nowhere/MONA.csv"))
    with pytest.raises(ConfigError, match=r"data\.path.*not found.*nowhere"):
        load_config(p)


def test_missing_regions_file(tmp_path: Path) -> None:
    p = write_params(tmp_path, lambda r: r["risk"].update(regions_path="nowhere/regions.csv"))
    with pytest.raises(ConfigError, match=r"risk\.regions_path.*not found.*country,region"):
        load_config(p)


def test_table3_prompt_needs_a_country_placeholder(tmp_path: Path) -> None:
    bad = [{"prompt": "A reform for Kenya should", "econ_descriptor": "1.1. Revenue measures"}]
    p = write_params(tmp_path, lambda r: r["evaluation"].update(table3_scenarios=bad))
    with pytest.raises(ConfigError, match=r"evaluation\.table3_scenarios\.0\.prompt.*\{country\}"):
        load_config(p)


def test_relative_data_path_is_read_from_params_folder(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "m.csv").write_text("x")
    p = write_params(tmp_path, lambda r: r["data"].update(path="d/m.csv", sha256=None))
    assert load_config(p).data.path == (tmp_path / "d" / "m.csv").resolve()


def test_missing_section_and_empty_file(tmp_path: Path) -> None:
    p = write_params(tmp_path, lambda r: r.pop("run"))
    with pytest.raises(ConfigError, match=r"'run': required but missing"):
        load_config(p)
    e = tmp_path / "empty.yaml"
    e.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        load_config(e)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml")


def test_label_sets_must_be_disjoint(tmp_path: Path) -> None:
    p = write_params(tmp_path, lambda r: r["data"]["labels"].update(met=["M", "sb"]))
    with pytest.raises(ConfigError, match=r"\['SB'\].*both"):
        load_config(p)


def test_bad_sha_format(tmp_path: Path) -> None:
    p = write_params(tmp_path, lambda r: r["data"].update(sha256="abc"))
    with pytest.raises(ConfigError, match=r"data\.sha256"):
        load_config(p)


def test_every_parameter_has_a_docstring() -> None:
    """Each field of every section says what it is (`use_attribute_docstrings`: the line under
    the field, as CleanRL's Args)."""
    import inspect

    from rlxf_utils import config

    sections = [
        c for c in vars(config).values() if inspect.isclass(c) and issubclass(c, config.Section)
    ]
    assert len(sections) > 10
    bare = [f"{c.__name__}.{n}" for c in sections for n, f in c.model_fields.items()
            if not (f.description and len(f.description) > 10)]  # fmt: skip
    assert not bare, bare


SMOKE = ROOT / "params" / "smoke.yaml"


def test_a_key_twice_is_refused_naming_it_and_its_lines(tmp_path: Path) -> None:
    """YAML keeps the last of two `data:` blocks without a word: the run read another file."""
    p = tmp_path / "p.yaml"
    p.write_text(
        f"extends: {SMOKE}\ndata:\n  max_rows: 500\nrun: {{seed: 1}}\ndata:\n  max_rows: 9\n"
    )
    with pytest.raises(ConfigError, match=r"p\.yaml: key 'data' appears twice.*lines 2 and 5"):
        load_config(p)
    p.write_text(f"extends: {SMOKE}\nrun: {{seed: 1, seed: 2}}\n")
    with pytest.raises(ConfigError, match=r"key 'seed' appears twice"):
        load_config(p)


def test_an_alias_bomb_is_refused_at_once_with_a_short_message(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 30)]
    p = tmp_path / "bomb.yaml"
    p.write_text(f"extends: {SMOKE}\n" + "\n".join(lines) + "\nrun: {seed: *a29}\n")
    with pytest.raises(
        ConfigError, match=r"bomb\.yaml: line 3: alias \*a0: anchors and aliases"
    ) as e:
        load_config(p)
    assert len(str(e.value)) < 300


def test_a_bad_value_is_quoted_short(tmp_path: Path) -> None:
    p = tmp_path / "p.yaml"
    p.write_text(
        f"extends: {SMOKE}\nrun: {{seed: '{'9x' * 50_000}'}}\nrl: {{steps: {list(range(10_000))}}}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "key 'run.seed'" in msg and "key 'rl.steps'" in msg and len(msg) < 600, msg
    assert "9x9x" in msg and "..." in msg


def test_a_folder_or_a_fifo_is_not_called_missing(tmp_path: Path) -> None:
    import os

    with pytest.raises(ConfigError, match=r"a folder, not a file; expected a YAML parameters"):
        load_config(tmp_path)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"fifo\.yaml: not a regular file \(a FIFO"):
        load_config(fifo)
    p = tmp_path / "p.yaml"
    p.write_text(f"extends: {tmp_path}\n")
    with pytest.raises(ConfigError, match=r"key 'extends': a folder, not a file"):
        load_config(p)


def test_the_internal_source_is_no_allowed_key(tmp_path: Path) -> None:
    p = write_params(tmp_path, lambda r: r.update(sorce="x"))
    with pytest.raises(ConfigError, match="unknown key; expected one of") as e:
        load_config(p)
    assert "source" not in str(e.value).split("expected one of:")[1]


@pytest.mark.parametrize(
    ("key", "content", "problem"),
    [
        ("risk.regions_path", "name,area\nKENYA,AFR\n", r"no column\(s\) \['country', 'region'\]"),
        ("risk.regions_path", "country,region\nKENYA,\n", r"empty 'region' on line\(s\) \[2\]"),
        ("risk.regions_path", "country,region\n", "no rows under a header"),
        ("compute.accelerate_config", "- a\n- b\n", "a YAML list, not a mapping"),
        ("compute.accelerate_config", "a: [1,\n", "not valid YAML"),
    ],
)
def test_files_the_parameters_name_are_read_before_any_work(tmp_path, key, content, problem):
    """Their contents were first read after all the training (notebook 05, the RL stage)."""
    section, field = key.split(".")
    f = tmp_path / "named.txt"
    f.write_bytes(content.encode())
    p = write_params(tmp_path, lambda r: r.setdefault(section, {}).update({field: str(f)}))
    with pytest.raises(ConfigError, match=rf"key '{key}': {problem}.* at {f}; expected"):
        load_config(p)


if __name__ == "__main__":  # rewrite the golden parameters (after a deliberate change of a value)
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for profile in PROFILES:
        (GOLDEN / f"{profile.stem}.json").write_text(_resolved_text(profile), encoding="utf-8")
        print(GOLDEN / f"{profile.stem}.json")
