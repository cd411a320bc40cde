"""Engine settings: pass-through of config keys, and what a retry after an out-of-memory changes."""

from __future__ import annotations

from shardgen.engine import engine_kwargs, is_memory_error, lowered_memory_settings


def test_engine_kwargs_drop_nulls_add_extra_and_turn_on_request_metrics():
    kw = engine_kwargs({"model": "m", "max_model_len": None, "dtype": "auto", "extra": {"swap_space": 2}})
    assert kw == {"model": "m", "dtype": "auto", "swap_space": 2, "disable_log_stats": False}


def test_memory_errors_are_recognised_from_vllm_and_torch_messages():
    assert is_memory_error("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert is_memory_error(
        "ValueError: To serve at least one request with the models's max seq len (4096), (0.5 GiB KV cache is "
        "needed, which is larger than the available KV cache memory (0.2 GiB)."
    )
    assert not is_memory_error("FileNotFoundError: models/x/config.json")


def test_no_failure_changes_nothing():
    assert lowered_memory_settings({"max_num_seqs": 64}, 0) == {}


def test_each_memory_failure_halves_the_batch_and_frees_gpu_memory_and_turns_on_fp8_kv():
    cfg = {"max_num_seqs": 64, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto"}
    assert lowered_memory_settings(cfg, 1) == {
        "max_num_seqs": 32,
        "gpu_memory_utilization": 0.85,
        "kv_cache_dtype": "fp8",
    }
    assert lowered_memory_settings(cfg, 2)["max_num_seqs"] == 16


def test_a_chosen_kv_cache_dtype_is_kept_and_defaults_are_lowered_from_vllms():
    low = lowered_memory_settings({"kv_cache_dtype": "fp8_e5m2"}, 1)
    assert "kv_cache_dtype" not in low
    assert low["max_num_seqs"] == 128  # vLLM's default 256, halved
    assert lowered_memory_settings({}, 20)["gpu_memory_utilization"] == 0.5


def test_a_rows_seed_depends_on_the_run_seed_and_the_row_id_only():
    from shardgen.engine import row_seed

    assert row_seed(1, "r00001") == row_seed(1, "r00001")
    assert row_seed(1, "r00001") != row_seed(2, "r00001") != row_seed(1, "r00002")
    assert 0 <= row_seed(123, 10**9) < 2**62
