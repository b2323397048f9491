"""The reproduction runner: one study end to end at a tiny size, and the REPRODUCTION.md it renders."""

import json
import os

import ml_collections
import pytest

from focal_jax.eval import reproduce


def test_judge_needs_a_difference_beyond_the_noise():
    assert reproduce.judge(1.0, 1.2, 0.1) == "yes"
    assert reproduce.judge(1.2, 1.0, 0.1) == "no"
    assert reproduce.judge(1.0, 1.05, 0.1) == "unclear"
    assert reproduce.judge(0.9, 0.5, 0.1, lower_is_better=False) == "yes"


def test_runs_from_different_bases_get_their_own_workdirs(tmp_path, monkeypatch):
    """--steps 400 and 401 train different dense bases and retrofits of 200 steps on each: the retrofit trained on
    one base used to be reused on the other."""
    trained = []
    monkeypatch.setattr(reproduce, "train", lambda config, workdir: trained.append(workdir))
    ctx = reproduce.Context(workdirs=str(tmp_path), out=str(tmp_path / "out"))
    for base in ("dense-s400", "dense-s401"):
        config = ml_collections.ConfigDict({"total_steps": 200, "init_from": str(tmp_path / base) + "/"})
        reproduce.run(ctx, "retrofit-K4", config)
    assert [os.path.basename(w) for w in trained] == ["retrofit-K4-from-dense-s400-s200",
                                                       "retrofit-K4-from-dense-s401-s200"]
    reproduce.run(ctx, "dense", ml_collections.ConfigDict({"total_steps": 400, "init_from": None}))
    assert os.path.basename(trained[-1]) == "dense-s400"


def test_one_study_end_to_end(tmp_path):
    out, markdown = tmp_path / "out", tmp_path / "REPRODUCTION.md"
    done = reproduce.main(["--tiny", "--steps", "2", "--eval-batches", "1", "--only", "focus_scratch",
                           "--workdirs", str(tmp_path / "runs"), "--out", str(out), "--markdown", str(markdown)])
    assert done["focus_scratch"] == str(out / "focus_scratch.json"), done
    result = json.loads((out / "focus_scratch.json").read_text())
    assert result["study"] == "focus_scratch" and len(result["claims"]) == 3
    assert all(c["holds"] in ("yes", "no", "unclear", "n/a") for c in result["claims"])
    noise = result["noise"]
    assert noise["spread"] == abs(noise["loss_seed0"] - noise["loss_seed1"]) > 0  # two seeds differ
    for png in result["pngs"].values():
        assert os.path.getsize(out / png) > 1000
    dense = result["tables"]["dense"][0]
    assert dense["form"] == "dense" and abs(dense["perplexity"] - 2.718281828 ** dense["loss"]) < 1e-3 * dense[
        "perplexity"]
    rows = [line for line in markdown.read_text().splitlines() if line.startswith("| ")]
    scratch = [r for r in rows if r.startswith("| focus_scratch |")]
    assert len(scratch) == 3 and all("**" in r for r in scratch)
    assert result["claims"][0]["ours"].replace("|", "\\|") in scratch[0]
    focal = [r for r in rows if r.startswith("| focal |")]
    assert len(focal) == 1 and "not run yet" in focal[0] and "--only focal`" in focal[0]
    # Every run is finished, so a second call would reuse it; rendering alone gives the same table.
    assert all(reproduce.finished(w, 2) for w in result["runs"].values())
    assert not reproduce.finished(str(tmp_path / "runs" / "missing"), 2)
    reproduce.main(["--render-only", "--out", str(out), "--markdown", str(markdown)])
    assert [r for r in markdown.read_text().splitlines() if r.startswith("| ")] == rows


def test_render_lists_the_claims_that_do_not_hold_and_those_within_the_noise(tmp_path):
    """REPRODUCTION.md from hand-written study results: one table row per claim with its verdict, and the two
    summaries name exactly the 'no' claims and exactly the 'unclear' ones."""
    out = tmp_path / "out"
    out.mkdir()
    claims = [reproduce.claim(f"claim {h}", "paper", f"ours {h}", h) for h in ("yes", "no", "unclear", "n/a")]
    study = {"study": "focal", "title": "t", "command": "cmd", "steps": 4, "tiny": True, "date": "today",
             "claims": claims, "noise": {"loss_seed0": 1.0, "loss_seed1": 1.5, "spread": 0.5}, "pngs": {}}
    (out / "focal.json").write_text(json.dumps(study))
    markdown = tmp_path / "REPRODUCTION.md"
    text = open(reproduce.render(str(out), str(markdown))).read()
    rows = [line for line in text.splitlines() if line.startswith("| focal |")]
    assert [row.split(" | ")[4] for row in rows] == ["**yes**", "**no**", "**unclear**", "**n/a**"]
    lines = text.splitlines()
    assert "**Where the direction does not hold at our scale** ('no'): focal: claim no." in lines
    assert "**Within the noise** ('unclear'): focal: claim unclear." in lines


def test_help_gives_the_whole_first_sentence(capsys):
    """`--help` ended "... evaluates, plots, and writes": the description was the docstring's first line only."""
    with pytest.raises(SystemExit) as info:
        reproduce.main(["--help"])
    assert info.value.code == 0
    assert "plots, and writes REPRODUCTION.md." in " ".join(capsys.readouterr().out.split())
