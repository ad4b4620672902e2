"""The real-tokenizer path: a `target.path` whose tokenizer is Kimi-K2.5-shaped remote code.

Kimi-K2.5's tokenizer is `tiktoken.model` + `tokenization_kimi.py` + `tokenizer_config.json`
(`auto_map` -> `TikTokenTokenizer`), loaded by `AutoTokenizer.from_pretrained(path,
trust_remote_code=True)`. The real files are not available offline; `kimi_remote_tokenizer.py`
writes the same three files around the local stand-in BPE (`data/kimi_tokenizer.py`), with a
`TikTokenTokenizer` written for these tests after the public copies of Moonshot's class. What is
checked:

(a) the folder loads through transformers' remote-code machinery (a class from
    `transformers_modules`, offline), and a tokenizer-only folder is refused without
    trust_remote_code;
(a') the same folder with the K2-family code as first published (bytes_to_unicode imported from
    transformers.models.gpt2.tokenization_gpt2) fails on the pinned transformers 5.19 with
    ImportError; `load_tokenizer` then builds `data/kimi_tiktoken.TikTokenTokenizer` from the files
    and says why in one line, and that tokenizer gives the remote-code class's ids, strings and
    tables on a corpus of ordinary text, unicode, whitespace runs (past the 25,000-character cut)
    and special-token strings; a folder whose code loads keeps its own class; one whose code fails
    and whose pattern cannot be read is refused with the fix;
(b) the Kimi renderer gives the same ids and loss masks with it as with the local tiktoken
    `Encoding`: the hand-written golden cases of test_kimi_format.py are re-run here with the
    remote-code tokenizer as `tok` (their expected text ids still come from the local
    tokenizer), plus random conversations; `special_tokens_of` finds the real ids;
(c) `prepare(job)` with `target=kimi_k25` (trust_remote_code true, chat_format kimi) and
    `target.path` = remote-code tokenizer + a tiny Kimi-K2.5 checkpoint builds the dataset with
    the Kimi renderer (and with the failing code, the same samples through the stand-in); with
    target.trust_remote_code=false it refuses. (Next to a kimi_k25
    config.json transformers 5.x does not refuse: it substitutes its own conversion of
    tiktoken.model, whose ordinary-text ids differ; `check_remote_code_tokenizer` in
    kimi_format.py, called by kimi_renderer, catches that.)

What it cannot check: Moonshot's own `tokenization_kimi.py` for K2.5 (not in the stored public
sources; the reproduction follows public copies of the K2-family class, and the stand-in was
compared with one of them by hand, docs/KIMI_K25.md §4). `special_tokens_of` and `text_encoder` rely
only on the transformers API: `get_added_vocab()` and `encode(text, add_special_tokens=False)`.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import test_kimi_format as golden  # its folder is on sys.path (pytest's default prepend import mode)
from kimi_remote_tokenizer import (
    TOKENIZER_FILES,
    UNK,
    tokenization_kimi_py,
    write_remote_tokenizer,
    write_tiny_kimi_model,
)
from specforge_k25.data.kimi_format import (
    KimiFormat,
    KimiSpecialTokens,
    check_remote_code_tokenizer,
    kimi_renderer,
    render_kimi,
    special_tokens_of,
)
from specforge_k25.data.kimi_tiktoken import load_tokenizer
from specforge_k25.data.kimi_tokenizer import build_kimi_local_tokenizer
from specforge_k25.data.sources import BadRow, normalize_row

# The golden cases of test_kimi_format.py, collected again here: they request the fixtures `tok`
# (-> the remote-code tokenizer below) and `E` (-> the LOCAL tokenizer's encode_ordinary), so each
# asserts that the remote-code tokenizer renders exactly the hand-written local-tokenizer ids.
from test_kimi_format import (  # noqa: F401  (collected by pytest)
    test_bad_rows,
    test_build_dataset_thinking_keeps_reasoning,
    test_build_dataset_thinking_refuses_rows_without_reasoning,
    test_build_dataset_with_kimi_renderer_instant,
    test_golden_bos_and_default_system,
    test_golden_instant_empty_think_not_supervised,
    test_golden_system_user_assistant_instant,
    test_golden_thinking_reasoning_on_last_turn,
    test_golden_tool_calls_and_tool_result_thinking,
    test_golden_tool_calls_instant_indices_and_options,
    test_golden_truncation,
    test_golden_two_turns_first_reasoning_dropped,
    test_missing_reasoning_empty_policy,
    test_property_mask_is_exactly_the_generated_tokens,
)

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf")
SPECIAL = KimiSpecialTokens()  # the documented ids (docs/KIMI_K25.md §4); test_kimi_format pins them as literals


@pytest.fixture(scope="module")
def local():
    return build_kimi_local_tokenizer()


@pytest.fixture(scope="module")
def remote_dir(tmp_path_factory, local):
    return write_remote_tokenizer(tmp_path_factory.mktemp("kimi_remote_tokenizer"), local)


@pytest.fixture(scope="module")
def tok(remote_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(remote_dir), trust_remote_code=True)


@pytest.fixture(scope="module")
def E(local):
    return local.encode_ordinary


# ----------------------------------------------------------------------------------------------
# (a) loading through transformers' remote code
# ----------------------------------------------------------------------------------------------


def test_folder_is_kimi_shaped(remote_dir):
    names = sorted(p.name for p in remote_dir.iterdir())
    assert names == sorted(TOKENIZER_FILES)  # no tokenizer.json: nothing for a fast tokenizer to load
    config = json.loads((remote_dir / "tokenizer_config.json").read_text())
    assert config["auto_map"] == {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    decoder = {int(i): t["content"] for i, t in config["added_tokens_decoder"].items()}
    named = {v: k for k, v in decoder.items() if not v.startswith("<|reserved_token_")}
    assert named == {**SPECIAL.by_name(), UNK[0]: UNK[1]}  # [UNK]: the class needs one (kimi_remote_tokenizer.py)
    assert sorted(decoder) == list(range(163584, 163840))
    lines = (remote_dir / "tiktoken.model").read_text().splitlines()
    assert len(lines) == 163584 and lines[0].split()[1] == "0"  # base64(token bytes) rank; specials follow


def test_remote_code_tokenizer_loads_via_auto_tokenizer(tok, local):
    cls = type(tok)
    assert cls.__name__ == "TikTokenTokenizer" and cls.__module__.startswith("transformers_modules.")
    assert cls.__module__.endswith(".tokenization_kimi") and not tok.is_fast
    for name, idx in SPECIAL.by_name().items():
        assert tok.convert_tokens_to_ids(name) == idx, name
        assert tok.decode([idx]) == name
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (163584, 163585, 163839)
    text = "Hello, world! 12345 日本語 émoji 🤖 {\"a\": 1}\n  \t x"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == local.encode_ordinary(text) and tok.decode(ids) == text
    assert tok.encode(text) == ids  # encode() adds no [BOS]/[EOS]
    # special-token strings in a text are read as the special tokens (as the served tokenizer does)
    assert tok.encode("<|im_user|>hi<|im_end|>", add_special_tokens=False) == [
        SPECIAL.im_user, *local.encode_ordinary("hi"), SPECIAL.im_end]


def test_refused_without_trust_remote_code(remote_dir):
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoTokenizer.from_pretrained(str(remote_dir), trust_remote_code=False)


_OFFLINE_PROBE = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
print(json.dumps({"module": type(tok).__module__,
                  "ids": tok.encode("Weather in Paris? <|im_end|>", add_special_tokens=False)}))
"""


