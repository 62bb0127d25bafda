"""The paper suite's derived figures (issue 26, part 4): the modelled wait ratio beside the
wall-clock one, by hand and on the committed results.  No Redis, no processes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rolloutpipe.bench.paper import derive, rederive, worker_split
from rolloutpipe.bench.paper_report import mode_table, suite_table

ROOT = Path(__file__).resolve().parents[2]


def setting() -> dict:
    # two steps; the trainer's modelled work is 4 s in both; sync takes 10 s, cgp-fgd 8 s, and
    # cgp-fgd's measured busy time is inflated (wall-clock wait 0.3 where the model says 0.5)
    per_step = {
        "sync": {1: {"r2t": 10.0, "wait": 0.6}, 2: {"r2t": 10.0, "wait": 0.6}},
        "cgp-fgd": {1: {"r2t": 8.0, "wait": 0.3}, 2: {"r2t": 8.0, "wait": 0.3}},
        "fast": {1: {"r2t": 3.0, "wait": 0.0}, 2: {"r2t": 3.0, "wait": 0.0}},  # under the model's work
    }
    bound = {k: {"r2t": 6.0, "wait": 1 - 4 / 6, "terms": {"train_busy": 4.0}} for k in (1, 2)}
    return {"steps": [1, 2], "per_step": per_step, "bound_per_step": bound,
            "modes": {m: {} for m in per_step}}  # fmt: skip


def test_the_modelled_wait_ratio_is_r2t_less_the_modelled_work_by_hand() -> None:
    s = setting()
    derive(s)
    m = s["modes"]
    assert m["sync"]["trainer_wait_ratio_modelled"] == pytest.approx(0.6)  # 1 - 4/10
    assert m["cgp-fgd"]["trainer_wait_ratio_modelled"] == pytest.approx(0.5)  # 1 - 4/8, not the measured 0.3
    assert m["fast"]["trainer_wait_ratio_modelled"] == 0.0  # clamped: a step shorter than its work
    assert m["cgp-fgd"]["wait_ratio_modelled_reduction_vs_sync"][0] == pytest.approx(1 - 0.5 / 0.6)
    # the wall-clock one: 1 - 0.3/0.6
    assert m["cgp-fgd"]["wait_ratio_reduction_vs_sync"][0] == pytest.approx(0.5)
    # the bound's wait against sync's modelled wait
    assert s["achievable_wait_cut_modelled"][0] == pytest.approx(1 - (1 - 4 / 6) / 0.6)


def test_the_kv_guards_gain_is_the_ablation_less_fgd_over_sync_paired_by_step() -> None:
    s = setting()
    s["per_step"]["cgp"] = {1: {"r2t": 9.0, "wait": 0.5}, 2: {"r2t": 9.0, "wait": 0.5}}
    s["per_step"]["fgd-no-kvguard"] = {1: {"r2t": 9.0, "wait": 0.5}, 2: {"r2t": 10.0, "wait": 0.5}}
    s["modes"] = {m: {} for m in s["per_step"]}
    derive(s)
    assert s["kv_guard_gain"][0] == pytest.approx(0.15)  # (9 - 8) / 10 and (10 - 8) / 10
    assert s["fgd_minus_cgp"][0] == pytest.approx(0.1)
    del s["per_step"]["fgd-no-kvguard"], s["kv_guard_gain"]
    derive(s)
    assert "kv_guard_gain" not in s  # no ablation run, no figure


def test_the_critical_rules_gain_is_the_ablation_less_fgd_over_sync_paired_by_step() -> None:
    s = setting()
    s["per_step"]["cgp"] = s["per_step"]["cgp-fgd"]
    s["per_step"]["fgd-no-critical"] = {1: {"r2t": 7.0, "wait": 0.5}, 2: {"r2t": 9.0, "wait": 0.5}}
    s["modes"].update({"cgp": {}, "fgd-no-critical": {}})
    derive(s)
    assert s["critical_gain"][0] == pytest.approx(0.0)  # (7 - 8) / 10 and (9 - 8) / 10
    assert s["critical_gain"][1] < 0 < s["critical_gain"][2]


def test_the_critical_rules_gain_is_fgd_critical_against_the_default_once_the_rule_is_off() -> None:
    """The rule is off by default now: its gain is cgp-fgd (off) less fgd-critical (on), over sync."""
    s = setting()
    s["per_step"]["cgp"] = s["per_step"]["cgp-fgd"]  # r2t 8 in both steps
    s["per_step"]["fgd-critical"] = {1: {"r2t": 9.0, "wait": 0.5}, 2: {"r2t": 10.0, "wait": 0.5}}
    s["modes"].update({"cgp": {}, "fgd-critical": {}})
    derive(s)
    assert s["critical_gain"][0] == pytest.approx(-0.15)  # (8 - 9) / 10 and (8 - 10) / 10: it loses


def test_the_suite_table_shows_the_kv_guards_gain_where_the_ablation_ran(tmp_path: Path) -> None:
    path = tmp_path / "paper.json"
    shutil.copy(ROOT / "docs/results/paper.json", path)
    one = rederive(path)[0]
    assert "fgd-no-kvguard" not in suite_table([one])
    # the ablation as cgp's steps, on a KV-limited run: the gain is cgp's lead over cgp-fgd
    one["per_step"]["fgd-no-kvguard"] = one["per_step"]["cgp"]
    one["modes"]["fgd-no-kvguard"] = dict(one["modes"]["cgp"])
    one["kv_cache_tokens"] = 600_000
    derive(one)
    assert one["kv_guard_gain"] == pytest.approx(one["fgd_minus_cgp"])
    head, _, row = suite_table([one]).splitlines()[:3]
    g = one["kv_guard_gain"]
    assert head.endswith("| fgd - fgd-no-kvguard (points) |")
    assert row.endswith(f"| {g[0] * 100:+.1f} [{g[1] * 100:+.1f}, {g[2] * 100:+.1f}] |")


def test_rederiving_the_committed_results_reproduces_every_stored_figure(tmp_path: Path) -> None:
    """docs/results/paper.json was derived when it was measured; deriving it again with this code
    must give the same wall-clock figures (derive is unchanged for them) and adds the modelled ones."""
    path = tmp_path / "paper.json"
    shutil.copy(ROOT / "docs/results/paper.json", path)
    before = json.loads(path.read_text())
    settings = rederive(path, write=True)
    text = suite_table(settings)
    after = json.loads(path.read_text())
    assert "modelled" in text
    one = after["settings"][0]
    assert one["name"] in text and "wait ratio (modelled)" in mode_table(one)  # the quick bench's table
    for b, a in zip(before["settings"], after["settings"], strict=True):
        for key in ("achievable_cut", "achievable_wait_cut", "wait_bound"):
            assert a[key] == pytest.approx(b[key]), (b["name"], key)
        for mode, bm in b["modes"].items():
            am = a["modes"][mode]
            for key in ("reduction_vs_sync", "wait_ratio_reduction_vs_sync", "share_of_cut"):
                assert am[key] == pytest.approx(bm[key]), (b["name"], mode, key)
            assert 0.0 <= am["trainer_wait_ratio_modelled"] < 1.0
        # sync's modelled busy time is its model, which the measured busy time exceeds a little:
        # its modelled wait is at least its wall-clock wait, less a per-cent of noise
        sync = a["modes"]["sync"]
        assert sync["trainer_wait_ratio_modelled"] >= sync["trainer_wait_ratio"] - 0.01, b["name"]


def test_worker_split_is_the_busiest_workers_tokens_over_an_even_split(tmp_path: Path) -> None:
    def row(worker: str, tokens: int) -> list:
        return [worker, 0.0, 1.0, 8, tokens, []]  # worker, admitted, finished, prompt, response, kv

    steps = [
        {"step": 1, "groups": [{"samples": [row("w0", 30), row("w1", 10)]}, {"samples": [row("w0", 60)]}]},
        {"step": 2, "groups": [{"samples": [row("w1", 50), row("w0", 50)]}]},
        {"step": 3, "groups": [{"samples": [row("w0", 5), row("w0", 5)]}]},  # w1 ran nothing
        {"step": 4, "groups": []},
    ]
    path = tmp_path / "timeline.jsonl"
    path.write_text("\n".join(json.dumps(s) for s in steps))
    split = worker_split(path, workers=2)
    assert split == {1: pytest.approx(90 / 100 * 2), 2: pytest.approx(1.0), 3: pytest.approx(2.0)}


def test_adopting_workloads_checks_every_steps_bound_and_changes_nothing_on_a_mismatch() -> None:
    """adopt_workloads takes another run's per-step workloads only where they reproduce the bound
    stored at measurement time, with the suite's own models for the named trainer."""
    from rolloutpipe.bench.bound import r2t_bound
    from rolloutpipe.bench.paper import adopt_workloads, load_suite, models, pack_workload
    from rolloutpipe.config import load_config

    base, specs, _ = load_suite("paper")
    over = {n: o for n, o, _ in specs}
    eng, tr = models(load_config(base, over["gsm8k-b32-n8-mb2-lean"], environ={}))
    work = {k: [[(256, 100 + 37 * g + 11 * s + k) for s in range(8)] for g in range(32)] for k in (1, 2)}
    stored = {k: {"r2t": r2t_bound(w, eng, tr).r2t} for k, w in work.items()}
    packed = {str(k): pack_workload(w) for k, w in work.items()}
    source = {"settings": [{"name": "gsm8k-b32-n8-mb2-slime", "workload": "gsm8k-b32-n8-mb2",
                            "workload_per_step": packed}]}  # fmt: skip
    doc = {"settings": [{"name": "gsm8k-b32-n8-mb2", "steps": [1, 2], "bound_per_step": stored}]}
    adopt_workloads(doc, source, "lean")
    s = doc["settings"][0]
    assert s["trainer"] == "lean" and s["models"]["trainer"]["passes"] == 1.0
    assert set(s["workload_per_step"]) == {1, 2}
    # slime's models give another bound for the same lengths: refused, and nothing changed
    doc2 = {"settings": [{"name": "gsm8k-b32-n8-mb2", "steps": [1, 2], "bound_per_step": stored}]}
    with pytest.raises(ValueError, match="nothing adopted"):
        adopt_workloads(doc2, source, "slime")
    assert doc2 == {"settings": [{"name": "gsm8k-b32-n8-mb2", "steps": [1, 2], "bound_per_step": stored}]}
    # one response a token longer in step 2: refused
    source["settings"][0]["workload_per_step"]["2"]["response"][5][3] += 400
    with pytest.raises(ValueError, match="step 2"):
        doc3 = {"settings": [{"name": "gsm8k-b32-n8-mb2", "steps": [1, 2], "bound_per_step": stored}]}
        adopt_workloads(doc3, source, "lean")


