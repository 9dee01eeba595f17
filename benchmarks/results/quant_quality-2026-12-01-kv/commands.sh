/work/main/.venv/bin/python -m lmstack.cli eval perplexity --stack /tmp/quant_quality-tg5gfdlk/unquantized-eval.yaml --text /work/main/benchmarks/data/heldout_gpl3.txt --json
/work/main/.venv/bin/python -m lmstack.cli eval perplexity --stack /tmp/quant_quality-tg5gfdlk/kv-fp8_e4m3-eval.yaml --text /work/main/benchmarks/data/heldout_gpl3.txt --json
