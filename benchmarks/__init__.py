"""Harnesses that run the package and measure it: the demo (``make demo``), the GPU benchmark
(``make gpu-bench``) and its helpers. Run from the repository root (``python -m
benchmarks.demo``); they are not installed with ``tiering``, which never imports them, and
unlike the package they may import vLLM and torch anywhere."""