@pytest.mark.slow
def test_loads_offline_in_a_fresh_process(remote_dir, local, tmp_path):
    """HF_HUB_OFFLINE=1 and an empty modules cache: the remote code is copied from the folder
    into HF_MODULES_CACHE and imported from there; no hub access is attempted."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", _OFFLINE_PROBE, str(remote_dir)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["module"].startswith("transformers_modules.") and got["module"].endswith(".tokenization_kimi")
    assert got["ids"] == local.encode_ordinary("Weather in Paris? ") + [SPECIAL.im_end]
    assert list((tmp_path / "modules").rglob("tokenization_kimi.py"))


# ----------------------------------------------------------------------------------------------
# (a') the K2-family code as first published: fails on transformers 5.19, load_tokenizer's stand-in
# ----------------------------------------------------------------------------------------------

# ordinary text, unicode, whitespace runs, special-token strings (documented, reserved, and the names
# the class adds past the vocabulary), and runs past Moonshot's 25,000-character cut
CORPUS = [
    "Hello, world! 12345 and 2024.5 don't WE'LL",
    "日本語の文章と中文混合 émoji 🤖 ÀÉÎõü ΑΒΓ абв עברית {\"a\": [1, 2]}",
    "  lead\t\ttabs\n\n\n  trail \r\n\u00a0\u2028 \u3000x  ",
    "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>",
    "[BOS] a <|reserved_token_163700|> b [EOT] <|start_header_id|> [UNK]",
    "",
    "x" * 24_998 + "hello world" + " " * 25_002 + "z",  # the cut in "hello" changes its ids
]


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory, local):
    return write_remote_tokenizer(tmp_path_factory.mktemp("kimi_release_tokenizer"), local, release=True)


@pytest.fixture(scope="module")
def fallback(release_dir):
    """load_tokenizer on the failing folder: (tokenizer, what it printed)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        tokenizer = load_tokenizer(str(release_dir), trust_remote_code=True)
    return tokenizer, err.getvalue()


