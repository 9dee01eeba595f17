"""lmstack-calibrate: offline quantization and calibration (`lmstack quantize`) and model
evaluation (`lmstack eval perplexity`), outside the serving core.

- `model`: `DenseModel`, a checkpoint's dense fp32 weights run through the core's model classes;
- `awq_search`: the AWQ search any quantizer's `WeightFormat` can use (`AWQCalibration`);
- `scale_tuning`: end-to-end tuning of group scales after the search (`ScaleTunable`);
- `calibration_text`, `folder`, `quantize`: the `lmstack quantize` command;
- `perplexity`: the `lmstack eval perplexity` command.
"""
