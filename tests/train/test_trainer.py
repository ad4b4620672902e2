"""Fast tests of the training loop (train/trainer.py, train/learner.py) without a target engine: a
stand-in stream whose hidden states are a fixed function of the token ids, and a stand-in for the
all-reduce. They pin three regressions the multi-process end-to-end tests also catch, in seconds:
a slot handed back before its copy, the global loss-count normaliser, the data cursor on resume."""
from __future__ import annotations

import copy
import json
import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from specforge_k25.config import JobConfig
from specforge_k25.data.dataset import TokenizedData
from specforge_k25.data.tokenize import Sample
from specforge_k25.draft.eagle3.loss import loss_positions
from specforge_k25.plan import facts_from_folder, resolve_draft
from specforge_k25.setup.run import RunSetup
from specforge_k25.stream.target_stream import StreamError
from specforge_k25.stream.ring import EndOfStream, SlotMessage
from specforge_k25.target_engine.hf_config import read_target_info
from specforge_k25.train.distributed import Ranks
from specforge_k25.draft.eagle3.config import Eagle3Spec
from specforge_k25.draft.registry import get_method, method_of
from specforge_k25.draft.spec import carried_over
from specforge_k25.export.serving import load_exported_draft
from specforge_k25.train.learner import DraftLearner
from specforge_k25.train.feed import take_batches
from specforge_k25.train.schedule import padding_share
from specforge_k25.train.learner import build_learner
from specforge_k25.train.trainer import Trainer

V, H = 96, 32


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory) -> RunSetup:
    """A 4-layer Llama folder (random weights: only its embedding and lm_head are read) and 14
    synthetic conversations (12 train, 2 held-out) with loss on their second half."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    g = torch.Generator().manual_seed(1)
    samples = []
    for n in range(14):
        T = 10 + (n * 7) % 13
        ids = torch.randint(1, V, (T,), generator=g)
        mask = torch.zeros(T, dtype=torch.bool)
        mask[T // 2:] = True
        samples.append(Sample(ids, mask))
    facts = facts_from_folder(folder)
    draft_cfg = resolve_draft(Eagle3Spec(vocab_size=48), facts)
    return RunSetup(str(folder), read_target_info(folder), [1, 2, 3], [0, 1, 2], None,
                    TokenizedData(samples[:12], samples[12:]), get_method("eagle3"), draft_cfg)


class FakeStream:
    """TargetStream's trainer-side interface. The hidden states of token v are fixed rows of two
    random tables; `release` scribbles NaN over the slot, as the target's next batch would."""

    tables = None

    def __init__(self, samples, batches, fail_at: int | None = None):
        if FakeStream.tables is None:
            g = torch.Generator().manual_seed(2)
            FakeStream.tables = (torch.randn(V, 3 * H, generator=g), torch.randn(V, H, generator=g))
        self.samples, self.batches, self.fail_at = samples, batches, fail_at
        self.wait_s, self.should_stop, self.target_io = 0.0, lambda: False, None
        self.slot: tuple[torch.Tensor, torch.Tensor] | None = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __iter__(self):
        aux_table, final_table = self.tables
        for item, ids in enumerate(self.batches):
            if item == self.fail_at:
                raise StreamError(f"target process died at batch {item}")
            tokens = torch.cat([self.samples[i].input_ids for i in ids])
            self.slot = (aux_table[tokens].clone(), final_table[tokens].clone())
            yield SlotMessage(0, item, [len(self.samples[i].input_ids) for i in ids]), *self.slot
        self.target_io = EndOfStream(len(self.batches), 0, 0)

    def release(self, msg) -> None:
        for t in self.slot:
            t.fill_(float("nan"))

    def depth(self) -> int:
        return 0

    def close(self) -> None:
        pass


