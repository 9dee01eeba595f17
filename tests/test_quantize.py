"""`lmstack quantize`: the calibration forward against transformers, the folder it writes (config,
tensors, tokenizer) and interop both ways through compressed-tensors, on the tiny model.

transformers + compressed-tensors 0.20 cannot load *asymmetric* pack-quantized folders (the
zero point's packed shape differs from the one it allocates; llm-compressor issue #1618), so the
folder transformers loads is a symmetric rtn-int4 one; the folder compressed-tensors writes for
lmstack is asymmetric (the harder case: packed zero points)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch

from lmstack.cli import main
from lmstack.model.source import open_model_source
from lmstack_calibrate.model import DenseModel

pytest.importorskip("compressed_tensors")
pytest.importorskip("lmstack_awq")


def _ids(seed: int = 0, length: int = 24) -> torch.Tensor:
    return torch.randint(0, 200, (1, length), generator=torch.Generator().manual_seed(seed))


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _served_logprobs(folder, quantizer: str, ids: torch.Tensor) -> torch.Tensor:
    """lmstack's log-probabilities of each next prompt token, served from `folder` in fp32 (the
    embedding and head kept dense, as transformers does)."""
    from lmstack.engine.llm import LLM
    from lmstack.sampling_params import SamplingParams

    llm = LLM(
        {
            "model": str(folder),
            "dtype": "float32",
            "quant": {"weights": quantizer, "lm_head": "dense", "fp32_activations": "exact"},
        }
    )
    out = llm.generate(ids[0].tolist(), SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    llm.engine.shutdown()
    toks = ids[0, 1:].tolist()
    return torch.tensor([entry[t] for entry, t in zip(out.prompt_logprobs[1:], toks, strict=True)])


def _hf_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        lps = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return lps.gather(1, ids[0, 1:].view(-1, 1)).view(-1)


def test_calibration_forward_matches_transformers(tiny_model_path):
    model = DenseModel.load(open_model_source(str(tiny_model_path)))
    ids = _ids()
    with torch.no_grad():
        expected = _hf(tiny_model_path)(ids).logits
    torch.testing.assert_close(model.logits(ids), expected, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def rtn_folder(tiny_model_path, tmp_path_factory):
    """A symmetric rtn-int4 g32 folder of the tiny model, written by the command."""
    work = tmp_path_factory.mktemp("quantize")
    stack = work / "stack.yaml"
    stack.write_text(
        f"model: {tiny_model_path}\ndtype: float32\nquant: {{weights: rtn-int4, symmetric: true}}\n",
        encoding="utf-8",
    )
    out = work / "rtn"
    args = ["quantize", "--stack", str(stack), "--method", "rtn-int4", "--group-size", "32"]
    assert main([*args, "--out", str(out)]) == 0
    return out


def test_folder_layout(rtn_folder, tiny_model_path):
    from safetensors import safe_open

    config = json.loads((rtn_folder / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"
    assert q["ignore"] == ["lm_head"] and q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    record = json.loads((rtn_folder / "lmstack_quantize.json").read_text())
    assert record["method"] == "rtn-int4" and "calibration" not in record  # rtn does not calibrate
    with safe_open(str(rtn_folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.self_attn.k_proj.weight_packed" in names  # unfused HF names
    assert "model.layers.1.mlp.up_proj.weight_scale" in names
    assert "model.layers.1.mlp.up_proj.weight" not in names
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (rtn_folder / name).is_file()


def test_transformers_loads_our_folder(rtn_folder):
    """transformers (decompressing through compressed-tensors) and lmstack serving the folder we
    wrote give the same next-token log-probabilities."""
    ids = _ids(1)
    theirs = _hf_logprobs(_hf(rtn_folder), ids)
    ours = _served_logprobs(rtn_folder, "awq", ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-3)


def test_out_folder_must_be_new(rtn_folder, tiny_model_path, tmp_path, capsys):
    stack = tmp_path / "stack.yaml"
    stack.write_text(f"model: {tiny_model_path}\n", encoding="utf-8")
    args = ["quantize", "--stack", str(stack), "--method", "rtn-int4", "--out", str(rtn_folder)]
    assert main(args) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err


def test_read_only_quantizer_is_refused(tiny_model_path, tmp_path, capsys):
    stack = tmp_path / "stack.yaml"
    stack.write_text(f"model: {tiny_model_path}\n", encoding="utf-8")
    assert main(["quantize", "--stack", str(stack), "--method", "none", "--out", str(tmp_path / "o")]) == 2
    assert "cannot write them" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def write_with_compressed_tensors(tiny_model_path, out, group_size: int = 32):
    """The tiny model quantized and saved by compressed-tensors' own code (asymmetric int4,
    min/max scales, pack-quantized), as llm-compressor saves a W4A16_ASYM model; returns the
    dense model with the same quantize-dequantized weights, the reference."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    model = _hf(tiny_model_path)
    reference = _hf(tiny_model_path)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    ref_modules = dict(reference.named_modules())
    with torch.no_grad():
        for name, module in model.named_modules():
            if not hasattr(module, "weight_scale"):
                continue
            w = module.weight.view(module.weight.shape[0], -1, group_size)
            scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
            module.weight_scale.copy_(scale)
            module.weight_zero_point.copy_(zero)
            ref_modules[name].weight.copy_(fake_quantize(module.weight, scale, zero, args))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(tiny_model_path / name, out / name)
    return reference