def test_release_remote_code_fails_on_pinned_transformers(release_dir):
    from transformers import AutoTokenizer

    with pytest.raises(ImportError, match=r"cannot import name 'bytes_to_unicode' from "
                                          r"'transformers\.models\.gpt2\.tokenization_gpt2'"):
        AutoTokenizer.from_pretrained(str(release_dir), trust_remote_code=True)


def test_load_tokenizer_falls_back_with_one_line(fallback):
    tokenizer, printed = fallback
    cls = type(tokenizer)
    assert (cls.__module__, cls.__name__) == ("specforge_k25.data.kimi_tiktoken", "TikTokenTokenizer")
    assert printed.count("\n") == 1 and printed.rstrip() == printed.rstrip().splitlines()[-1]
    assert "tokenization_kimi.TikTokenTokenizer fails on transformers" in printed
    assert "ImportError: cannot import name 'bytes_to_unicode'" in printed and "same ids" in printed
    assert tokenizer.fallback_reason in printed


def test_fallback_gives_the_remote_code_ids(fallback, tok, local):
    """Against the remote-code class on the same files: ids (every encode path), token strings,
    decoded text and the token tables."""
    fb = fallback[0]
    for text in CORPUS:
        for kwargs in ({}, {"add_special_tokens": False}, {"add_special_tokens": True}):
            assert fb.encode(text, **kwargs) == tok.encode(text, **kwargs), (text[:40], kwargs)
        ids = tok.encode(text)
        assert fb.encode(text, allow_special_tokens=False) == tok.encode(text, allow_special_tokens=False)
        assert fb(text)["input_ids"] == tok(text)["input_ids"] and fb.tokenize(text) == tok.tokenize(text)
        for kwargs in ({}, {"skip_special_tokens": False}, {"skip_special_tokens": True}):
            assert fb.decode(ids, **kwargs) == tok.decode(ids, **kwargs), (text[:40], kwargs)
    assert fb.encode(CORPUS[0], add_special_tokens=False) == local.encode_ordinary(CORPUS[0])
    long_ids = tok.encode(CORPUS[-1])
    assert len(long_ids) > 2 and fb.decode(long_ids) == CORPUS[-1]  # cut, and whole again
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "vocab_size", "all_special_ids"):
        assert getattr(fb, name) == getattr(tok, name), name
    assert len(fb) == len(tok) and fb.get_added_vocab() == tok.get_added_vocab()
    assert fb.get_vocab() == tok.get_vocab()
    assert special_tokens_of(fb) == SPECIAL and fb.convert_tokens_to_ids("<|im_end|>") == SPECIAL.im_end
    check_remote_code_tokenizer(fb)  # the class the folder's auto_map names


