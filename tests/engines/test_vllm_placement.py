"""Placing vLLM's workers, without vLLM: a split the model cannot take is refused naming the
setting before vLLM starts, and on vLLM's CPU build each worker's threads get CPUs of their own
(VLLM_CPU_OMP_THREADS_BIND) unless the user bound them. The servers that run on it are in
tests/e2e/test_vllm_parallel.py (the vLLM lane)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from handlers.config import ConfigError, load_config, parse_args
from handlers.engine.vllm.placement import (
    THREADS_BIND,
    Shape,
    bind_cpu_workers,
    check_cpu_pipeline,
    check_split,
    model_shape,
)


def config(tmp_path, *options: str):
    argv = ["--model-dir", str(tmp_path), "--option", "option.rolling_batch=vllm"]
    for option in options:
        argv += ["--option", option]
    return load_config(parse_args(argv), env={})


def split(tp: int = 1, pp: int = 1) -> dict:
    return {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}


@pytest.mark.parametrize(("cpus", "tp", "pp", "bound"), [
    ([0, 1], 2, 1, "0|1"),
    ([0, 1], 1, 2, "0|1"),
    ([0, 1, 2, 3], 2, 1, "0-1|2-3"),
    ([0, 1, 2, 3, 4, 5, 6, 7], 2, 2, "0-1|2-3|4-5|6-7"),
    ([2, 3, 5], 2, 1, "2-3|5"),
])
def test_each_cpu_worker_gets_cpus_of_its_own(tmp_path, cpus, tp, pp, bound):
    environ: dict[str, str] = {}
    given = config(tmp_path, f"option.tensor_parallel_degree={tp}",
                   f"option.pipeline_parallel_degree={pp}")
    bind_cpu_workers(given, split(tp, pp), cpus, environ)
    assert environ == {THREADS_BIND: bound}


def test_the_users_binding_wins_and_one_worker_binds_nothing(tmp_path):
    environ = {THREADS_BIND: "0-1|2-3"}
    bind_cpu_workers(config(tmp_path, "option.tensor_parallel_degree=2"), split(2), [0, 1],
                     environ)
    assert environ == {THREADS_BIND: "0-1|2-3"}
    alone: dict[str, str] = {}
    bind_cpu_workers(config(tmp_path), split(), [0, 1], alone)
    assert alone == {}


def test_more_workers_than_cpus_is_refused_naming_both_settings(tmp_path):
    given = config(tmp_path, "option.tensor_parallel_degree=2",
                   "option.pipeline_parallel_degree=2")
    with pytest.raises(ConfigError, match=r"option.tensor_parallel_degree=2 \(.*\) x "
                       r"option.pipeline_parallel_degree=2 \(.*\): 4 vLLM CPU workers need a "
                       r"CPU each, and this process may use 2 \(0-1\)"):
        bind_cpu_workers(given, split(2, 2), [0, 1], {})


def test_the_models_heads_and_layers_come_from_its_config(tmp_path):
    LlamaConfig(num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
                hidden_size=576).save_pretrained(tmp_path)
    assert model_shape(tmp_path) == Shape(attention_heads=9, kv_heads=3, layers=30)
    assert model_shape(tmp_path / "nothing-here") is None


@pytest.mark.parametrize(("shape", "tp", "pp", "refusal"), [
    (Shape(9, 3, 30), 2, 1, r"option.tensor_parallel_degree=2 \(.*\): the model's 9 attention "
                            r"heads do not split evenly into 2 tensor-parallel workers"),
    (Shape(8, 3, 30), 2, 1, r"the model's 3 key-value heads neither split evenly into 2"),
    (Shape(8, 8, 2), 1, 4, r"option.pipeline_parallel_degree=4 \(.*\): 4 pipeline stages for "
                           r"the model's 2 layers"),
])
def test_a_split_the_model_cannot_take_is_refused_naming_the_setting(tmp_path, shape, tp, pp,
                                                                     refusal):
    given = config(tmp_path, f"option.tensor_parallel_degree={tp}",
                   f"option.pipeline_parallel_degree={pp}")
    with pytest.raises(ConfigError, match=refusal):
        check_split(given, split(tp, pp), shape)


@pytest.mark.parametrize(("shape", "tp", "pp"), [
    (Shape(8, 8, 2), 2, 2),  # heads and layers split
    (Shape(32, 8, 16), 4, 1),
    (Shape(32, 2, 16), 4, 1),  # two KV heads, each replicated on two workers
    (Shape(9, 3, 30), 1, 2),  # the embedded SmolLM2 splits by layers
])
def test_a_split_the_model_takes_passes(tmp_path, shape, tp, pp):
    given = config(tmp_path, f"option.tensor_parallel_degree={tp}",
                   f"option.pipeline_parallel_degree={pp}")
    check_split(given, split(tp, pp), shape)


def test_cpu_pipeline_stages_in_eager_mode_are_refused_naming_both_settings(tmp_path):
    eager = config(tmp_path, "option.pipeline_parallel_degree=2", "option.enforce_eager=true")
    with pytest.raises(ConfigError, match=r"option.pipeline_parallel_degree=2 \(.*\) with "
                       r"option.enforce_eager=true \(.*\): vLLM's CPU build runs pipeline "
                       r"stages only with its compiled model"):
        check_cpu_pipeline(eager, split(1, 2) | {"enforce_eager": True})
    check_cpu_pipeline(eager, split(2, 1) | {"enforce_eager": True})  # tensors split eagerly
    check_cpu_pipeline(eager, split(1, 2) | {"enforce_eager": False})


def test_across_nodes_this_node_binds_its_own_share_and_ray_binds_its_own(tmp_path):
    given = config(tmp_path, "option.pipeline_parallel_degree=2", "option.tensor_parallel_degree=2")
    leader: dict[str, str] = {}
    bind_cpu_workers(given, split(2, 2) | {"nnodes": 2}, [0, 1, 2, 3], leader)
    assert leader == {THREADS_BIND: "0-1|2-3"}  # two of the four ranks run here
    on_ray: dict[str, str] = {}
    bind_cpu_workers(given, split(2, 2) | {"distributed_executor_backend": "ray"}, [0, 1], on_ray)
    assert on_ray == {}


def test_only_a_vllm_node_of_rank_one_or_more_is_a_follower(tmp_path, monkeypatch):
    import importlib.util

    from handlers.engine import registry

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    assert registry.follower(config(tmp_path, "option.nnodes=2", "option.node_rank=0")) is None
    assert registry.follower(config(tmp_path)) is None
    argv = ["--model-dir", str(tmp_path), "--option", "option.rolling_batch=torch"]
    assert registry.follower(load_config(parse_args(argv), env={})) is None
    try:
        follow = registry.follower(config(tmp_path, "option.nnodes=2", "option.node_rank=1"))
    except ModuleNotFoundError as missing:  # its module imports vLLM, not installed here
        assert missing.name.split(".")[0] == "vllm"
    else:
        assert follow.__name__ == "run_follower"
