#!/bin/bash
# A lent GPU machine's image has torch, Triton, transformers, tokenizers, safetensors, pluggy and
# PyYAML (Python 3.12) but not the rest of lmstack's dependencies, and no internet. So:
#   benchmarks/gpu/gpu_session.sh wheels   # here: cp312 wheels of the missing ones + ours, into .whl/
#   benchmarks/gpu/gpu_session.sh run      # there (the device tool, carry [".whl"]): install, check, sweep
# `run` takes SECTIONS (gpu_check's, default all), CHECK_S and SWEEP_S (time limits) from the
# environment and writes under $OUT. Add `.whl/` to .git/info/exclude so that it stays untracked.
set -u
cd "$(dirname "$0")/../.."
case "${1:-}" in
wheels)
    mkdir -p .whl
    pip download -q -d .whl --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --no-deps \
        msgspec==0.23.0 gguf==0.19.0 compressed-tensors==0.20.1 loguru pydantic==2.14.4 \
        pydantic_core==2.50.5 annotated-types typing-inspection
    .venv/bin/pip wheel -q --no-deps --no-build-isolation -w .whl ./core ./plugins/quant/awq \
        ./plugins/quant/fp8 ./plugins/quant/nvfp4 ./plugins/attention/flash-attention \
        ./plugins/attention/flash-decoding ./plugins/speculative/ngram
    ls .whl
    ;;
run)
    pip install --no-deps --target /tmp/site -q .whl/*.whl 2>&1 | tail -2
    P=core:bench  # bench: lmstack_bench.toolbox, which the scripts import
    for d in plugins/*/*/; do P=$P:$d; done
    export PYTHONPATH=$P:/tmp/site  # the checkout's sources first: the wheels give entry points
    python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
    T0=$(date +%s)
    timeout "${CHECK_S:-200}" python benchmarks/gpu/gpu_check.py --out "$OUT/check" --trials 6 \
        --sections "${SECTIONS:-kernels,engine,timing}" >"$OUT/check.log" 2>&1
    echo "gpu_check rc=$? $(($(date +%s) - T0)) s"
    grep -E "^  (ok|FAIL|fp8|nvfp4|w4a16|timing)|summary|FAIL|Error" "$OUT/check.log" | tail -40
    T0=$(date +%s)
    timeout "${SWEEP_S:-300}" python benchmarks/gpu/quant_gpu_sweep.py --out "$OUT/sweep" >"$OUT/sweep.log" 2>&1
    echo "sweep rc=$? $(($(date +%s) - T0)) s"
    grep -A200 "^best GEMM" "$OUT/sweep.log" | grep -v "^  \(w4a16\|nvfp4\).*M=\(4\|32\|128\|256\):"
    ;;
*)
    echo "usage: benchmarks/gpu/gpu_session.sh wheels|run" >&2
    exit 2
    ;;
esac
