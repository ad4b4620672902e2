"""Zero capture points (`target.aux_layers=[]`, an MTP-style head that reads only the final state):
[] is no capture point, null the default three; every mapping to SGLang / vLLM ids takes [], the
SGLang engine then asks for no EAGLE-3 capture and hands aux [N, 0] beside its final state. The
engine itself runs with zero points in tests/target_engine/test_target.py
(test_sglang_without_capture_points_gives_empty_aux_and_hf_final)."""
from __future__ import annotations

import pytest
import torch

from specforge_k25.target_engine.layers import (
    DEEPSEEK_RULE,
    LLAMA_RULE,
    capture_points_of_sglang_ids,
    default_capture_points,
    resolve_capture_points,
    sglang_layer_ids,
    validate_capture_points,
    vllm_layer_ids,
)
from specforge_k25.target_engine.sglang_engine import SGLangTarget, engine_server_args, packed_aux


def test_empty_aux_layers_is_no_capture_point_and_null_the_default():
    assert resolve_capture_points(None, 30) == default_capture_points(30) == [2, 15, 27]
    assert resolve_capture_points([], 30) == []
    assert resolve_capture_points([3, 9], 30) == [3, 9]
    assert validate_capture_points([], 61) == []
    with pytest.raises(ValueError):  # the checks still apply to a non-empty list
        resolve_capture_points([0, 3], 30)


@pytest.mark.parametrize("rule", [LLAMA_RULE, DEEPSEEK_RULE])
def test_no_capture_point_maps_to_no_server_id(rule):
    """Both servers' ids of [] are [] (the DeepSeek rule's check of the first point included)."""
    assert sglang_layer_ids([], rule) == []
    assert capture_points_of_sglang_ids([], rule) == []
    assert vllm_layer_ids([]) == []


def _fields(layer_ids, pp_size=1):
    return engine_server_args("/m", device="cpu", dtype="float32", tp_size=1, attention_backend=None,
                              mem_fraction_static=0.6, max_total_tokens=64, trust_remote_code=False,
                              layer_ids=layer_ids, nnodes=1, node_rank=0, dist_init_addr=None, dist_timeout=None,
                              load_threads=1, pp_size=pp_size)


def test_an_engine_without_capture_points_asks_sglang_for_no_capture():
    """SGLang 0.5.23 refuses an empty return_aux_hidden_state_layer_ids, and its capture switched on
    with no layer makes the text model return a plain tensor where the causal LM unpacks a pair: with
    zero points the engine starts without the EAGLE-3 capture fields."""
    capture = {"enable_return_aux_hidden_states", "speculative_algorithm", "return_aux_hidden_state_layer_ids"}
    assert not capture & set(_fields([]))
    with_points = _fields([1, 14, 26])
    assert with_points["return_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert with_points["enable_return_aux_hidden_states"] and with_points["speculative_algorithm"] == "EAGLE3"
    assert not capture & set(_fields([1, 14, 26], pp_size=2))  # pipeline stages capture through hooks


def test_no_aux_captured_is_an_empty_aux_of_the_tokens():
    final = torch.randn(5, 4)
    for nothing in (None, [], ()):  # the plain engine's hook; a pipeline stage's empty collector
        aux = packed_aux(nothing, final, 0)
        assert aux.shape == (5, 0) and aux.dtype == final.dtype
    with pytest.raises(RuntimeError, match="captured 0 aux hidden states of width 4, the capture points ask for 3"):
        packed_aux(None, final, 3)
    with pytest.raises(RuntimeError, match="captured 1 aux hidden states .* ask for 0"):
        packed_aux([torch.zeros(5, 4)], final, 0)


def test_the_capture_hook_takes_the_plain_final_state_without_capture_points():
    """What the text model's forward hook saw -> (final, aux as SGLang gave it)."""
    final = torch.randn(3, 4)
    target = object.__new__(SGLangTarget)  # no engine: only the hook's bookkeeping
    target.num_aux, target._captured = 0, final
    got, aux = target._hook_output()
    assert got is final and aux is None and target._captured is None
    target._captured = (final, [torch.zeros(3, 4)])  # a pair where none was asked for
    with pytest.raises(RuntimeError, match="returned tuple for an engine without capture points"):
        target._hook_output()
    target.num_aux, target._captured = 1, final  # and the other way round
    with pytest.raises(RuntimeError, match="no \\(final, aux\\) pair"):
        target._hook_output()
