/work/main/.venv/bin/python -m lmstack.cli eval perplexity --stack /tmp/quant_quality-9ks9wf4t/unquantized-eval.yaml --text /work/main/benchmarks/data/heldout_gpl3.txt --json
/work/main/.venv/bin/python -m lmstack.cli quantize --stack /tmp/quant_quality-9ks9wf4t/fp8-quantize.yaml --method fp8 --out /root/.cache/lmstack/quantized/smollm2-135m-instruct-fp8
/work/main/.venv/bin/python -m lmstack.cli eval perplexity --stack /tmp/quant_quality-9ks9wf4t/fp8-eval.yaml --text /work/main/benchmarks/data/heldout_gpl3.txt --json
/work/main/.venv/bin/python -m lmstack.cli quantize --stack /tmp/quant_quality-9ks9wf4t/awq-g128-quantize.yaml --method awq --out /root/.cache/lmstack/quantized/smollm2-135m-instruct-awq --calibration /work/main/benchmarks/data/calibration_docs.txt --num-samples 32
/work/main/.venv/bin/python -m lmstack.cli eval perplexity --stack /tmp/quant_quality-9ks9wf4t/awq-g128-eval.yaml --text /work/main/benchmarks/data/heldout_gpl3.txt --json
/work/main/.venv/bin/python -m lmstack.cli quantize --stack /tmp/quant_quality-9ks9wf4t/rtn-int4-g128-quantize.yaml --method rtn-int4 --out /root/.cache/lmstack/quantized/smollm2-135m-instruct-rtn-int4 --group-size 128
/work/main/.venv/bin/python -m lmstack.cli eval perplexity --stack /tmp/quant_quality-9ks9wf4t/rtn-int4-g128-eval.yaml --text /work/main/benchmarks/data/heldout_gpl3.txt --json
/work/main/.venv/bin/python -m lmstack.cli quantize --stack /tmp/quant_quality-9ks9wf4t/nvfp4-quantize.yaml --method nvfp4 --out /root/.cache/lmstack/quantized/smollm2-135m-instruct-nvfp4 --calibration /work/main/benchmarks/data/calibration_docs.txt --num-samples 32
/work/main/.venv/bin/python -m lmstack.cli eval perplexity --stack /tmp/quant_quality-9ks9wf4t/nvfp4-eval.yaml --text /work/main/benchmarks/data/heldout_gpl3.txt --json
/work/main/.venv/bin/python -m lmstack.cli eval perplexity --stack /tmp/quant_quality-9ks9wf4t/kv-fp8_e4m3-eval.yaml --text /work/main/benchmarks/data/heldout_gpl3.txt --json
/work/main/.venv/bin/python -m lmstack.cli eval perplexity --stack /tmp/quant_quality-9ks9wf4t/awq-g128-dense-head-eval.yaml --text /work/main/benchmarks/data/heldout_gpl3.txt --json
/work/main/.venv/bin/python -m lmstack.cli eval perplexity --stack /tmp/quant_quality-9ks9wf4t/rtn-int4-g128-dense-head-eval.yaml --text /work/main/benchmarks/data/heldout_gpl3.txt --json