def test_lmstack_loads_a_compressed_tensors_folder(tiny_model_path, tmp_path):
    reference = write_with_compressed_tensors(tiny_model_path, tmp_path / "ct")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    ids = _ids(2)
    ours = _served_logprobs(tmp_path / "ct", "awq", ids)
    torch.testing.assert_close(ours, _hf_logprobs(reference, ids), rtol=1e-3, atol=1e-3)


def test_awq_command_records_its_calibration(tiny_model_path, tmp_path):
    stack = tmp_path / "stack.yaml"
    stack.write_text(f"model: {tiny_model_path}\ndtype: float32\n", encoding="utf-8")
    text = tmp_path / "calibration.txt"
    text.write_text("The keeper climbed the stairs and trimmed the wick. " * 40, encoding="utf-8")
    out = tmp_path / "awq"
    args = ["quantize", "--stack", str(stack), "--method", "awq", "--out", str(out)]
    assert main([*args, "--calibration", str(text), "--num-samples", "4", "--seq-len", "32"]) == 0
    record = json.loads((out / "lmstack_quantize.json").read_text())
    assert record["calibration"]["source"] == str(text) and record["calibration"]["num_samples"] == 4
    assert record["cpu_model"] and isinstance(record["cpu_flags"], list)  # names the CPU it ran on
    assert record["search"]["algorithm"] == "awq" and len(record["search"]["layers"]) == 2
    # lmstack-awq tunes the scales by default, on 8 more samples cut after the search's to
    # validate with
    assert record["calibration"]["validation_samples"] == 8
    tuning = record["search"]["scale_tuning"]
    assert (tuning["epochs"], tuning["train_samples"], tuning["val_samples"]) == (4, 4, 8)
    lps = _served_logprobs(out, "awq", _ids(3))
    assert torch.isfinite(lps).all()