def test_load_tokenizer_keeps_working_remote_code(remote_dir):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        tokenizer = load_tokenizer(str(remote_dir), trust_remote_code=True)
    assert type(tokenizer).__module__.startswith("transformers_modules.") and not err.getvalue()


def test_load_tokenizer_refuses_what_it_cannot_stand_in_for(release_dir, tmp_path):
    """Failing remote code without a literal pattern to read: refused, naming the failure and the fix."""
    for name in TOKENIZER_FILES:
        (tmp_path / name).symlink_to(release_dir / name)
    (tmp_path / "tokenization_kimi.py").unlink()
    source = (release_dir / "tokenization_kimi.py").read_text()
    (tmp_path / "tokenization_kimi.py").write_text(source.replace('pat_str = "|".join(', 'pat_str = str("|").join(', 1))
    with pytest.raises(ValueError, match=r"fails on transformers .*ImportError.*no literal `pat_str`.*"
                                         r"transformers\.convert_slow_tokenizer") as err:
        load_tokenizer(str(tmp_path), trust_remote_code=True)
    assert isinstance(err.value.__cause__, ImportError)


# ----------------------------------------------------------------------------------------------
# (b) the renderer with it: same ids and masks as with the local tokenizer
# ----------------------------------------------------------------------------------------------


def test_special_tokens_of_finds_the_real_ids(tok):
    assert special_tokens_of(tok) == SPECIAL
    assert tok.get_added_vocab()["<|im_middle|>"] == golden.IM_MIDDLE == 163601


_INSTANT_TOOLS = [
    {"role": "user", "content": "Plan"},
    {"role": "assistant", "content": "Checking.",
     "tool_calls": [golden._call("get_weather", {"city": "Oslo"}), golden._call("get_time", {})]},
    {"role": "tool", "content": "Rain", "tool_call_id": "functions.get_weather:0"},
    {"role": "assistant", "content": "Rain at 9 — 日本 🤖.\n\n  Bye"},
]
CASES = [
    ([golden.SYS, golden.USER, {"role": "assistant", "content": "4."}], "instant", KimiFormat()),
    ([golden.SYS, golden.USER, {"role": "assistant", "content": "4.", "reasoning_content": "Add them."}],
     "thinking", KimiFormat()),
    (golden.TWO_TURNS, "thinking", KimiFormat()),
    (golden.TWO_TURNS, "thinking", KimiFormat(supervise_history=False)),
    (golden.TOOL_LOOP, "thinking", KimiFormat()),
    (golden.TOOL_LOOP, "thinking", KimiFormat(keep_reasoning="final")),
    (_INSTANT_TOOLS, "instant", KimiFormat(tool_result_prefix="## Return of {tool_call_id}\n", add_bos=True)),
    (_INSTANT_TOOLS, "instant", KimiFormat(tool_call_index="per_message", default_system="You are Kimi.")),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_same_ids_and_mask_as_local_tokenizer(tok, local, case):
    messages, mode, fmt = CASES[case]
    want = render_kimi(local, messages, 4096, mode=mode, fmt=fmt)
    renderer = kimi_renderer(tok, mode=mode, fmt=fmt)
    for got in (render_kimi(tok, messages, 4096, mode=mode, fmt=fmt), renderer(messages, 4096)):
        assert got.input_ids.tolist() == want.input_ids.tolist()
        assert got.loss_mask.tolist() == want.loss_mask.tolist()
        assert got.loss_mask.any()


@pytest.mark.parametrize("mode", ["thinking", "instant"])
def test_property_same_ids_and_mask_as_local_tokenizer(tok, local, mode):
    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(golden.conversations(mode), st.integers(8, 200))
    def run(messages, max_length):
        try:
            want = render_kimi(local, messages, max_length, mode=mode)
        except BadRow as bad:
            with pytest.raises(BadRow) as err:
                render_kimi(tok, messages, max_length, mode=mode)
            assert err.value.reason == bad.reason
            return
        got = render_kimi(tok, messages, max_length, mode=mode)
        assert (got.input_ids.tolist(), got.loss_mask.tolist()) == (want.input_ids.tolist(), want.loss_mask.tolist())

    run()


# ----------------------------------------------------------------------------------------------
# (c) the training setup: prepare(job) with target=kimi_k25 and target.path = this folder
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kimi_target_dir(tmp_path_factory, smollm2_path, local):
    """tiktoken.model + tokenization_kimi.py + tokenizer_config.json + config.json +
    model.safetensors (the tiny Kimi-K2.5 with Kimi's 163840 vocab)."""
    from specforge_k25.target_engine.models import tiny_kimi_k25_path

    folder = tmp_path_factory.mktemp("Kimi-K2.5-tiny")
    write_remote_tokenizer(folder, local)
    write_tiny_kimi_model(folder, tiny_kimi_k25_path(Path(smollm2_path)))
    return folder


def _compose(overrides):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import specforge_k25.train.__main__  # noqa: F401  (registers the schema)

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=overrides))


