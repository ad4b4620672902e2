"""The tiny Kimi-K2.5 checkpoint in Kimi-K2.5's INT4 format (`tiny_kimi_k25_int4_path`) and every
path of ours that reads it: the format itself against compressed-tensors and the fp32 weights it was
quantized from, target facts and weight bytes for the plan, the embedding / lm_head read by name
(only the shards holding them are opened), and, through SGLang's own loader, the captured states
against an HF reference built from the dequantized experts.

SGLang 0.5.23 cannot run these experts on CPU: it picks its Marlin WNA16 MoE scheme, whose weight
repacking JIT-compiles a CUDA kernel (docs/KIMI_K25.md §3.1). The engine test below therefore lets
SGLang load and route as it does, and replaces only that scheme's repack and expert GEMMs with a
dequantize-and-matmul in torch.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specforge_k25.target_engine.base import CPU_MEM_FRACTION_STATIC
from specforge_k25.target_engine import hf_config
from specforge_k25.target_engine.hf_config import load_embedding_and_head, read_target_info

EXPERT = re.compile(r"^language_model\.model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.")


def unpack_int4(packed: torch.Tensor, shape) -> torch.Tensor:
    """int32 words [out, in/8] -> int values [out, in]: element i of a word in bits 4i..4i+3, stored +8."""
    return torch.stack([(packed >> (4 * i)) & 0xF for i in range(8)], -1).reshape(shape) - 8


@pytest.fixture(scope="session")
def int4_path(smollm2_path):
    from specforge_k25.target_engine.models import tiny_kimi_k25_int4_path

    return str(tiny_kimi_k25_int4_path(smollm2_path))


@pytest.fixture(scope="session")
def int4_tensors(int4_path):
    out = {}
    for file in sorted(Path(int4_path).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="session")
def reference_weights(smollm2_path):
    from specforge_k25.target_engine.models import tiny_kimi_int4_reference

    return tiny_kimi_int4_reference(smollm2_path)


def test_int4_checkpoint_has_kimi_k25s_format(int4_path, int4_tensors):
    """quantization_config as Kimi-K2.5's (in text_config); routed experts only, each projection as
    weight_packed int32 [out, in/8] + weight_scale bf16 [out, in/32] + weight_shape int64 [out, in];
    everything the ignore list names stays a bf16 `.weight`; an index maps every tensor."""
    config = json.loads(Path(int4_path, "config.json").read_text())
    assert "quantization_config" not in config
    text = config["text_config"]
    q = text["quantization_config"]
    assert (q["quant_method"], q["format"], q["quantization_status"]) == ("compressed-tensors", "pack-quantized",
                                                                         "compressed")
    w = q["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (4, "int", True, "group", 32)
    assert q["config_groups"]["group_0"]["input_activations"] is None  # weight-only: W4A16
    ignore = [re.compile(p[3:]) for p in q["ignore"]]
    H, width = text["hidden_size"], text["moe_intermediate_size"]
    assert H >= 256 and width >= 256  # the GPU INT4 MoE kernels' smallest tiles
    experts = {}
    for key, t in int4_tensors.items():
        m = EXPERT.match(key)
        if m:
            experts.setdefault(m.groups(), {})[key[m.end():]] = t
            assert not any(p.fullmatch(key.rsplit(".", 1)[0]) for p in ignore), key
        elif key.endswith(".weight"):
            assert t.dtype == torch.bfloat16, key
            module = key[: -len(".weight")]
            if re.search(r"self_attn|shared_experts|mlp\.(gate|up|down)_proj|lm_head|vision_tower|mm_projector", module):
                assert any(p.fullmatch(module) for p in ignore), f"{module} would be quantized"
    layers = text["num_hidden_layers"] - text["first_k_dense_replace"]
    assert len(experts) == layers * text["n_routed_experts"] * 3
    for (layer, e, proj), parts in experts.items():
        out, inp = (H, width) if proj == "down" else (width, H)
        assert set(parts) == {"weight_packed", "weight_scale", "weight_shape"}
        assert parts["weight_packed"].dtype == torch.int32 and parts["weight_packed"].shape == (out, inp // 8)
        assert parts["weight_scale"].dtype == torch.bfloat16 and parts["weight_scale"].shape == (out, inp // 32)
        assert parts["weight_shape"].dtype == torch.int64 and parts["weight_shape"].tolist() == [out, inp]
    index = json.loads(Path(int4_path, "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(int4_tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in int4_tensors.values())


def test_int4_experts_round_trip_the_fp32_weights(int4_tensors, reference_weights):
    """Unpacked by hand (`unpack_int4`), every expert's values are
    round(w / scale) clamped to [-8, 7] of the fp32 weight it was built from, with the scale
    max |w| / 7.5 of its group of 32 inputs (bf16); compressed-tensors' own unpack agrees, and the
    dequantized weight is within half a scale step of the original (plus the scale's bf16 rounding:
    a group's largest |w| sits at up to 7.5 x (1 + 2^-8) steps)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    names = [k for k in reference_weights if EXPERT.match(k)]
    assert names and all(k.endswith(".weight") for k in names)
    for key in names:
        base = key[: -len("weight")]
        w = reference_weights[key].float()
        packed, scale = int4_tensors[base + "weight_packed"], int4_tensors[base + "weight_scale"]
        nibbles = unpack_int4(packed, w.shape)
        groups = w.reshape(w.shape[0], -1, 32)
        expected_scale = (groups.abs().amax(-1) / 7.5).to(torch.bfloat16)
        assert torch.equal(scale, expected_scale), key
        s = scale.float().repeat_interleave(32, -1)
        assert torch.equal(nibbles, torch.clamp(torch.round(w / s), -8, 7).to(nibbles.dtype)), key
        assert torch.equal(unpack_from_int32(packed, 4, w.shape).to(nibbles.dtype), nibbles), key
        assert ((nibbles * s - w).abs() <= s * (0.5 + 7.5 * 2 ** -8)).all(), key
    packed = int4_tensors[names[0][: -len("weight")] + "weight_packed"]
    assert packed.abs().sum() > 0 and int4_tensors[names[0][: -len("weight")] + "weight_scale"].min() > 0


def test_embedding_and_head_open_only_their_shards(int4_path, int4_tensors, monkeypatch):
    """`load_embedding_and_head` on a sharded, indexed checkpoint opens the shard holding
    `language_model.model.embed_tokens.weight` and the one holding `language_model.lm_head.weight`,
    nothing else (Kimi-K2.5: 2 of 64 shards, not all 595 GB for the unprefixed names first)."""
    opened = []
    real = hf_config.safe_open

    def counting(file, *args, **kwargs):
        opened.append(Path(file).name)
        return real(file, *args, **kwargs)

    monkeypatch.setattr(hf_config, "safe_open", counting)
    embed, head = load_embedding_and_head(int4_path)
    weight_map = json.loads(Path(int4_path, "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) >= 4
    assert opened == [weight_map["language_model.model.embed_tokens.weight"], weight_map["language_model.lm_head.weight"]]
    assert torch.equal(embed, int4_tensors["language_model.model.embed_tokens.weight"])
    assert torch.equal(head, int4_tensors["language_model.lm_head.weight"])


def test_int4_target_facts_and_weight_bytes(int4_path, int4_tensors, tmp_path):
    """The plan's facts of the INT4 folder: text facts from text_config, the experts' quantization
    from its quantization_config, the weight bytes SGLang loads = the shards' sizes; from config.json
    and the index alone (no shards downloaded), the index's total size. Kimi-K2.5's defaults say the same
    quantization."""
    from specforge_k25.plan.facts import KIMI_K25, facts_from_folder

    facts = facts_from_folder(int4_path, "kimi_int4")
    text = json.loads(Path(int4_path, "config.json").read_text())["text_config"]
    info = read_target_info(int4_path)
    assert (facts.num_layers, facts.hidden_size, facts.vocab_size) == (info.num_layers, 256, text["vocab_size"])
    assert (facts.num_moe_layers, facts.n_routed_experts, facts.moe_intermediate_size) == (7, 8, 256)
    assert (facts.quant_method, facts.expert_weight_bits, facts.quant_group_size) == ("compressed-tensors", 4, 32)
    assert facts.int4_experts and KIMI_K25.int4_experts and facts.multimodal
    files = sorted(Path(int4_path).glob("*.safetensors"))
    assert facts.weight_bytes == sum(f.stat().st_size for f in files)
    tensor_bytes = sum(t.numel() * t.element_size() for t in int4_tensors.values())
    assert tensor_bytes < facts.weight_bytes < tensor_bytes + 64 * 1024 * len(files)  # + the shards' JSON headers
    # the experts cost 4.5 bits per weight (int4 + a bf16 scale per 32) in place of bf16's 16
    expert_bytes = sum(t.numel() * t.element_size() for k, t in int4_tensors.items() if EXPERT.match(k))
    weights = 7 * 8 * 3 * 256 * 256
    assert expert_bytes == weights // 2 + weights // 32 * 2 + 7 * 8 * 3 * 2 * 8
    for name in ("config.json", "model.safetensors.index.json"):
        (tmp_path / name).write_bytes(Path(int4_path, name).read_bytes())
    assert facts_from_folder(tmp_path).weight_bytes == tensor_bytes
    config = json.loads((tmp_path / "config.json").read_text())
    del config["text_config"]["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    plain = facts_from_folder(tmp_path)
    assert plain.quant_method is None and not plain.int4_experts


_INT4_PROBE = """
    import sys, torch
    from specforge_k25.target_engine import sglang_cpu_compat
    from specforge_k25.target_engine.hf_config import read_target_info


    def dequantize(packed, scale, group):
        # SGLang holds an expert stack transposed: packed [E, in/8, out] int32, scale [E, in/group, out]
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        E, words, out = packed.shape
        q = unpack_from_int32(packed.transpose(1, 2).contiguous(), 4, torch.Size([E, out, words * 8]))
        return q.float() * scale.transpose(1, 2).float().repeat_interleave(group, -1)  # [E, out, in]


    def torch_int4_moe():
        # Only what SGLang cannot run on CPU: the Marlin repack and the expert GEMMs. Loading,
        # routing and the routed scaling (applied after the experts on CPU) stay SGLang's.
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
        from sglang.srt.layers.quantization.compressed_tensors.schemes import compressed_tensors_wNa16_moe as m

        def process_weights_after_loading(self, layer):
            layer.w13_dequantized = dequantize(layer.w13_weight_packed.data, layer.w13_weight_scale.data, self.group_size)
            layer.w2_dequantized = dequantize(layer.w2_weight_packed.data, layer.w2_weight_scale.data, self.group_size)

        def apply_weights(self, layer, dispatch_output):
            x = dispatch_output.hidden_states
            weights, ids, _ = dispatch_output.topk_output
            out = torch.zeros(x.shape, dtype=torch.float32)
            for k in range(ids.shape[1]):
                for e in ids[:, k].unique().tolist():
                    rows = ids[:, k] == e
                    gate, up = (x[rows].float() @ layer.w13_dequantized[e].T).chunk(2, -1)
                    y = (torch.nn.functional.silu(gate) * up) @ layer.w2_dequantized[e].T
                    out[rows] += weights[rows, k, None].float() * y
            return StandardCombineInput(hidden_states=out.to(x.dtype))

        m.CompressedTensorsWNA16MoE.process_weights_after_loading = process_weights_after_loading
        m.CompressedTensorsWNA16MoE.apply_weights = apply_weights


    if __name__ == "__main__":
        path, out = sys.argv[1], sys.argv[2]
        sglang_cpu_compat.apply()
        torch_int4_moe()
        from specforge_k25.target_engine.sglang_engine import SGLangTarget

        info = read_target_info(path)
        target = SGLangTarget(path, info.architecture, [2, 4, 5], dtype="bfloat16", num_threads=2)
        layers = target.model.language_model.model.layers
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(3, info.vocab_size, (n,), generator=g) for n in (37, 11)]
        res = target.forward(seqs)
        torch.save({"seqs": seqs, "aux": res.aux_hidden, "final": res.final_hidden,
                    "moe_scheme": type(layers[1].mlp.experts.scheme).__name__,
                    "dense_attention": type(layers[1].self_attn.kv_b_proj.quant_method).__name__}, out)
"""


def dequantized_copy(int4_path: str, int4_tensors: dict, dest: Path) -> str:
    """An unquantized fp32 copy of the INT4 checkpoint: each expert projection unpacked (`unpack_int4`,
    equal to compressed-tensors' own unpack: test above) times its group's scale; everything else
    as stored (bf16 -> fp32)."""
    from safetensors.torch import save_file

    config = json.loads(Path(int4_path, "config.json").read_text())
    del config["text_config"]["quantization_config"]
    weights = {}
    for key, t in int4_tensors.items():
        if key.endswith(".weight_packed"):
            base = key[: -len("weight_packed")]
            shape = int4_tensors[base + "weight_shape"].tolist()
            scale = int4_tensors[base + "weight_scale"].float().repeat_interleave(32, -1)
            weights[base + "weight"] = unpack_int4(t, shape).float() * scale
        elif not key.endswith((".weight_scale", ".weight_shape")):
            weights[key] = t.float()
    dest.mkdir()
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    config["torch_dtype"] = config["text_config"]["torch_dtype"] = "float32"
    (dest / "config.json").write_text(json.dumps(config))
    return str(dest)


@pytest.mark.engine
def test_sglang_loads_int4_experts_as_the_dequantized_hf_reference(int4_path, int4_tensors, tmp_path):
    """Through SGLang 0.5.23's Kimi class in bf16, its compressed-tensors loader and router: the
    three captured layers and the final states equal HF's DeepseekV3 run on the dequantized experts
    in fp32: token cosine median >= 0.9995 and >= 0.995 for 85 % of tokens (a token whose top-2
    routing flips under bf16 differs more; the same reference on the experts before quantization
    gives medians 0.85-0.993 and no token >= 0.999). On CPU SGLang picks the Marlin WNA16 scheme (the
    GPU path of every arch but sm100/sm103), whose repack and GEMMs are replaced by torch (module
    docstring)."""
    from specforge_k25.target_engine.hf_reference import HFTarget

    script = tmp_path / "probe.py"  # a file, not -c: SGLang may spawn helpers that re-import __main__
    script.write_text(textwrap.dedent(_INT4_PROBE))
    out = tmp_path / "probe.pt"
    proc = subprocess.run([sys.executable, str(script), int4_path, str(out)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"},
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-4000:]
    probe = torch.load(out, weights_only=False)
    assert probe["moe_scheme"] == "CompressedTensorsWNA16MoE"  # the ignore list keeps attention unquantized
    assert probe["dense_attention"] == "UnquantizedLinearMethod"
    ref = HFTarget(dequantized_copy(int4_path, int4_tensors, tmp_path / "dequantized"), [2, 4, 5]).forward(probe["seqs"])
    H = 256
    got = {f"aux{k}": probe["aux"][:, k * H:(k + 1) * H] for k in range(3)} | {"final": probe["final"]}
    want = {f"aux{k}": ref.aux_hidden[:, k * H:(k + 1) * H] for k in range(3)} | {"final": ref.final_hidden}
    for name in got:
        cos = torch.nn.functional.cosine_similarity(got[name].float(), want[name], dim=-1)
        print(f"{name}: token cosine median {cos.median().item():.6f}, min {cos.min().item():.4f}, "
              f">= 0.999: {(cos >= 0.999).float().mean().item():.2f}")
        assert cos.median() >= 0.9995 and (cos >= 0.995).float().mean() >= 0.85, name


def test_engine_gets_dist_timeout_and_the_multithreaded_loader(smollm2_path, monkeypatch):
    """A run's config reaches SGLang's ServerArgs: dist_timeout (hw.target_dist_timeout_s, else
    train.dist_timeout_s) and the multithreaded safetensors loader with hw.target_load_threads, through
    target_spec -> build_target -> SGLangTarget -> engine_server_args (no engine started)."""
    from specforge_k25.config import compose_job
    from specforge_k25.setup.target import target_spec
    from specforge_k25.target_engine import sglang_cpu_compat, sglang_engine
    from specforge_k25.target_engine.factory import build_target

    job = compose_job(["train.dist_timeout_s=77", "hw.target_load_threads=3"])
    spec = target_spec(job)
    assert (spec.dist_timeout, spec.load_threads) == (77, 3)
    assert target_spec(compose_job(["hw.target_dist_timeout_s=5.4"])).dist_timeout == 5

    seen = {}

    class Recorder:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(sglang_engine, "SGLangTarget", Recorder)
    build_target(spec)
    assert (seen["dist_timeout"], seen["load_threads"]) == (77, 3)

    kwargs = sglang_engine.engine_server_args(
        spec.model_path, device="cpu", dtype="float32", tp_size=1, attention_backend=None,
        mem_fraction_static=CPU_MEM_FRACTION_STATIC,
        max_total_tokens=1024, trust_remote_code=False, layer_ids=[1, 2, 3], nnodes=1, node_rank=0,
        dist_init_addr=None, dist_timeout=seen["dist_timeout"], load_threads=seen["load_threads"])
    sglang_cpu_compat.apply()
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(**kwargs)
    assert server_args.dist_timeout == 77
    loader = LoadConfig(model_loader_extra_config=server_args.model_loader_extra_config).model_loader_extra_config
    assert loader == {"enable_multithread_load": True, "num_threads": 3}
