"""The KV cache's budget as startup computes it (handlers/engine/kv_budget.py), over a fake
cgroup directory: cgroup v2's memory.max/memory.current/memory.stat, v1's files, no limit; each
setting's rule, and the refusals."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from handlers.config import ConfigError, load_config, parse_args
from handlers.engine.kv_budget import HEADROOM_BYTES, MARGIN, kv_budget
from handlers.engine.memory import Memory, available_memory, memory, revoke

GIB = 1 << 30


@pytest.fixture(autouse=True)
def no_grants_left(monkeypatch):
    """Each test's budgets are granted in a ledger of its own."""
    monkeypatch.setattr("handlers.engine.memory._granted", {})


def config(tmp_path: Path, *options: str, env: dict[str, str] | None = None):
    argv = ["--model-dir", str(tmp_path)]
    for option in options:
        argv += ["--option", option]
    return load_config(parse_args(argv), env=env or {})


def roomy() -> None:
    """The fake limits below leave less than the machine has: theirs decide."""
    machine = psutil.virtual_memory()
    if machine.available < 3 * GIB:
        pytest.skip("the machine has less memory available than the fake cgroups allow")


def cgroup_v2(root: Path, limit: str, current: int, inactive: int = 0) -> Path:
    root.mkdir(exist_ok=True)
    (root / "memory.max").write_text(f"{limit}\n")
    (root / "memory.current").write_text(f"{current}\n")
    (root / "memory.stat").write_text(f"anon 1\ninactive_file {inactive}\nactive_file 5\n")
    return root


def test_cgroup_v2_limit_less_its_usage_is_what_is_available(tmp_path):
    """Usage counts the page cache; its inactive part is reclaimable, so it is not used."""
    roomy()
    group = cgroup_v2(tmp_path / "cg", str(2 * GIB), current=GIB, inactive=GIB // 4)
    assert memory(group) == Memory(total=2 * GIB, available=GIB + GIB // 4)


def test_cgroup_v1_files_are_read_too(tmp_path):
    group = tmp_path / "cg"
    (group / "memory").mkdir(parents=True)
    (group / "memory" / "memory.limit_in_bytes").write_text(f"{GIB}\n")
    (group / "memory" / "memory.usage_in_bytes").write_text(f"{GIB // 2}\n")
    (group / "memory" / "memory.stat").write_text(f"total_inactive_file {GIB // 4}\n")
    roomy()
    assert memory(group) == Memory(total=GIB, available=GIB - GIB // 4)


def test_no_limit_or_no_cgroup_is_the_machines_memory(tmp_path):
    for group in (cgroup_v2(tmp_path / "cg", "max", current=GIB), tmp_path / "absent"):
        assert memory(group).total == psutil.virtual_memory().total


def test_option_kv_cache_memory_bytes_is_the_budget(tmp_path):
    budget = kv_budget(config(tmp_path, "option.kv_cache_memory_bytes=123456"), tmp_path)
    assert budget.bytes == 123456
    assert budget.source == "option.kv_cache_memory_bytes=123456, command line"


def test_vllm_cpu_kvcache_space_sets_it_in_gib_and_0_means_unset(tmp_path):
    given = config(tmp_path, env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    assert kv_budget(given, tmp_path).bytes == 2 * GIB
    assert "env VLLM_CPU_KVCACHE_SPACE" in kv_budget(given, tmp_path).source
    assert config(tmp_path, env={"VLLM_CPU_KVCACHE_SPACE": "0"}).kv_cache_memory_bytes is None
    with pytest.raises(ConfigError, match="VLLM_CPU_KVCACHE_SPACE"):
        config(tmp_path, env={"VLLM_CPU_KVCACHE_SPACE": "lots"})


def test_gpu_memory_utilization_is_a_share_of_the_limit_less_what_the_process_holds(tmp_path):
    group = cgroup_v2(tmp_path / "cg", str(4 * GIB), current=GIB)
    budget = kv_budget(config(tmp_path, "option.gpu_memory_utilization=0.5"), group,
                       used=GIB // 2)
    assert budget.bytes == 2 * GIB - GIB // 2
    assert "option.gpu_memory_utilization=0.5 (command line)" in budget.source


def test_a_share_the_weights_already_fill_or_more_than_is_free_stops_startup(tmp_path):
    group = cgroup_v2(tmp_path / "cg", str(4 * GIB), current=3 * GIB)
    with pytest.raises(ConfigError, match="no memory is left"):
        kv_budget(config(tmp_path, "option.gpu_memory_utilization=0.25"), group, used=GIB)
    with pytest.raises(ConfigError, match="lower option.gpu_memory_utilization"):
        kv_budget(config(tmp_path, "option.gpu_memory_utilization=1"), group, used=GIB // 2)


def test_both_settings_given_stop_startup(tmp_path):
    both = config(tmp_path, "option.kv_cache_memory_bytes=1000",
                  "option.gpu_memory_utilization=0.5")
    with pytest.raises(ConfigError, match="give one of them"):
        kv_budget(both, tmp_path)


def test_by_default_the_memory_left_less_a_margin(tmp_path):
    roomy()
    group = cgroup_v2(tmp_path / "cg", str(3 * GIB), current=GIB)
    budget = kv_budget(config(tmp_path), group)
    assert budget.bytes == int(2 * GIB * (1 - MARGIN)) - HEADROOM_BYTES
    assert "2.00 GiB available once loaded" in budget.source
    assert "option.kv_cache_memory_bytes" in budget.source  # how to set it instead


def test_nothing_left_once_loaded_stops_startup(tmp_path):
    group = cgroup_v2(tmp_path / "cg", str(GIB), current=GIB - (100 << 20))
    with pytest.raises(ConfigError, match="no memory is left for the KV cache"):
        kv_budget(config(tmp_path), group)


def test_a_granted_budget_is_left_out_of_the_next_budget_and_the_fleets_room(tmp_path):
    """Two models of one process (the fleet's): the first's budget, sized by its setting, is
    its memory from then on, though not yet written, so the second's budget and the fleet's
    loader do not count it as free; it is free again once the first engine is gone."""
    roomy()
    group = cgroup_v2(tmp_path / "cg", str(3 * GIB), current=GIB)
    first = kv_budget(config(tmp_path, f"option.kv_cache_memory_bytes={GIB // 2}"), group)
    try:
        assert available_memory(group) == 2 * GIB - first.bytes
        second = kv_budget(config(tmp_path), group)
        assert second.grant is None
        assert second.bytes == int((2 * GIB - first.bytes) * (1 - MARGIN)) - HEADROOM_BYTES
    finally:
        revoke(first.grant)
    assert available_memory(group) == 2 * GIB


def test_the_default_budget_sets_nothing_aside(tmp_path):
    """Unsized, a budget bounds its own engine only: models loaded after it (a multi-model
    endpoint's) see the memory as it is, not a tenth of it."""
    roomy()
    group = cgroup_v2(tmp_path / "cg", str(3 * GIB), current=GIB)
    budget = kv_budget(config(tmp_path), group)
    assert budget.grant is None and budget.bytes > 0
    assert available_memory(group) == 2 * GIB


def test_more_bytes_than_are_available_is_taken_with_a_warning(tmp_path, caplog):
    roomy()
    group = cgroup_v2(tmp_path / "cg", str(2 * GIB), current=GIB)
    budget = kv_budget(config(tmp_path, f"option.kv_cache_memory_bytes={3 * GIB}"), group)
    assert budget.bytes == 3 * GIB
    assert "is more than the 1.00 GiB available now" in caplog.text