def _rows():
    """golden.ROWS (a row with "<|im_end|>" typed in the text, given reasoning here so that it is
    refused for the special token, + 6 thinking rows) + a tool-call loop."""
    bad = copy.deepcopy(golden.ROWS[0])
    bad["messages"][-1]["reasoning_content"] = "r"
    tool_row = {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need weather.",
         "tool_calls": [golden._call("get_weather", {"city": "Paris"})]},
        {"role": "tool", "content": "Sunny, 21C", "tool_call_id": "functions.get_weather:0"},
        {"role": "assistant", "content": "Sunny, 21C.", "reasoning_content": "It is sunny."},
    ]}
    return [bad, *golden.ROWS[1:], tool_row]


def test_prepare_uses_remote_code_tokenizer_and_kimi_renderer(kimi_target_dir, local, tmp_path):
    from specforge_k25.setup.run import prepare

    rows = _rows()
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = ["+hw=cpu", "target=kimi_k25", f"target.path={kimi_target_dir}", "data.source=jsonl",
                 f"data.path={data}", "data.num_samples=5", "data.heldout_samples=2", "data.max_length=128",
                 "train.progress=false"]
    job = _compose(overrides)
    # conf/target/kimi_k25.yaml: the switches this path depends on
    assert job.target.trust_remote_code is True and job.target.chat_format == "kimi"
    assert job.target.chat_mode == "thinking" and job.target.end_of_turn_token == "<|im_end|>"

    setup = prepare(job)
    cls = type(setup.tokenizer)
    assert cls.__name__ == "TikTokenTokenizer" and cls.__module__.startswith("transformers_modules.")
    assert setup.model_path == str(kimi_target_dir) and setup.info.vocab_size == 163840
    assert setup.end_of_turn_id == SPECIAL.im_end  # what the export and regeneration stop at
    samples = setup.data.train + setup.data.heldout
    assert (len(setup.data.train), len(setup.data.heldout)) == (5, 2) and setup.data.rows_seen == 8
    assert dict(setup.data.skipped) == {"special_token_in_text": 1}  # the row with "<|im_end|>" typed in
    for s in samples:
        ids = s.input_ids.tolist()
        assert {SPECIAL.im_user, SPECIAL.im_assistant, SPECIAL.im_middle, SPECIAL.im_end, SPECIAL.think,
                SPECIAL.think_end} <= set(ids)
        assert s.loss_mask.any() and not s.loss_mask[0] and max(ids) < setup.info.vocab_size
    assert any(SPECIAL.tool_calls_section_begin in s.input_ids.tolist() for s in samples)
    # exactly the thinking-mode renderings of the local tokenizer
    got = sorted(s.input_ids.tolist() + [-1] + s.loss_mask.int().tolist() for s in samples)
    want = []
    for r in rows[1:]:
        s = render_kimi(local, normalize_row(r, agentic=True), 128, mode="thinking")
        want.append(s.input_ids.tolist() + [-1] + s.loss_mask.int().tolist())
    assert got == sorted(want)

    # The same folder with the code as first published (fails on transformers 5.19): prepare goes on
    # with load_tokenizer's stand-in, to the same samples
    release = tmp_path / "Kimi-K2.5-release"
    release.mkdir()
    for f in kimi_target_dir.iterdir():
        (release / f.name).symlink_to(f)
    (release / "tokenization_kimi.py").unlink()
    (release / "tokenization_kimi.py").write_text(tokenization_kimi_py(local._pat_str, release=True))
    fell_back = prepare(_compose([*overrides[:2], f"target.path={release}", *overrides[3:]]))
    assert type(fell_back.tokenizer).__module__ == "specforge_k25.data.kimi_tiktoken"
    assert fell_back.end_of_turn_id == SPECIAL.im_end
    assert [(s.input_ids.tolist(), s.loss_mask.tolist()) for s in fell_back.data.train + fell_back.data.heldout] == [
        (s.input_ids.tolist(), s.loss_mask.tolist()) for s in samples]

    # Without the flag, transformers 5.x does not refuse the folder (config.json says kimi_k25): it
    # converts tiktoken.model into its own fast tokenizer (right special ids, generic regex; measured:
    # "Count 12345 and 2024." -> [4327, 32, 7483, 3389, 279, 32, 922, 50, 52, 46] vs the served
    # [4327, 464, 1892, 3389, 279, 967, 3037, 46]). prepare refuses it (kimi_renderer's check).
    job = _compose([*overrides, "target.trust_remote_code=false"])
    with pytest.raises(ValueError, match="remote code") as err:
        prepare(job)
    assert "was loaded as transformers." in str(err.value) and "target.trust_remote_code=true" in str(err.value)


