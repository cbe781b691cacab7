"""Planner core: catalogs, HF configs, memory, TP choice and the roofline, against hand sums."""

import json

import msgspec
import pytest

from hpcserve.planner.errors import PlanError
from hpcserve.planner.factors import Factors
from hpcserve.planner.fleet import budget_concurrency
from hpcserve.planner.gpus import GPUS, get_gpu
from hpcserve.planner.models import MODELS, from_hf_config, resolve_model
from hpcserve.planner.perfmodel import (
    Roofline,
    StepBatch,
    decode_step,
    prefill_chunk,
    prefill_tokens_per_s,
    ttft_s,
)
from hpcserve.planner.replica import (
    GIB,
    Replica,
    kv_bytes_per_token,
    kv_bytes_per_token_per_gpu,
    memory_fit,
    weights_bytes,
)
from hpcserve.planner.tp import choose_tp

L8, L70, MIX = MODELS["llama-3.1-8b"], MODELS["llama-3.1-70b"], MODELS["mixtral-8x7b"]
H100 = GPUS["h100"]
IDEAL = Factors(hbm_efficiency=1.0, compute_efficiency=1.0, step_overhead_s=0.0)

# Llama-3.1-8B by hand: per layer q,o (2 x 4096 x 4096) + k,v (2 x 4096 x 1024) + gated MLP
# (3 x 4096 x 14336) + two norms; embeddings and lm_head 128256 x 4096 each, final norm.
L8_LAYER = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
L8_EMBED = 128256 * 4096


# ---- KV cache per token: the worked examples ----


@pytest.mark.parametrize(
    ("model", "dtype", "expected"),
    [
        (L70, "fp16", 2 * 80 * 8 * 128 * 2),  # 327,680
        (L70, "bf16", 327_680),
        (L70, "fp8", 2 * 80 * 8 * 128 * 1),
        (L8, "fp16", 2 * 32 * 8 * 128 * 2),  # 131,072
        (L8, "fp8", 65_536),
    ],
)
def test_kv_bytes_per_token(model, dtype, expected):
    assert kv_bytes_per_token(model, dtype) == expected


def test_kv_per_sequence_of_70b_at_8k_is_2_5_gib():
    assert kv_bytes_per_token(L70, "bf16") * 8192 / GIB == 2.5


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    # TP=4: 2 of 8 KV heads per GPU; TP=16: one head per GPU, each head stored twice.
    assert kv_bytes_per_token_per_gpu(Replica(L70, H100, 4)) == 2 * 80 * 2 * 128 * 2
    assert kv_bytes_per_token_per_gpu(Replica(L70, H100, 16)) == 2 * 80 * 1 * 128 * 2


# ---- parameters, dense and MoE ----


def test_dense_params_match_published_counts():
    assert L8.params_total == 32 * L8_LAYER + 2 * L8_EMBED + 4096 == 8_030_261_248
    assert L8.params_active == L8.params_total
    assert L70.params_total == pytest.approx(70.55e9, rel=1e-3)


def test_moe_active_params_are_top_k_experts():
    shared = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 4096 + 4096 * 8  # attention, norms, router
    expert = 3 * 4096 * 14336
    embed = 2 * 32000 * 4096 + 4096
    assert MIX.params_total == 32 * (shared + 8 * expert) + embed == 46_702_792_704
    assert MIX.params_active == 32 * (shared + 2 * expert) + embed == 12_879_925_248
    assert MIX.is_moe and not L8.is_moe


def test_weights_bytes_keep_embeddings_in_16_bit():
    assert weights_bytes(L8, "bf16") == L8.params_total * 2
    assert weights_bytes(L8, "int4") == 32 * L8_LAYER * 0.5 + (2 * L8_EMBED + 4096) * 2
    assert weights_bytes(L8, "fp8") == 32 * L8_LAYER * 1 + (2 * L8_EMBED + 4096) * 2


# ---- HF config.json ----


