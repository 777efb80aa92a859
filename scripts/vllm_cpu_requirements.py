"""Print vLLM's own requirements minus the CUDA-only ones, one per line (for pip -r).

scripts/setup_vllm033.sh installs CUDA vLLM 0.33's Python code with `--no-deps` beside the CPU
build of torch, then its remaining requirements from this list. The CUDA build of torch and the
kernel packages below need about 10 GB of disk and no test on a machine without a GPU loads them;
the GPU machine runs vLLM 0.33 with its own pinned torch (scripts/gpu_env.sh).
"""

from __future__ import annotations

import re
from importlib.metadata import requires

from packaging.markers import default_environment
from packaging.requirements import Requirement

# Packages that only matter on an NVIDIA GPU (kernels, CUDA torch and its CUDA-built companions).
CUDA_ONLY = {
    "torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python",
    "apache-tvm-ffi", "tilelang", "nvidia-cudnn-frontend", "nvtx", "fastsafetensors",
    "instanttensor", "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla", "humming-kernels",
}


def main() -> None:
    env = {**default_environment(), "extra": ""}
    for line in requires("vllm") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if re.sub(r"[-_.]+", "-", req.name).lower() in CUDA_ONLY:
            continue
        req.marker = None
        print(req)


if __name__ == "__main__":
    main()
