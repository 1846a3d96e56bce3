"""`asyncrl launch` with each weight transport (weights.transport = shards | broadcast), shortened:
the job finishes, every generator acks every published version, and broadcast versions really went
over the group (with catch-up shards announced after each)."""

from __future__ import annotations

import pytest

from tests.conftest import read_records

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("transport", ["shards", "broadcast"])
def test_short_job_runs_with_each_transport(run_short_job, transport: str) -> None:
    _, run_dir = run_short_job(
        f"weights.transport={transport}",
        "generators.num_generators=2",
        "weights.inflight=retract",
        name=transport,
    )
    publishes = read_records(run_dir, "publish")
    assert sorted({p["version"] for p in publishes if p["transport"] == transport}) == [1, 2, 3]
    if transport == "broadcast":
        catchups = [p for p in publishes if p["transport"] == "shards"]
        assert sorted(p["version"] for p in catchups) == [1, 2, 3]
        assert all(p["catchup"] for p in catchups)
    loaded = read_records(run_dir, "loaded")
    for gen in ("gen-0", "gen-1"):
        versions = [r["version"] for r in loaded if r["generator_id"].startswith(gen)]
        assert versions == sorted(versions) and versions[-1] == 3, (gen, versions)
    metrics = [r for r in read_records(run_dir, "metrics") if "gen/weights_load_errors" in r]
    assert metrics and all(r["gen/weights_load_errors"] == 0 for r in metrics)