def test_prepare_refuses_token_ids_outside_the_target_vocab(kimi_target_dir, tmp_path, monkeypatch):
    """A tokenizer that does not belong to the weights (here: a config reporting 163584 tokens, below
    Kimi's special ids) is refused before any process starts, not discovered by the engine."""
    import dataclasses

    from specforge_k25.setup import run as setup_run

    real = setup_run.read_target_info
    monkeypatch.setattr(setup_run, "read_target_info", lambda path: dataclasses.replace(real(path), vocab_size=163584))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()[1:]))
    job = _compose(["+hw=cpu", "target=kimi_k25", f"target.path={kimi_target_dir}", "data.source=jsonl",
                    f"data.path={data}", "data.num_samples=3", "data.heldout_samples=1", "data.max_length=128",
                    "draft.vocab_size=64", "train.progress=false"])
    with pytest.raises(ValueError, match=r"token id 163\d{3}, outside the target's vocab \(163584\)"):
        setup_run.prepare(job)


def test_check_remote_code_tokenizer(tok, local, remote_dir):
    """A tokenizer whose folder maps AutoTokenizer to remote code must be that class; tokenizers
    without a folder (tiktoken Encoding) or without auto_map pass."""

    class Substitute:  # what transformers builds from tiktoken.model without trust_remote_code
        name_or_path = str(remote_dir)

        def get_added_vocab(self):
            return tok.get_added_vocab()

        def encode(self, text, add_special_tokens=False):
            return tok.encode(text, add_special_tokens=False)

    with pytest.raises(ValueError, match=r"remote code \['tokenization_kimi.TikTokenTokenizer'\]"):
        kimi_renderer(Substitute(), mode="thinking")
    check_remote_code_tokenizer(tok)
    check_remote_code_tokenizer(local)
    Substitute.name_or_path = str(remote_dir / "nowhere")
    check_remote_code_tokenizer(Substitute())
