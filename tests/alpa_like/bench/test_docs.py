"""docs/benchmarks.md regeneration: sections with results are rebuilt, the others kept from the old page."""
from alpa_like.bench import docs, report, suites


def test_a_page_without_results_is_kept_as_it_is():
    page = (docs.HEADER + "\n## " + docs.SUITE_TITLES["gpt"] + "\n\nold gpt table\n\n"
            + docs.MEASURED_HEADING + ": gpt-small on this machine's devices (local)\n\nold measurements\n\n"
            + docs.REPRO_HEADING + "\n\nold repro\n")
    assert docs.build("/nonexistent-results-dir", page) == page


def test_a_suite_with_results_is_rebuilt_and_the_others_kept(tmp_path):
    case = suites.Case(suite="moe", model="moe-tiny", gpus=2, global_batch=8, num_micro_batches=2)
    row = dict(suites.run_case(case, "p3.16xlarge"), command="python -m alpa_like.bench moe --models moe-tiny")
    report.write_json(tmp_path / "bench_moe.json", [row], suite="moe", cluster="p3.16xlarge", backend="simulate")
    old_gpt = "## " + docs.SUITE_TITLES["gpt"] + "\n\nold gpt table\n"
    old_moe = "## " + docs.SUITE_TITLES["moe"] + "\n\nold moe table\n"
    page = docs.build(str(tmp_path), docs.HEADER + "\n" + old_gpt + "\n" + old_moe)
    assert old_gpt in page
    assert "old moe table" not in page
    assert "| moe-tiny | 2 |" in page and "`python -m alpa_like.bench moe --models moe-tiny`" in page
    assert page.index(docs.SUITE_TITLES["gpt"]) < page.index(docs.SUITE_TITLES["moe"])


def test_hand_written_sections_are_kept_after_the_generated_ones(tmp_path):
    notes = "## Notes on the suite\n\n### GPT\n\nwhy the plans win\n"
    scripts = "## Scripts in examples/benchmarks\n\n| a | b |\n"
    old_gpt = "## " + docs.SUITE_TITLES["gpt"] + "\n\nold gpt table\n"
    page = docs.HEADER + "\n" + old_gpt + "\n" + notes + "\n" + scripts
    case = suites.Case(suite="moe", model="moe-tiny", gpus=2, global_batch=8, num_micro_batches=2)
    row = dict(suites.run_case(case, "p3.16xlarge"), command="python -m alpa_like.bench moe --models moe-tiny")
    report.write_json(tmp_path / "bench_moe.json", [row], suite="moe", cluster="p3.16xlarge", backend="simulate")
    for results in ("/nonexistent-results-dir", str(tmp_path)):
        rebuilt = docs.build(results, page)
        assert notes in rebuilt and scripts in rebuilt
        assert rebuilt.index(docs.SUITE_TITLES["gpt"]) < rebuilt.index(notes) < rebuilt.index(scripts)
        assert docs.build(results, rebuilt) == rebuilt


def test_a_measured_section_without_results_is_kept_beside_one_rebuilt(tmp_path):
    """Results of one measured run (gpt on Ray) rebuild its section; another measured section whose JSON is not
    in the results directory (gpt on the local backend, run on another machine) stays as it was, in place."""
    local = docs.MEASURED_HEADING + ": gpt-small on this machine's devices (local)\n\nold local measurements\n"
    ray = docs.MEASURED_HEADING + ": gpt-small on this machine's devices (ray)\n\nold ray measurements\n"
    page = docs.HEADER + "\n" + local + "\n" + ray + "\n" + docs.REPRO_HEADING + "\n\nold repro\n"
    row = {"model": "gpt-small", "method": "PipeshardParallel", "measured_s": 0.3, "predicted_s": 0.5,
           "predicted_over_measured": 1.67, "measured_tflops_per_device": 0.02}
    report.write_json(tmp_path / "bench_gpt_ray.json", [row], suite="gpt", cluster="local", backend="ray")
    rebuilt = docs.build(str(tmp_path), page)
    assert local in rebuilt
    assert "old ray measurements" not in rebuilt and "| PipeshardParallel | 300.0 | 500.00 | 1.67 |" in rebuilt
    assert rebuilt.index("(local)") < rebuilt.index("(ray)") < rebuilt.index(docs.REPRO_HEADING)