def _job(tmp_path, **train) -> JobConfig:
    job = JobConfig()
    defaults = dict(batch_size=2, grad_accum=2, logger="none", progress=False, out_dir=str(tmp_path), lr=1e-3,
                    warmup_ratio=0.0)
    return dataclasses.replace(job, train=dataclasses.replace(job.train, **{**defaults, **train}),
                               draft=dataclasses.replace(job.draft, ttt_length=3))


# ------------------------------------------------------------- 1. slot released after its copy
def test_a_slot_goes_back_only_after_the_batch_is_copied_out(tiny_setup, tmp_path):
    """The stand-in overwrites a slot with NaN the moment it is released: the batch the trainer
    keeps must still hold the target's numbers (released before the copy, or kept as a view of the
    slot, it would hold NaN)."""
    job = _job(tmp_path)
    trainer = build_learner(job, tiny_setup, steps=1, device=torch.device("cpu"))
    samples = tiny_setup.data.train
    shares = [[0, 1], [], [2]]
    stream = FakeStream(samples, [s for s in shares if s])
    aux_table, final_table = FakeStream.tables
    got = list(take_batches(stream, shares, samples, trainer.make_batch))
    assert [share for share, _, _ in got] == shares and got[1][1] is None
    for share, batch, _ in (got[0], got[2]):
        for b, i in enumerate(share):
            n = len(samples[i].input_ids)
            assert torch.equal(batch.aux_hidden[b, :n], aux_table[samples[i].input_ids])
        assert torch.isfinite(batch.teacher.draft_logits).all() and torch.isfinite(batch.teacher.logsumexp).all()
    assert stream.target_io is not None  # the stream ran to its end message


# ------------------------------------------------------- 2. the global loss-count normaliser
@dataclass(frozen=True)
class StandInRanks(Ranks):
    """Rank `rank` of 2 in one process: each all-reduce adds what the other rank contributes
    (queued in call order) instead of calling torch.distributed."""

    peer: list = field(default_factory=list, hash=False, compare=False)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        t += self.peer.pop(0).to(t.dtype)
        return t


