"""`kvplane sim reproduce all --smoke` writes tables and plots (its wall time is printed; speed
is not asserted here: the suite runs on loaded shared hosts)."""

import time

from kvplane.cli import main


def test_reproduce_all_smoke(tmp_path):
    """Every experiment's smoke version runs and writes table.md + PNG + results.json."""
    t0 = time.perf_counter()
    assert main(["sim", "reproduce", "all", "--smoke", "--out", str(tmp_path)]) == 0
    wall = time.perf_counter() - t0
    for name in ("orbitflow-fig8a", "orbitflow-fig14a", "orbitflow-fig14c", "orbitflow-table1",
                 "layerkv-ttft", "superinfer-attainment", "served-admission"):
        d = tmp_path / name
        assert (d / "table.md").read_text().startswith(f"# {name}")
        assert (d / f"{name}.png").stat().st_size > 1000
        assert (d / "results.json").exists()
    print(f"\nsmoke reproduce all: {wall:.1f} s")


def test_sim_run_cli_prints_a_table(capsys, tmp_path):
    """`kvplane sim run` prints the metrics and writes JSON."""
    out = tmp_path / "m.json"
    rc = main(["sim", "run", "--policy", "dynamic-heuristic", "--trace", "orbitflow-32k",
               "--n", "2", "--rate", "2", "--json", str(out)])
    assert rc == 0
    assert "tbt_attainment" in capsys.readouterr().out
    assert out.exists()


def test_sim_cli_bad_policy_is_exit_2(capsys):
    """A bad policy name exits 2 with a message naming the choices."""
    assert main(["sim", "run", "--policy", "nope", "--n", "2"]) == 2
    assert "not one of" in capsys.readouterr().err


def test_sim_trace_cli_writes_a_loadable_trace(tmp_path):
    """`kvplane sim trace` writes JSONL that `load_trace` reads back."""
    from simulator.trace import load_trace

    out = tmp_path / "t.jsonl"
    assert main(["sim", "trace", "--workload", "leval", "--n", "7", "--rate", "3",
                 "--arrival", "gamma", "--cv", "2", "--out", str(out)]) == 0
    assert len(load_trace(out)) == 7


def test_sim_sweep_cli_runs_the_grid(tmp_path, capsys):
    """`kvplane sim sweep` runs policies x rates x scales and writes JSON rows."""
    import json

    out = tmp_path / "s.json"
    assert main(["sim", "sweep", "--policies", "deepspeed,no-offload", "--rates", "2",
                 "--slo-scales", "1,2", "--n", "2", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())) == 4


def test_sim_sweep_names_a_bad_number_list(capsys):
    """`--rates a,b` was "could not convert string to float: 'a'"; now one line naming the flag."""
    assert main(["sim", "sweep", "--policies", "orbitflow", "--rates", "a,b"]) == 2
    assert capsys.readouterr().err.strip() == "kvplane sim: --rates='a,b': expected a comma list of numbers"
    assert main(["sim", "sweep", "--policies", "orbitflow", "--slo-scales", "1,x"]) == 2
    assert "--slo-scales='1,x'" in capsys.readouterr().err


def _served_row(policy, rate, seed, goodput, strict=None):
    return {"policy": policy, "rate_per_min": rate, "seed": seed, "slo_goodput_req_per_min": goodput,
            "slo_goodput_tpot_req_per_min": goodput if strict is None else strict,
            "tbt_attainment": 0.9, "ttft_p99_ms": 1000.0}


def test_served_admission_checks_compare_the_default_with_layerkv_on_the_means_at_every_rate():
    """The served-admission check passes only when fcfs's mean SLO goodput is at least layerkv's at
    every rate; a rate where layerkv's mean is ahead fails it (the control). How many single runs
    fcfs wins is reported, not checked: on held-out seeds it lost some by up to two requests of 100
    (session 90)."""
    from simulator.reproduce import _served_checks

    raw = [_served_row("kvplane-fcfs", r, s, 2.0) for r in (1.0, 2.0) for s in (1, 2)]
    raw += [_served_row("kvplane", r, s, 1.5) for r in (1.0, 2.0) for s in (1, 2)]
    agg = [_served_row(p, r, 0, g) for p, g in (("kvplane-fcfs", 2.0), ("kvplane", 1.5)) for r in (1.0, 2.0)]
    out = _served_checks(agg, raw)
    assert out[-3] == "- fcfs mean SLO goodput >= layerkv's at 2 of 2 rates: PASS"
    assert out[-2] == "- fcfs SLO goodput >= layerkv's on 4 of 4 runs (rate x seed; informational)"
    assert out[-1] == "- fcfs goodput TTFT+TPOT >= layerkv's on 4 of 4 runs (informational)"
    assert out[0].startswith("- 1 req/min: TBT 90.0% (fcfs) vs 90.0% (layerkv)")
    assert out[0].endswith("goodput TTFT+TPOT 2.000 vs 1.500")
    raw[-1] = _served_row("kvplane", 2.0, 2, 2.5)  # one run lost: reported, the means decide
    out = _served_checks(agg, raw)
    assert out[-3].endswith("at 2 of 2 rates: PASS") and out[-2].startswith("- fcfs SLO goodput >= layerkv's on 3 of 4")
    agg[-1] = _served_row("kvplane", 2.0, 0, 2.1)  # layerkv's mean ahead at 2 req/min: the control
    assert _served_checks(agg, raw)[-3] == "- fcfs mean SLO goodput >= layerkv's at 1 of 2 rates: FAIL"
