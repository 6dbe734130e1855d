"""What a rank's ``rank.json`` says about the software and hardware it ran on (``environment``).

Two runs that differ in a library version, a device, a determinism setting or an
environment variable a library reads may differ in every result: ``probe compare`` lists
these differences first (``probe.analysis.run_identity``). Recorded at the start of a
session, on the training thread, once per session (the package versions once per process).

No secrets: environment variables are recorded only when their name starts with one of
:data:`ENV_PREFIXES` or is one of :data:`ENV_NAMES` (the variables of the device and
communication libraries, OpenMP and torch), never arbitrary ones, and even then a name
that holds a word of :data:`SECRET_WORDS` is left out.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import sys
from typing import Any

import torch

from probe.devices import current_device

ENV_PREFIXES = (
    "CUDA_", "CUBLAS_", "CUBLASLT_", "CUDNN_", "NCCL_", "NVIDIA_", "NVTE_", "TRITON_",
    "HCCL_", "ASCEND_", "ACL_", "HIP_", "ROCM_", "HSA_", "MIOPEN_", "XLA_",
    "OMP_", "MKL_", "KMP_", "PYTORCH_", "TORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_",
)
"""Names recorded by prefix: device, collective and math libraries, OpenMP, torch."""
ENV_NAMES = frozenset({
    "PYTHONHASHSEED", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    # Ascend: task queue, saturation (+-max for inf) and op fusion switches change results.
    "TASK_QUEUE_ENABLE", "INF_NAN_MODE_ENABLE", "COMBINED_ENABLE", "MULTI_STREAM_MEMORY_REUSE",
})
"""Names recorded one by one."""
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "AUTH", "COOKIE", "CERT")
"""A name holding one of these is never recorded, whatever its prefix."""
VALUE_MAX_CHARS = 500

PACKAGES = (
    "numpy", "transformers", "accelerate", "peft", "deepspeed", "megatron-core", "mindspeed", "apex",
    "flash-attn", "xformers", "transformer-engine", "triton", "torch-npu", "torchvision", "torchaudio",
    "lightning", "pytorch-lightning", "safetensors", "bitsandbytes", "nvidia-cublas-cu12",
    "nvidia-cudnn-cu12", "nvidia-nccl-cu12",
)
"""Packages whose version is recorded when installed (those that change what a step computes)."""


def recorded_variable(name: str) -> bool:
    """Whether environment variable ``name`` is recorded (allow-listed and not secret-like)."""
    upper = name.upper()
    if any(word in upper for word in SECRET_WORDS):
        return False
    return name in ENV_NAMES or name.startswith(ENV_PREFIXES)


def environment_variables(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The allow-listed variables of ``environ`` (default ``os.environ``), values cut at
    :data:`VALUE_MAX_CHARS`."""
    environ = dict(os.environ) if environ is None else environ
    return {name: value[:VALUE_MAX_CHARS] for name, value in sorted(environ.items())
            if recorded_variable(name)}


@functools.lru_cache(maxsize=1)
def package_versions() -> dict[str, str]:
    """Name -> version of the installed packages of :data:`PACKAGES` (once per process)."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except (importlib.metadata.PackageNotFoundError, ValueError):
            continue
    return found


def _try(read: Any) -> Any:
    """A value read from a library that may lack it (or fail on this machine): None then."""
    try:
        return read()
    except Exception:  # an optional API: absent in this build, or no device
        return None


def versions() -> dict[str, Any]:
    """Python, torch and the device libraries torch was built with or loaded."""
    found: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
    }
    if torch.cuda.is_available():
        found["cudnn"] = _try(torch.backends.cudnn.version)
        found["nccl"] = _try(lambda: ".".join(map(str, torch.cuda.nccl.version())))
        found["driver"] = _driver_version()
    npu = sys.modules.get("torch_npu")  # only when the program imported it: importing it has effects
    if npu is not None:
        found["torch_npu"] = getattr(npu, "__version__", None)
        found["cann"] = _try(lambda: npu.npu.utils.get_cann_version())
    return {key: value for key, value in found.items() if value is not None}


def _driver_version() -> str | None:
    """The NVIDIA driver's version, through NVML when installed, else the CUDA driver API level."""
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML: fall back to the driver's CUDA API level
        level = _try(lambda: torch._C._cuda_getDriverVersion())
        return None if level is None else f"cuda api {level // 1000}.{level % 1000 // 10}"


def devices() -> dict[str, Any]:
    """The accelerator kind, its device count and each device's name (none on a CPU-only run)."""
    device = current_device()
    found: dict[str, Any] = {"cpu": _cpu_model()}
    # The vector instructions torch's CPU kernels use (AVX2, AVX512): another set rounds sums differently.
    capability = _try(torch.backends.cpu.get_cpu_capability)
    if capability is not None:
        found["cpu_capability"] = capability
    if device is None:
        return found
    module = _try(lambda: torch.get_device_module(device.type))
    if module is None:
        return found
    count = _try(module.device_count) or 0
    found["accelerator"] = device.type
    found["count"] = count
    found["names"] = [_try(lambda i=i: module.get_device_name(i)) for i in range(count)]
    if device.type == "cuda":
        found["capabilities"] = [_try(lambda i=i: ".".join(map(str, torch.cuda.get_device_capability(i))))
                                 for i in range(count)]
    return found


@functools.lru_cache(maxsize=1)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine()


def settings() -> dict[str, Any]:
    """torch's global switches that change what an op computes (determinism, TF32, threads)."""
    found: dict[str, Any] = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "fp16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
        # CPU reductions split work by thread: the count can change a sum's rounding.
        "num_threads": torch.get_num_threads(),
    }
    return {key: value if isinstance(value, (bool, int, str)) else str(value) for key, value in found.items()}


def environment_info() -> dict[str, Any]:
    """The ``environment`` entry of ``rank.json``: versions, devices, settings, variables, packages."""
    return {
        "versions": versions(),
        "devices": devices(),
        "settings": settings(),
        "variables": environment_variables(),
        "packages": package_versions(),
    }