def _write(tmp_path, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


LLAMA_CONFIG = {
    "_name_or_path": "my-llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}


def test_from_hf_config_reproduces_the_catalog_model(tmp_path):
    spec = from_hf_config(_write(tmp_path, LLAMA_CONFIG))
    assert spec.name == "my-llama" and spec.head_dim == 4096 // 32
    assert spec.params_total == L8.params_total
    assert kv_bytes_per_token(spec, "bf16") == 131_072
    assert from_hf_config(tmp_path) == spec  # a model directory works too
    assert resolve_model(str(tmp_path / "config.json")) == spec


def test_from_hf_config_moe_head_dim_and_text_config(tmp_path):
    moe = {
        **LLAMA_CONFIG,
        "head_dim": 64,
        "num_key_value_heads": None,  # null: as many as attention heads
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "tie_word_embeddings": True,
    }
    spec = from_hf_config(_write(tmp_path, {"text_config": moe, "model_type": "x"}))
    assert (spec.head_dim, spec.kv_heads, spec.experts, spec.experts_per_token) == (64, 32, 64, 8)
    assert spec.intermediate_size == 768 and spec.tie_embeddings
    assert spec.params_active < spec.params_total


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": None}, "missing required key 'num_hidden_layers'"),
        ({"num_key_value_heads": -8}, "num_key_value_heads: expected a positive integer, got -8"),
        ({"hidden_size": "4096"}, "hidden_size: expected a positive integer, got '4096'"),
        ({"num_key_value_heads": 5}, "heads (32) must be a multiple of kv_heads (5)"),
        ({"kv_lora_rank": 512}, "kv_lora_rank=512 is not modelled"),
    ],
)
def test_from_hf_config_errors_name_the_key(tmp_path, change, message):
    config = {k: v for k, v in {**LLAMA_CONFIG, **change}.items() if v is not None}
    with pytest.raises(PlanError) as err:
        from_hf_config(_write(tmp_path, config))
    assert message in str(err.value)


def test_unreadable_config_and_unknown_names(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PlanError, match=r"--model: cannot read .*config\.json"):
        from_hf_config(tmp_path)
    with pytest.raises(PlanError, match=r"'llama-2' is neither a catalog model \(llama-3.1-8b"):
        resolve_model("llama-2")
    with pytest.raises(PlanError, match="unknown GPU 'h800'; known: a100, b200, h100, h200"):
        get_gpu("h800")
    assert get_gpu("H100") is H100


# ---- memory and concurrency ----