def _sgd_trainer(draft, lm_head, ranks=None, accum=1) -> DraftLearner:
    """Plain SGD with lr 1 and no clipping: the update IS the summed gradient (AdamW's first step
    is nearly sign(g) and would hide a mis-scaled gradient)."""
    opt = torch.optim.SGD(draft.trainable_parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    method = method_of(draft)
    return DraftLearner(method, draft, lm_head, opt, sched, spec=carried_over(Eagle3Spec(ttt_length=3), method.spec_class),
                        grad_accum=accum, grad_clip=1e9,
                        teacher_chunk=64, autocast_bf16=False, ranks=ranks)


def _with_method(setup: RunSetup, method: str, **spec_fields) -> RunSetup:
    """The tiny setup training another draft method (`spec_fields`: more draft.* fields)."""
    if method == setup.method.name and not spec_fields:
        return setup
    spec = carried_over(Eagle3Spec(vocab_size=48), get_method(method).spec_class)
    spec = dataclasses.replace(spec, **spec_fields)
    return dataclasses.replace(setup, method=get_method(method),
                               draft_cfg=resolve_draft(spec, facts_from_folder(setup.model_path)))


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_two_ranks_through_the_learner_make_the_single_rank_update(tiny_setup, tmp_path, method):
    """Rank r trains on sample r of a 2-sample micro-batch; the loss is normalised by the GLOBAL
    loss-position count and the gradients summed: the update equals one rank's on both samples.
    DFlash: every candidate anchor is drawn (num_anchors exceeds them), so both sides train on
    the same blocks; its normalizer counts block positions (method.loss_positions)."""
    tiny_setup = _with_method(tiny_setup, method)
    base = build_learner(_job(tmp_path), tiny_setup, steps=1, device=torch.device("cpu"))
    samples = tiny_setup.data.train[:2]
    stream = FakeStream(samples, [[0], [1], [0, 1]])
    (_, b0, _), (_, b1, _), (_, both, _) = take_batches(stream, [[0], [1], [0, 1]], samples, base.make_batch)
    counts = [base.method.loss_positions(b, base.depth) for b in (b0, b1)]
    if method == "eagle3":
        assert all(torch.equal(c, loss_positions(b.loss_mask, b.lengths, b.teacher, 3)) for c, b in zip(counts, (b0, b1)))
    else:  # no teacher; the counts are per block position
        assert both.teacher is None and len(counts[0]) == tiny_setup.draft_cfg.block_size - 1 and counts[0].sum() > 0

    one = _sgd_trainer(copy.deepcopy(base.draft), base.lm_head)
    one.train_micro(both)
    one.optimizer_step()

    rank1 = _sgd_trainer(copy.deepcopy(base.draft), base.lm_head, StandInRanks(rank=1, world=2, peer=[counts[0]]))
    rank1.train_micro(b1)
    grads1 = [p.grad.clone() for p in rank1.draft.trainable_parameters()]
    rank0 = _sgd_trainer(copy.deepcopy(base.draft), base.lm_head,
                         StandInRanks(rank=0, world=2, peer=[counts[1], *grads1]))
    rank0.train_micro(b0)
    rank0.optimizer_step()

    start = dict(base.draft.named_parameters())
    for (name, p_one), p_two in zip(one.draft.named_parameters(), rank0.draft.parameters()):
        if not p_one.requires_grad:
            continue
        step_one, step_two = p_one - start[name], p_two - start[name]
        assert step_one.abs().max() > 0, name
        rel = (step_two - step_one).abs().max() / step_one.abs().max()
        # DFlash: the 2-sample batch's attention runs over the longer sample's keys (fp32 sums in
        # another order); a wrong normalizer is off by O(1)
        assert rel < (1e-5 if method == "eagle3" else 1e-4), f"{name}: relative difference {rel:.2e}"


# ---------------------------------------------------------------- 3. the data cursor on resume
def _run(job, setup, fail_at=None):
    """One Trainer run over the stand-in stream; returns (trainer, the batches its stream served)."""
    served = []

    def factory(job_, setup_, samples, batches):
        served.extend(batches)
        return FakeStream(samples, batches, fail_at)

    trainer = Trainer(job, setup, job.train.out_dir, Ranks(), factory)
    try:
        trainer.run()
    except StreamError:
        pass
    return trainer, served


@pytest.mark.parametrize("method", ["eagle3", "eagle3_mla", "dflash"])
def test_resume_continues_from_the_step_boundary_exactly(tiny_setup, tmp_path, method):
    """12 samples, batch 2, accumulation 2: 3 optimizer steps, plus a held-out batch at the start
    and the end. The target dies in the middle of step 3's accumulation; the resumed run must ask
    the target for exactly the rest of the uninterrupted run's batches, from step 3's first
    micro-batch on, and end with the same weights, bit for bit, and the same counters. For every
    draft method: the loop names none, and each one's export loads back as the trained model
    (DFlash: its anchors drawn again for the same batches, the target's lm_head attached)."""
    # DFlash: fewer anchors than a sequence allows (which ones are drawn matters)
    tiny_setup = _with_method(tiny_setup, method, **({"num_anchors": 3, "block_size": 4} if method == "dflash" else {}))
    full, full_batches = _run(_job(tmp_path / "full"), tiny_setup)
    assert full.progress.step == 3 and len(full_batches) == 8  # eval, 6 train micro-batches, eval
    # batch 6 is step 3's second micro-batch: step 2 ended after batch 4, its checkpoint says "resume at item 5"
    broken, _ = _run(_job(tmp_path / "resume", checkpoint_every=1), tiny_setup, fail_at=6)
    assert broken.saved.step == 2 and broken.saved.schedule_item == 5
    resumed, resumed_batches = _run(_job(tmp_path / "resume", resume="auto"), tiny_setup)
    assert resumed_batches == full_batches[5:]
    assert dataclasses.asdict(resumed.progress) == dataclasses.asdict(full.progress)
    for (name, a), b in zip(full.learner.draft.state_dict().items(), resumed.learner.draft.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed.evals["end"] == full.evals["end"]
    # the padding the batches carried, counted in the loop, is what the schedule's lengths imply
    (summary,) = (tmp_path / "full").rglob("summary.json")
    lengths = [len(s.input_ids) for s in tiny_setup.data.train]
    share = padding_share(full.schedule, lengths, 2)
    assert share > 0 and json.loads(summary.read_text())["padding_share"] == round(share, 4)
    (export,) = (tmp_path / "full").rglob("export/config.json")
    embed = full.learner.draft.embed_tokens.weight
    back = load_exported_draft(export.parent, embed)
    assert type(back) is type(full.learner.draft)
    for name, t in full.learner.draft.state_dict().items():
        assert torch.equal(back.state_dict()[name], t.float()), name
    ids, aux = torch.randint(0, V, (1, 6)), torch.randn(1, 6, 3 * H)  # the config too: same first step
    if tiny_setup.method.needs_teacher:
        pos = torch.arange(6)[None]
        outs = [m.logits(m.step(ids, m.project(aux), pos, [])[0]) for m in (full.learner.draft, back)]
    else:  # the block after a 6-token prefix, through the target's lm_head (not in the export)
        tiny_setup.method.attach_target(back, full.learner.lm_head)
        outs = [m.logits(m.draft_block(aux[0], ids[0, -1])) for m in (full.learner.draft, back)]
    assert torch.equal(*outs)


def test_the_export_ends_a_served_turn_at_the_runs_end_of_turn_token(tiny_setup, tmp_path):
    """The export's eos is the run's end-of-turn token first (Kimi-K2.5: <|im_end|>, not its
    config's [EOS]), then the target config's eos."""

    _run(_job(tmp_path, grad_accum=1), dataclasses.replace(tiny_setup, end_of_turn_id=5))
    (config,) = tmp_path.rglob("export/config.json")
    assert json.loads(config.read_text())["eos_token_id"] == [5, tiny_setup.info.eos_token_id]


# ------------------------------------------------------------------- regeneration through the loop
class FakeRegenStream(FakeStream):
    """The stand-in target answers each prompt itself: the prompt reversed, cut to (sum of the
    prompt) % 7 tokens, then the stop id 0 when that fits the budget; the slot carries the ids."""

    def __init__(self, samples, batches, regen, fail_at=None):
        super().__init__(samples, batches, fail_at)
        self.regen = regen

    def answer(self, prompt: torch.Tensor) -> torch.Tensor:
        n, budget = int(prompt.sum()) % 7, self.regen.budget(len(prompt))
        answer = prompt.flip(0)[:min(n, budget)]
        return torch.cat([answer, torch.zeros(1, dtype=torch.int64)]) if n < budget else answer

    def __iter__(self):
        from specforge_k25.data.regenerate import regeneration_prompt

        aux_table, final_table = self.tables
        for item, ids in enumerate(self.batches):
            if item == self.fail_at:
                raise StreamError(f"target process died at batch {item}")
            prompts = [regeneration_prompt(self.samples[i]) for i in ids]
            seqs = [torch.cat([p, self.answer(p)]) for p in prompts]
            tokens = torch.cat(seqs)
            self.slot, self.slot_ids = (aux_table[tokens].clone(), final_table[tokens].clone()), tokens.clone()
            yield SlotMessage(0, item, [len(s) for s in seqs], 0.0, [len(p) for p in prompts]), *self.slot
        self.target_io = EndOfStream(len(self.batches), 0, 0)

    def ids(self, msg) -> torch.Tensor:
        return self.slot_ids


def _run_regen(job, setup, fail_at=None, served=None):
    def factory(job_, setup_, samples, batches, before=(), known=None):
        if served is not None:
            served.append((list(before), list(batches)))
        return FakeRegenStream(samples, batches, setup.regeneration, fail_at)

    trainer = Trainer(job, setup, job.train.out_dir, Ranks(), factory)
    try:
        return trainer, trainer.run()
    except StreamError:
        return trainer, None


def test_regenerated_answers_are_what_the_loop_trains_on_and_a_resume_redoes_them(tiny_setup, tmp_path):
    """The trainer builds each sample from the target's conversation (prompt + its answer): the
    loss covers the answer, tokens are counted from it, every answer is written to
    regenerated.jsonl; a run that dies and resumes regenerates the rest identically."""

    from specforge_k25.data.regenerate import regeneration_prompt
    from specforge_k25.target_engine.sampling import Regeneration

    setup = dataclasses.replace(tiny_setup, regeneration=Regeneration(max_new_tokens=5, max_length=40, stop_ids=(0,)))
    served = []
    full, summary = _run_regen(_job(tmp_path / "full"), setup, served=served)
    oracle = FakeRegenStream(setup.data.train + setup.data.heldout, [], setup.regeneration)
    lines = [json.loads(x) for x in (tmp_path / "full" / "regenerated.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 + 12  # held-out batch at start and end, 12 training samples once
    for line in lines:
        sample = (setup.data.train + setup.data.heldout)[line["sample"]]
        answer = oracle.answer(regeneration_prompt(sample))
        expect = 0 if len(answer) == 1 and int(answer[0]) == 0 else len(answer)  # only the stop id: empty
        assert line["answer_tokens"] == expect, line
    trained = [x for x in lines if x["kind"] == "train"]
    assert summary["tokens_trained"] == sum(
        len(regeneration_prompt(setup.data.train[x["sample"]])) + len(oracle.answer(
            regeneration_prompt(setup.data.train[x["sample"]]))) for x in trained)
    assert summary["regeneration"]["answer_tokens_in_loss"] == sum(x["answer_tokens"] for x in lines)

    _run_regen(_job(tmp_path / "resume", checkpoint_every=1), setup, fail_at=6)
    resumed, _ = _run_regen(_job(tmp_path / "resume", resume="auto"), setup, served=served)
    assert dataclasses.asdict(resumed.progress) == dataclasses.asdict(full.progress)
    # the resumed target also gets the batches run before it, to decode in the same groups
    (none, whole), (before, rest) = served
    assert none == [] and before == whole[:5] and rest == whole[5:]
    for (name, a), b in zip(full.learner.draft.state_dict().items(), resumed.learner.draft.state_dict().values()):
        assert torch.equal(a, b), name


# ------------------------------------------------ regenerated answers decoded once, saved, reused
class AheadRegenStream(FakeStream):
    """The stand-in target decodes through the real `Regenerated` (stream/target_process.py: its
    decode groups, each prompt once per run, the saved answers it is given never decoded); its
    engine answers as FakeRegenStream does and records every prompt it decodes in `decoded`."""

    def __init__(self, samples, batches, regen, decoded: list, before=(), known=None, fail_at=None):
        super().__init__(samples, batches, fail_at)
        self.regen, self.before, self.known, self.decoded = regen, list(before), known, decoded
        self.oracle = FakeRegenStream(samples, [], regen)
        self.max_total_tokens = None

    def generate(self, prompts, budgets, regen):
        self.decoded.extend(tuple(p.tolist()) for p in prompts)
        return [self.oracle.answer(p)[:b].tolist() for p, b in zip(prompts, budgets)]

    def __iter__(self):
        from specforge_k25.data.regenerate import regeneration_prompt
        from specforge_k25.stream.target_process import Regenerated
        from specforge_k25.target_engine.factory import TargetSpec

        prompts = [regeneration_prompt(s) for s in self.samples]
        offsets = torch.tensor([0] + [len(p) for p in prompts]).cumsum(0)
        spec = TargetSpec(engine="hf", model_path="m", architecture="x", capture_points=[1, 2, 3],
                          regeneration=self.regen)
        ahead = Regenerated(self, spec, torch.cat(prompts), offsets, [*self.before, *self.batches],
                            start=len(self.before), known=self.known)
        aux_table, final_table = self.tables
        for item in range(len(self.batches)):
            if item == self.fail_at:
                raise StreamError(f"target process died at batch {item}")
            seqs, prompt_lengths = ahead.take(len(self.before) + item)
            tokens = torch.cat(seqs)
            self.slot, self.slot_ids = (aux_table[tokens].clone(), final_table[tokens].clone()), tokens.clone()
            yield SlotMessage(0, item, [len(s) for s in seqs], 0.0, prompt_lengths), *self.slot
        self.target_io = EndOfStream(len(self.batches), 0, 0)

    def ids(self, msg) -> torch.Tensor:
        return self.slot_ids


def _run_ahead(job, setup, decoded, fail_at=None, source=None):
    if source is not None:
        job = dataclasses.replace(job, data=dataclasses.replace(job.data, regen_source=str(source)))

    def factory(job_, setup_, samples, batches, before=(), known=None):
        return AheadRegenStream(samples, batches, setup.regeneration, decoded, before, known, fail_at)

    trainer = Trainer(job, setup, job.train.out_dir, Ranks(), factory)
    try:
        return trainer, trainer.run()
    except StreamError:
        return trainer, None


def _saved_prompts(run_dir) -> list[str]:
    lines = (run_dir / "regenerated_ids.jsonl").read_text().splitlines()
    return [json.loads(x)["prompt_sha1"] for x in lines[1:]]


@pytest.fixture(scope="module")
def regen_setup(tiny_setup):
    from specforge_k25.target_engine.sampling import Regeneration

    return dataclasses.replace(tiny_setup, regeneration=Regeneration(max_new_tokens=5, max_length=40, stop_ids=(0,),
                                                                     group_sequences=4))


def test_each_prompt_is_decoded_once_across_epochs_and_a_resume(regen_setup, tmp_path):
    """Two epochs (held-out samples at both evaluations): the target decodes each of the 14 prompts
    once and the run saves each answer once. Interrupted in its first epoch and resumed: the
    resumed target decodes no prompt whose answer was saved (only those decoded ahead of the
    interruption and never trained on), and trains to the same weights."""
    from specforge_k25.data.regenerate import regeneration_prompt
    from specforge_k25.train.answer_store import prompt_key

    samples = regen_setup.data.train + regen_setup.data.heldout
    decoded = []
    full, summary = _run_ahead(_job(tmp_path / "full", epochs=2), regen_setup, decoded)
    assert sorted(decoded) == sorted(tuple(regeneration_prompt(s).tolist()) for s in samples)
    assert sorted(_saved_prompts(tmp_path / "full")) == sorted(prompt_key(regeneration_prompt(s)) for s in samples)
    assert summary["samples_trained"] == 24

    first, second = [], []
    _run_ahead(_job(tmp_path / "resume", epochs=2, checkpoint_every=1), regen_setup, first, fail_at=4)
    saved = set(_saved_prompts(tmp_path / "resume"))
    resumed, _ = _run_ahead(_job(tmp_path / "resume", epochs=2, resume="auto"), regen_setup, second)
    assert resumed.resumed_from is not None and second, "the resume should still have prompts to decode"
    assert not saved & {prompt_key(torch.tensor(p)) for p in second}, "a saved answer was decoded again"
    assert len(_saved_prompts(tmp_path / "resume")) == len(samples)  # each once, none twice
    for (name, a), b in zip(full.learner.draft.state_dict().items(), resumed.learner.draft.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed.evals["end"] == full.evals["end"]


def test_a_run_on_saved_answers_equals_the_run_that_decoded_them(regen_setup, tmp_path):
    """data.regen_source: a later run decodes nothing and trains bit for bit as the run that
    decoded the answers (weights, held-out metrics, tokens counted); it saves them beside its own
    regenerated.jsonl too."""
    decoded, none = [], []
    first, summary = _run_ahead(_job(tmp_path / "first"), regen_setup, decoded)
    later, later_summary = _run_ahead(_job(tmp_path / "later"), regen_setup, none, source=tmp_path / "first")
    assert decoded and none == []
    for (name, a), b in zip(first.learner.draft.state_dict().items(), later.learner.draft.state_dict().values()):
        assert torch.equal(a, b), name
    assert later.evals == first.evals
    assert later_summary["tokens_trained"] == summary["tokens_trained"]
    assert later_summary["regeneration"] == summary["regeneration"]
    assert sorted(_saved_prompts(tmp_path / "later")) == sorted(_saved_prompts(tmp_path / "first"))
    # the file itself, not the run folder, works too
    _, again = _run_ahead(_job(tmp_path / "again"), regen_setup, none,
                          source=tmp_path / "first" / "regenerated_ids.jsonl")
    assert none == [] and again["tokens_trained"] == summary["tokens_trained"]


def test_saved_answers_of_other_settings_or_a_bad_file_are_refused_before_the_target_starts(regen_setup, tmp_path):
    from specforge_k25.target_engine.sampling import Regeneration

    _run_ahead(_job(tmp_path / "first"), regen_setup, [])
    saved = tmp_path / "first" / "regenerated_ids.jsonl"
    started = []

    def refused(setup, source):
        job = dataclasses.replace(_job(tmp_path / "later"), data=dataclasses.replace(JobConfig().data,
                                                                                     regen_source=str(source)))
        trainer = Trainer(job, setup, job.train.out_dir, Ranks(), lambda *a, **k: started.append(1))
        with pytest.raises((ValueError, FileNotFoundError)) as err:
            trainer.run()
        assert not started, "the target started before the refusal"
        return str(err.value)

    hotter = dataclasses.replace(regen_setup, regeneration=Regeneration(
        max_new_tokens=5, max_length=40, stop_ids=(0,), group_sequences=4, temperature=0.7))
    message = refused(hotter, tmp_path / "first")
    assert "temperature: saved 0.0 vs this run 0.7" in message and str(saved) in message
    assert "no saved answers there" in refused(regen_setup, tmp_path / "nowhere")
    lines = saved.read_text().splitlines()
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text("\n".join([lines[0], lines[1][:-9], *lines[2:]]) + "\n")
    assert "line 2 is not a whole answer record" in refused(regen_setup, damaged)
    (tmp_path / "other.jsonl").write_text('{"prompt": "hello"}\n')
    assert "not a file of regenerated answer ids" in refused(regen_setup, tmp_path / "other.jsonl")
    # a fresh run in a folder holding answers of other settings
    trainer = Trainer(_job(tmp_path / "first", resume="none"), hotter, tmp_path / "first", Ranks(),
                      lambda *a, **k: started.append(1))
    with pytest.raises(ValueError, match="this run folder holds answers of other settings"):
        trainer.run()
    assert not started


# ------------------------------------------- 4. a collective failing inside the step: a named failure
@dataclass(frozen=True)
class LoneRanks(Ranks):
    """Rank 0 of 2 in one process, its peer adding nothing: the collectives the trainer calls return
    this rank's own values."""

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        return t

    def from_main(self, obj):
        return obj


def test_a_collective_failing_inside_the_step_ends_with_the_saved_progress_and_the_resume_command(
        tiny_setup, tmp_path, monkeypatch):
    """A RuntimeError out of torch.distributed's own code inside the draft's forward (where FSDP2's
    hooks all-gather: gloo's "connection closed by peer") ends the run as every data-parallel
    failure: RankFailed naming it, the progress saved, the resume command."""
    import torch.distributed as dist

    from specforge_k25.train.distributed import RankFailed

    job = _job(tmp_path, grad_accum=1)  # 12 samples, 2 ranks x batch 2: 3 steps, after a held-out batch
    trainer = Trainer(job, tiny_setup, tmp_path, LoneRanks(rank=0, world=2),
                      lambda job_, setup_, samples, batches: FakeStream(samples, batches))
    loss, calls = trainer.learner._loss, []

    def peer_gone_at_the_third_step(batch, normalizer=None):
        calls.append(batch)
        if len(calls) == 4:
            dist.rendezvous("nowhere://")  # a RuntimeError raised inside torch.distributed, as gloo's are
        return loss(batch, normalizer)

    monkeypatch.setattr(trainer.learner, "_loss", peer_gone_at_the_third_step)
    with pytest.raises(RankFailed) as err:
        trainer.run()
    message = str(err.value)
    assert message.startswith("trainer rank 0 of 2: a collective with the other ranks (torch.distributed "), message
    assert "failed during a training micro-batch's forward and backward, where FSDP2 all-gathers" in message
    assert f"progress saved: {tmp_path / 'checkpoints' / 'step_00000002'}" in message
    assert message.endswith(f"(resume with train.resume=auto train.out_dir={tmp_path})"), message


# ------------------------------------------- 5. every rank walks the one global schedule
def test_every_rank_walks_the_same_schedule_and_the_ranks_cover_each_batch_once(tiny_setup, tmp_path):
    """Two data-parallel ranks (dedicated: one replica each) build the same schedule of global
    batches, and their shares of each (what each rank's target replica is asked for) are disjoint
    and make up the batch: a rank-dependent order (say, the shuffle seeded by the rank) would
    train some samples twice and others never, caught here without a two-rank run."""
    job = _job(tmp_path, grad_accum=1)
    trainers = [Trainer(job, tiny_setup, tmp_path / f"rank{r}", LoneRanks(rank=r, world=2),
                        lambda job_, setup_, samples, batches: FakeStream(samples, batches)) for r in (0, 1)]
    assert trainers[0].schedule == trainers[1].schedule
    trained = []
    for item in trainers[0].schedule:
        shares = [t.ranks.share(item.sample_ids, job.train.batch_size) for t in trainers]
        assert sorted(shares[0] + shares[1]) == sorted(item.sample_ids) and not set(shares[0]) & set(shares[1])
        trained += item.sample_ids if item.kind == "train" else []
    assert sorted(trained) == list(range(len(tiny_setup.data.train)))  # one epoch: every sample once


# ------------------------------------ 6. co-located shards on the host: fused AdamW, its threads
@pytest.mark.parametrize("optimizer_device", ["cpu", None])
def test_colocated_host_shards_get_the_fused_adamw_on_the_configured_threads(tiny_setup, tmp_path, optimizer_device):
    """build_learner for a co-located rank (FSDP2 in a 1-rank gloo group standing in for the
    ranks): train.optimizer_device=cpu gives HostAdamW over the host shards with
    hw.host_threads_per_rank; without it torch's default AdamW, as before."""
    import torch.distributed as dist
    from specforge_k25.train.optim import HostAdamW

    job = _job(tmp_path, optimizer_device=optimizer_device)
    job = dataclasses.replace(job, hw=dataclasses.replace(job.hw, trainer_layout="colocated", host_threads_per_rank=3))
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())  # no port: tests run side by side
    try:
        learner = build_learner(job, tiny_setup, steps=1, device=torch.device("cpu"),
                                ranks=Ranks(world=2, per_replica=2, colocated=True))
    finally:
        dist.destroy_process_group()
    opt = learner.optimizer
    if optimizer_device == "cpu":
        assert type(opt) is HostAdamW and opt.param_groups[0]["fused"] and opt.threads == 3
    else:
        assert type(opt) is torch.optim.AdamW and not opt.param_groups[0]["fused"]