def _dequantized_folder(folder) -> DenseModel:
    """The folder's model with every int4 linear decoded to fp32 (biases and the rest as stored)."""
    from safetensors.torch import load_file

    from lmstack_awq.int4_format import decode_ct_codes, decode_ct_zero
    from lmstack_awq.int4_math import dequantize_int4

    tensors = load_file(str(folder / "model.safetensors"))
    weights = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            module = name.removesuffix(".weight_packed")
            shape = tuple(tensors[module + ".weight_shape"].tolist())
            scale = tensors[module + ".weight_scale"].float()
            zero = decode_ct_zero(tensors[module + ".weight_zero_point"], shape[0], scale.shape[1])
            group = -(-shape[1] // scale.shape[1])
            weights[module + ".weight"] = dequantize_int4(
                decode_ct_codes(t, shape), scale, zero, group, torch.float32
            )
        elif not name.rsplit(".", 1)[-1].startswith("weight_"):
            weights[name] = t.float()
    return DenseModel(open_model_source(str(folder)).config, weights)


def test_awq_folder_carries_its_bias_correction(tiny_model_path, tmp_path):
    """`lmstack quantize --method awq` corrects o_proj's and down_proj's biases by default: the
    folder's config turns attention_bias and mlp_bias on, q/k/v/gate/up get zero biases (a Llama
    config biases all of a kind), and lmstack serving the folder computes what the folder's
    decoded weights and biases compute; with `bias_correction: false` there are none."""
    from safetensors import safe_open

    text = tmp_path / "calibration.txt"
    text.write_text("The keeper climbed the stairs and trimmed the wick. " * 40, encoding="utf-8")
    folders = {}
    for corrected in (True, False):
        stack = tmp_path / f"stack-{corrected}.yaml"
        quant = "" if corrected else "quant: {weights: awq, bias_correction: false}\n"
        stack.write_text(f"model: {tiny_model_path}\ndtype: float32\n{quant}", encoding="utf-8")
        out = folders[corrected] = tmp_path / f"awq-{corrected}"
        args = ["quantize", "--stack", str(stack), "--method", "awq", "--out", str(out), "--calibration"]
        assert main([*args, str(text), "--num-samples", "4", "--seq-len", "32"]) == 0
    config = json.loads((folders[True] / "config.json").read_text())
    assert config["attention_bias"] is True and config["mlp_bias"] is True
    with safe_open(str(folders[True] / "model.safetensors"), "pt") as f:
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert not f.get_tensor(f"model.layers.1.{n}.bias").any()
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            assert f.get_tensor(f"model.layers.1.{n}.bias").abs().max() > 0
    plain = json.loads((folders[False] / "config.json").read_text())
    assert not plain.get("attention_bias") and not plain.get("mlp_bias")
    ids = _ids(4)
    reference = torch.log_softmax(_dequantized_folder(folders[True]).logits(ids)[0, :-1], -1)
    expected = reference.gather(1, ids[0, 1:].view(-1, 1)).view(-1)
    torch.testing.assert_close(_served_logprobs(folders[True], "awq", ids), expected, rtol=1e-4, atol=1e-4)


def test_zero_biases_are_dropped_at_load():
    """An Int4Linear whose loaded bias is all zeros (q/k/v, gate/up in a bias-corrected folder)
    serves without it; a non-zero bias stays and is added."""
    from lmstack.interfaces import LinearSpec
    from lmstack_awq.int4_math import Int4Scheme
    from lmstack_awq.linear import Int4Linear

    for bias in (torch.zeros(16), torch.arange(16.0)):
        layer = Int4Linear(LinearSpec(64, 16, True, "t"), Int4Scheme(32, False), "dense")
        layer.weight.weight_loader(layer.weight, torch.randn(16, 64), None)
        layer.bias.weight_loader(layer.bias, bias, None)
        x = torch.randn(3, 64)
        expected = x @ layer.dequantized_weight().t() + bias
        layer.prepare()
        assert (layer.bias is None) == (not bias.any())
        # The CPU kernel rounds a little (fp16 minimums, bf16 x on some paths); a lost bias of
        # up to 15 would not pass.
        torch.testing.assert_close(layer(x), expected, rtol=2e-2, atol=5e-2)


@pytest.mark.slow
def test_http_serves_the_folder_and_names_its_format(rtn_folder):
    """`lmstack serve` with `model: DIR` (quant.weights: auto picks `awq` for the folder):
    /v1/stack shows the quantizer and the checkpoint format, and a completion comes back."""
    from lmstack_api.testing import ServerProcess

    stack = {"model": str(rtn_folder), "dtype": "float32", "max_model_len": 256}
    server = ServerProcess(stack).start()
    try:
        status, body = server.get("/v1/stack")
        described = json.loads(body)["stack"]
        assert status == 200
        assert described["checkpoint_format"] == "compressed-tensors/pack-quantized"
        assert described["components"]["quantizer"]["name"] == "awq"
        model_id = json.loads(server.get("/v1/models")[1])["data"][0]["id"]
        request = {"model": model_id, "prompt": "hello", "max_tokens": 3, "temperature": 0}
        reply = httpx.post(server.base_url + "/v1/completions", json=request, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    finally:
        server.__exit__(None, None, None)