def test_concurrency_on_a_gpu_budget_by_hand():
    # 8B bf16 on one H100: usable = 79.6 GiB x 0.9 - 2 GiB; KV in blocks of 16 tokens.
    usable = 79.6 * GIB * 0.9 - 2 * GIB
    kv_budget = usable - 8_030_261_248 * 2
    blocks = int(kv_budget // (131_072 * 16))
    seqs = blocks // (8192 // 16)
    fit = memory_fit(Replica(L8, H100), Factors())
    assert (fit.kv_blocks, fit.max_seqs(8192)) == (blocks, seqs) == (27997, 54)
    assert fit.max_seqs(8193) == blocks // 513  # a partial block takes a whole one
    assert budget_concurrency(16, 1, seqs) == 16 * 54
    assert budget_concurrency(16, 4, 58) == 4 * 58


def test_weights_that_do_not_fit_leave_no_blocks():
    fit = memory_fit(Replica(L70, H100, 1), Factors())
    assert fit.kv_budget_bytes_per_gpu < 0 and fit.kv_blocks == 0 and fit.max_seqs(1) == 0


# ---- TP choice ----


def test_tp_is_the_smallest_with_a_useful_kv_budget():
    # 70B bf16 = 131.4 GiB. TP=2: 2 x (79.6 x 0.9 - 2 - 65.7) GiB = 8.0 GiB of KV: 3 sequences
    # of 8,192 tokens (2.5 GiB each) < 8. TP=4 holds 58.
    assert memory_fit(Replica(L70, H100, 2), Factors()).max_seqs(8192) == 3
    assert choose_tp(Replica(L70, H100), 8192, Factors()).tp == 4
    assert choose_tp(Replica(L70, H100, weights_dtype="fp8"), 8192, Factors()).tp == 2
    assert choose_tp(Replica(L8, H100), 8192, Factors()).tp == 1
    assert choose_tp(Replica(L70, GPUS["mi300x"]), 8192, Factors()).tp == 1


def test_tp_grows_to_meet_a_latency_target():
    def fast_enough(replica):  # batch-1 TPOT within 10 ms
        return Roofline(replica).step_time(decode_step(1, 8192)).total_s <= 0.010

    choice = choose_tp(Replica(L70, H100), 8192, Factors(), fast_enough)
    assert choice.tp == 8 and choice.meets_latency
    never = choose_tp(Replica(L70, H100), 8192, Factors(), lambda _: False)
    assert never.tp == 4 and not never.meets_latency


def test_no_tp_fits_names_need_and_have():
    small_node = Replica(L70, msgspec.structs.replace(GPUS["l40s"], gpus_per_node=2))
    with pytest.raises(PlanError) as err:
        choose_tp(small_node, 8192, Factors())
    text = str(err.value)
    assert "llama-3.1-70b does not fit on up to 2 x L40S 48GB" in text
    assert "131.4 GiB of bf16 weights + 20.0 GiB of bf16 KV for 8 sequences" in text
    assert "TP=2 has 2 x 38.5 GiB = 77.0 GiB usable" in text


# ---- roofline ----


def test_decode_step_by_hand():
    # 8B bf16, one H100, efficiencies 1, no overhead: batch 1 at 1,000 tokens of context reads
    # every layer weight and lm_head (not the input embedding) and 1,001 tokens of KV.
    step = Roofline(Replica(L8, H100), IDEAL).step_time(decode_step(1, 1000))
    bytes_read = (32 * L8_LAYER + L8_EMBED) * 2 + 1001 * 131_072
    flops = 2 * 32 * L8_LAYER + 2 * L8_EMBED + 4 * 32 * 32 * 128 * 1000
    assert step.memory_s == pytest.approx(bytes_read / 3.35e12)
    assert step.compute_s == pytest.approx(flops / 989e12)
    assert step.bound == "memory" and step.comm_s == 0
    assert step.total_s == pytest.approx(step.memory_s)


def test_step_overhead_and_tp_all_reduce_are_added():
    factors = Factors(step_overhead_s=0.002, allreduce_latency_s=1e-5)
    one = Roofline(Replica(L70, H100, 4), factors).step_time(decode_step(1, 0))
    ring = 2 * 3 / 4 * 8192 * 2 / (450e9 * 0.7)  # one token's activations, one way on NVLink
    assert one.comm_s == pytest.approx(2 * 80 * (1e-5 + ring))
    assert one.total_s == pytest.approx(max(one.compute_s, one.memory_s) + one.comm_s + 0.002)
    spanning = Roofline(Replica(L70, H100, 16), factors).step_time(decode_step(64, 0))
    in_node = Roofline(Replica(L70, H100, 8), factors).step_time(decode_step(64, 0))
    assert spanning.comm_s > in_node.comm_s  # 50 GB/s InfiniBand, not NVLink


def test_large_short_batches_turn_compute_bound():
    roofline = Roofline(Replica(L8, H100))
    assert roofline.step_time(decode_step(1, 128)).bound == "memory"
    assert roofline.step_time(decode_step(1024, 128)).bound == "compute"
    assert roofline.step_time(StepBatch()).total_s == 0


def test_moe_reads_only_the_experts_its_tokens_touch():
    roofline = Roofline(Replica(MIX, H100, 2))
    assert roofline.experts_touched(1) == pytest.approx(2)  # top-2 of 8
    assert roofline.experts_touched(2) == pytest.approx(8 * (1 - 0.75**2))
    assert roofline.experts_touched(1000) == pytest.approx(8)
    one = roofline.bytes_per_gpu(decode_step(1, 0))
    many = roofline.bytes_per_gpu(decode_step(256, 0))
    assert many - one > 0.9 * 6 * 32 * 3 * 4096 * 14336 * 2 / 2  # ~six more experts per layer


def test_ttft_prefills_in_chunks_of_the_token_budget():
    roofline = Roofline(Replica(L8, H100))
    chunks = [prefill_chunk(8192, 0), prefill_chunk(8192, 8192), prefill_chunk(3616, 16384)]
    by_hand = sum(roofline.step_time(c).total_s for c in chunks)
    assert ttft_s(roofline, 20000, token_budget=8192) == pytest.approx(by_hand)
    assert chunks[1].prefill_attn_pairs == 8192 * 8192 + 8192 * 8193 / 2
    shared = ttft_s(roofline, 20000, token_budget=8192, running=64, context=4096)
    assert shared > by_hand


# Published rough figures: the first-principles numbers quoted for these setups (peak HBM /
# bytes of weights per step; peak FLOP/s x MFU / 2 x params), with a tolerance for what the
# model counts differently (KV at context, lm_head without the input embedding).
@pytest.mark.parametrize(
    ("model", "gpu", "tp", "dtype", "rough_tps"),
    [
        (L8, "h100", 1, "bf16", 3.35e12 / 16.06e9),  # ~209 tok/s
        (L8, "h200", 1, "bf16", 4.8e12 / 16.06e9),  # ~299
        (L70, "h100", 4, "bf16", 4 * 3.35e12 / 141.1e9),  # ~95
        (L70, "h200", 2, "fp8", 2 * 4.8e12 / 71.6e9),  # ~134
        (MIX, "h100", 2, "bf16", 2 * 3.35e12 / 25.8e9),  # ~260: 12.9 B active params
        (L8, "a100", 1, "bf16", 2.039e12 / 16.06e9),  # ~127
    ],
)
def test_single_stream_bound_matches_rough_published_figures(model, gpu, tp, dtype, rough_tps):
    roofline = Roofline(Replica(model, GPUS[gpu], tp, weights_dtype=dtype))
    assert roofline.single_stream_bound_tps(context=0) == pytest.approx(rough_tps, rel=0.10)


def test_estimates_sit_below_the_bounds_at_plausible_values():
    roofline = Roofline(Replica(L8, H100))
    single = 1 / roofline.step_time(decode_step(1, 1024)).total_s
    assert 100 < single < roofline.single_stream_bound_tps(1024) < 230
    prefill = prefill_tokens_per_s(roofline, 2048, token_budget=8192)
    assert prefill == pytest.approx(989e12 * 0.5 / (2 * 8.03e9), rel=0.15)  # ~31k tok/s