def test_the_kv_suite_is_the_paper_suite_with_the_cache_on_for_every_setting() -> None:
    """paper-kv.yaml's ``overrides`` reach every setting, after the workload's keys and before the
    trainer's, and its settings are paper.yaml's (slime's trainer)."""
    from rolloutpipe.bench.paper import load_suite
    from rolloutpipe.config import load_config

    base, paper, _ = load_suite("paper")
    _, kv, modes = load_suite("paper-kv")
    assert [n for n, _, _ in kv] == [n for n, _, t in paper if t == "slime"]
    assert "sync" in modes and "cgp-fgd" in modes
    for name, over, trainer in kv:
        e = load_config(base, over, environ={}).rollout.emulated
        assert (e.kv_cache_tokens, e.kv_block_tokens, e.preemption) == (600_000, 16, "vllm"), name
        assert over.index("rollout.emulated.kv_cache_tokens=600000") < over.index("trainer.kl_coef=0.001")
        assert trainer == "slime"
    # the workload's lengths stand: olympiad's median is olympiad's
    olympiad = next(o for n, o, _ in kv if n.startswith("olympiad"))
    assert load_config(base, olympiad, environ={}).rollout.emulated.length_median == 6000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--suite", "paper-kv", "--only", "nothing-*"], "matches no setting of suite 'paper-kv'"),
        (["bench", "--only", "olympiad-*"], "--only selects settings of a suite"),
        (["bench", "--suite", "broker", "--only", "x"], "--only and --modes select settings and modes of a"),
        (["bench", "--suite", "allocation", "--only", "x"], "--only 'x' matches no regime of"),
        (
            ["bench", "--suite", "allocation", "--modes", "cgp"],
            "--only and --modes select settings and modes of",
        ),
        (
            ["bench", "--suite", "multiplex", "--modes", "cgp"],
            "--only and --modes select settings and modes of",
        ),
        (["bench", "--suite", "paper-kv", "--modes", "cgp,fgd-nope"], "--modes: unknown ['fgd-nope']"),
    ],
)
def test_only_refuses_what_it_cannot_select_before_anything_runs(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from rolloutpipe.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_only_selects_the_settings_that_match_one_of_its_globs() -> None:
    from rolloutpipe.bench.paper import load_suite, select

    _, kv, _ = load_suite("paper-kv")
    names = [n for n, _, _ in select(kv, "competition-b128-*, olympiad-b32-n16-*,olympiad-b128-*")]
    assert names == [
        "competition-b128-n8-mb8-slime",
        "olympiad-b32-n16-mb4-slime",
        "olympiad-b128-n8-mb8-slime",
    ]
    assert select(kv, "") == kv
    assert select(kv, "gsm8k") == []  # a glob matches the whole name


def test_the_kv_runs_get_their_suites_models_only_where_the_stored_bounds_agree() -> None:
    """attach_models gives a KV run measured before the oracle modelled a cache the cost models of
    paper-kv.yaml with the run's cache size; a stored bound that the models do not reproduce stops it."""
    from rolloutpipe.bench.bound import EngineModel, TrainerModel
    from rolloutpipe.bench.oracle import oracle
    from rolloutpipe.bench.paper import attach_models, unpack_workload

    committed = json.loads((ROOT / "docs/results/paper-kv-300k.json").read_text())
    doc = json.loads(json.dumps(committed))
    for s in doc["settings"]:
        del s["models"]
        s["bound_per_step"] = {int(k): v for k, v in s["bound_per_step"].items()}
    attach_models(doc)
    for s, c in zip(doc["settings"], committed["settings"], strict=True):
        assert s["models"] == c["models"] and s["models"]["engine"]["kv_tokens"] == 300_000

    # the committed oracle of one step, recomputed from its workload with those models
    def requests(s: dict) -> int:
        return sum(map(len, s["workload_per_step"][str(s["steps"][0])]["response"]))

    s = min(doc["settings"], key=requests)
    k = str(s["steps"][0])
    eng, tr = EngineModel(**s["models"]["engine"]), TrainerModel(**s["models"]["trainer"])
    o = oracle(unpack_workload(s["workload_per_step"][k]), eng, tr)
    stored = next(c for c in committed["settings"] if c["name"] == s["name"])["oracle_per_step"][k]
    assert (o.r2t, o.schedule, o.preemptions) == (pytest.approx(stored["r2t"]), stored["schedule"],
                                                  stored["preemptions"])  # fmt: skip
    # one stored bound off by 1%: nothing is attached, to any setting
    bad = json.loads(json.dumps(committed))
    for s in bad["settings"]:
        del s["models"]
        s["bound_per_step"] = {int(k): v for k, v in s["bound_per_step"].items()}
    last = bad["settings"][-1]
    last["bound_per_step"][last["steps"][-1]]["r2t"] *= 1.01
    with pytest.raises(ValueError, match="nothing attached"):
        attach_models(bad)
    assert not any("models" in s for s in bad["settings"])


def test_modes_runs_sync_first_and_then_the_modes_asked_once_each() -> None:
    from rolloutpipe.bench.paper import pick_modes

    suite = ("sync", "cgp", "cgp-fgd")
    assert pick_modes(suite, "") == suite
    assert pick_modes(suite, "fgd-critical, cgp-fgd,sync,cgp-fgd") == (
        "sync",
        "fgd-critical",
        "cgp-fgd",
    )
