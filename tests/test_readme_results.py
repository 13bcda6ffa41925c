"""`rlxf publish --run-dir RUN --readme`: the README's results come from one finished run made from
committed code, stamped with what that run recorded (commit, date, profile, machine), and a run
that cannot stand for them (uncommitted changes, no commit, unfinished) is refused by name. Built
from a tiny fake run directory: no study runs here."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from rlxf_utils.cli import main
from rlxf_utils.report.readme import (
    BEGIN,
    END,
    FIGURE,
    RESULTS,
    STAMP,
    TABLE,
    ReadmeError,
    readme_section,
    run_stamp,
    write_readme_results,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
PNG = b"\x89PNG\r\n\x1a\nnot really an image"


def fake_run(root: Path, **manifest: object) -> Path:
    """A finished smoke-profile run with only what `--readme` reads; `manifest` overrides keys."""
    run = root / "smoke"
    for sub in ("tables", "figures", "eval", "report"):
        (run / sub).mkdir(parents=True, exist_ok=True)
    record = {
        "study": "RLXF", "run_name": "smoke", "updated": "2026-12-07T08:21:37+00:00",
        "params_source": "/elsewhere/checkout/params/smoke.yaml",
        "git": {"commit": COMMIT, "dirty": False},
        "data": {"sha256": "ab" * 32},
        "params": {"run": {"name": "smoke", "title": "T", "authors": ["A"], "wp_number": "W"},
                   "data": {"max_rows": 600}, "rl": {"steps": 2}},
        "environment": {"machine": "x86_64", "cpu_count": 2, "memory_gib": 23.5, "cuda": False,
                        "native_bf16": True, "packages": {}},
        "notebooks": [{"name": f"0{i}_x", "status": "ok"} for i in range(1, 6)],
    }  # fmt: skip
    record.update(manifest)
    (run / "manifest.json").write_text(json.dumps(record), encoding="utf-8")
    (run / "report/rlxf_report.html").write_text("<html></html>", encoding="utf-8")
    (run / "figures" / FIGURE).write_bytes(PNG)
    summary = {"start_policy": "sft", "n_prompts": 6, "samples_per_prompt": 2}
    (run / "eval/summary.json").write_text(json.dumps(summary), encoding="utf-8")
    pd.DataFrame({"measure": ["reward", "audit_reward"], "ci_level": [0.997, 0.997]}).to_csv(
        run / "tables/eval_paired.csv", index=False
    )
    pd.DataFrame({
        "method": ["PPO", "best-of-2"], "group": ["RL", "best-of-N"],
        "gain": [0.046, 0.183], "gain_low": [-0.708, -0.55], "gain_high": [0.8, 0.916],
        "audit_gain": [0.067, 0.256], "audit_gain_low": [-1.034, -0.797],
        "audit_gain_high": [1.167, 1.309], "kl": [0.284, 0.193],
        "kl_kind": ["sampled", "upper bound"], "finished": [0.083, 0.333],
        "vs_best_of_n": ["not distinguishable", None],
    }).to_csv(run / "tables/eval_methods.csv", index=False)  # fmt: skip
    return run


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    root.mkdir()
    (root / "README.md").write_text(f"# P\n\n## Found\n\n{BEGIN}\nold\n{END}\n\n## Next\n")
    return root


def test_the_results_and_their_stamp_come_from_the_run(tmp_path: Path, checkout: Path) -> None:
    run = fake_run(tmp_path)
    res = write_readme_results(run, checkout)
    out = checkout / RESULTS
    assert (out / FIGURE).read_bytes() == PNG
    stamp = json.loads((out / STAMP).read_text(encoding="utf-8"))
    assert stamp == res.stamp
    assert {k: stamp[k] for k in ("run", "profile", "commit", "dirty", "date")} == {
        "run": "smoke", "profile": "params/smoke.yaml", "commit": COMMIT, "dirty": False,
        "date": "2026-12-07T08:21:37+00:00"}  # fmt: skip
    assert stamp["machine"] == (
        "x86_64, 2 CPUs, native bf16, 23.5 GiB memory, no GPU (CPU model not recorded)"
    )
    assert (stamp["max_rows"], stamp["rl_steps"], stamp["prompts"], stamp["samples"]) == (600, 2, 6, 2)  # fmt: skip
    assert stamp["level"] == "99.7%"
    table = (out / TABLE).read_text(encoding="utf-8")
    # the report's format of each method's gain under both judges, from the run's CSV
    assert "| PPO | RL | +0.046 \\[-0.708, +0.800\\] | +0.067 \\[-1.034, +1.167\\] |" in table
    assert "share of attainable" not in table  # a column every row leaves empty is dropped
    readme = (checkout / "README.md").read_text(encoding="utf-8")
    assert "old" not in readme and readme.startswith("# P\n\n## Found\n") and readme.endswith("## Next\n")  # fmt: skip
    section = readme.split(BEGIN)[1].split(END)[0]
    assert section.strip() == readme_section(stamp, table).strip()
    assert "commit `0123456`" in section and "2026-12-07" in section
    assert "smoke profile's numbers, not findings" in section
    assert f"]({RESULTS}/{FIGURE})" in section and table.strip() in section


def test_a_default_run_says_so_and_a_run_without_machine_record_says_not_recorded(
    tmp_path: Path,
) -> None:
    run = fake_run(tmp_path, params_source="params/default.yaml", run_name="default",
                   environment={"packages": {}})  # fmt: skip
    stamp = run_stamp(run)
    assert stamp["machine"] == "not recorded" and stamp["profile"] == "params/default.yaml"
    section = readme_section(stamp, "| a |\n|---|\n| b |\n")
    assert section.startswith("The default profile's run (`params/default.yaml`")
    assert "not findings" not in section


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"git": {"commit": COMMIT, "dirty": True}}, "manifest.json: git.dirty is true"),
        ({"git": {"commit": COMMIT}}, "manifest.json: git.dirty is missing"),
        ({"git": {"commit": None, "dirty": False}}, "manifest.json: git.commit is missing"),
        ({"notebooks": [{"name": "04_evaluation", "status": "failed"}]},
         "manifest.json: notebooks: not finished (04_evaluation)"),
        ("no report", "report/rlxf_report.html is missing"),
    ],
)  # fmt: skip
def test_a_run_that_cannot_stand_is_refused_and_nothing_written(
    tmp_path: Path, checkout: Path, change: object, said: str, capsys
) -> None:
    run = fake_run(tmp_path, **(change if isinstance(change, dict) else {}))
    if change == "no report":
        (run / "report/rlxf_report.html").unlink()
    before = (checkout / "README.md").read_text(encoding="utf-8")
    with pytest.raises(ReadmeError, match=said.replace("(", r"\(").replace(")", r"\)")):
        write_readme_results(run, checkout)
    assert not (checkout / RESULTS).exists()
    assert (checkout / "README.md").read_text(encoding="utf-8") == before
    # the command line: exit 2, one line naming the file and the field
    assert main(["publish", "--run-dir", str(run), "--readme", str(checkout)]) == 2
    assert said in capsys.readouterr().err


def test_the_command_writes_them_and_a_readme_without_the_section_is_refused(
    tmp_path: Path, checkout: Path, capsys
) -> None:
    run = fake_run(tmp_path)
    assert main(["publish", "--run-dir", str(run), "--readme", str(checkout)]) == 0
    assert "commit 0123456" in capsys.readouterr().out
    assert json.loads((checkout / RESULTS / STAMP).read_text())["commit"] == COMMIT
    (checkout / "README.md").write_text("# P\n\nno section\n")
    with pytest.raises(ReadmeError, match="README.md: no results section"):
        write_readme_results(run, checkout)


def test_notebooks_reused_from_another_commit_are_named_in_the_stamp(tmp_path: Path) -> None:
    """A run whose notebooks 04 and 05 were rerun at the stamp's commit over 01-03 of an earlier
    run: the stamp names those three, with their commit where the manifest records it."""
    other = "fedcba9876543210fedcba9876543210fedcba98"
    notebooks = [{"name": "01_x", "status": "ok", "how": "reused"},  # from before commits
                 {"name": "02_x", "status": "ok", "how": "reused", "commit": other},
                 {"name": "03_x", "status": "ok", "how": "ran", "commit": f"{other}-dirty"},
                 {"name": "04_x", "status": "ok", "how": "ran", "commit": COMMIT},
                 {"name": "05_x", "status": "ok", "how": "ran"}]  # fmt: skip
    stamp = run_stamp(fake_run(tmp_path, notebooks=notebooks))
    assert [e["name"] for e in stamp["earlier"]] == ["01_x", "02_x", "03_x"]
    section = readme_section(stamp, "| a |\n|---|\n| b |\n")
    assert (
        "Reused from an earlier run and not rerun at that commit: 01_x (commit not "
        "recorded), 02_x (commit fedcba9), 03_x (commit fedcba9 with uncommitted changes)"
    ) in section
    assert "Reused" not in readme_section(run_stamp(fake_run(tmp_path / "b")), "| a |\n")


def test_a_run_that_named_its_cpu_is_stamped_with_it(tmp_path: Path, checkout: Path) -> None:
    from rlxf_utils.pipeline import cpu_model

    info = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
            "model name\t: AMD EPYC\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n\n"
            "processor\t: 1\nmodel name\t: other\n")  # fmt: skip
    assert cpu_model(info) == "AMD EPYC (family 25, model 17; avx2, avx512f, avx512_bf16)"
    assert cpu_model("processor\t: 0\nmodel name\t: Old\nflags\t\t: sse\n") == (
        "Old (none of avx2, avx512f, avx512_bf16, amx_bf16)"
    )
    assert cpu_model("processor\t: 0\n") is None  # no model name: not a guess
    run = fake_run(tmp_path)
    manifest = json.loads((run / "manifest.json").read_text(encoding="utf-8"))
    manifest["environment"]["cpu"] = cpu_model(info)
    (run / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    stamp = write_readme_results(run, checkout).stamp
    assert stamp["machine"] == (
        "AMD EPYC (family 25, model 17; avx2, avx512f, avx512_bf16), 2 CPUs, native bf16, "
        "23.5 GiB memory, no GPU"
    )
