"""The engine's speculative step is lossless: through the full jitted step (draft block, RNN head, sampled
drafts, verify pass, acceptance, convolution rollback), the joint law of the first two emitted tokens is
the target's at temperatures 0.6 and 1.0 (chi-square, 100k samples each), and deliberately broken variants
fail that test; constrained rounds that verify the drafts they kept (under open masks) pass it, and fail it when
they verify against another row's q; greedy output and the output of requests that opt out are those of plain
decoding."""

import json
import threading

import jax.numpy as jnp
import numpy as np
import pytest
from paths import TINY_TEXT
from scipy import stats
from xla_flags import OPTIMIZED_STEPS

from inkling_jax import cache as cache_module
from inkling_jax import speculative
from inkling_jax import step as step_module
from inkling_jax.cache import CacheLayout
from inkling_jax.checkpoint import load_causal_lm
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.forward import logits_fn
from inkling_jax.generate import main as generate_main
from inkling_jax.model.draft import NoDraftError
from inkling_jax.runtime import engine as engine_module
from inkling_jax.runtime.batch import generate
from inkling_jax.runtime.engine import Engine, StepShape
from inkling_jax.runtime.requests import MAX_LOGPROBS, Delta, Request
from inkling_jax.runtime.scheduler import Scheduler, Stats
from inkling_jax.sharding import make_mesh
from inkling_jax.speculative import SpeculationError, vocab_probs

VOCAB = 12  # small enough that the joint of two tokens has 144 cells
CONFIG = {
    "model_type": "inkling2_text", "vocab_size": 16, "unpadded_vocab_size": VOCAB, "hidden_size": 16,
    "num_hidden_layers": 2, "layer_types": ["hybrid_sliding", "hybrid"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "swa_num_attention_heads": 2,
    "swa_num_key_value_heads": 2, "swa_head_dim": 4, "sliding_window_size": 4, "d_rel": 2, "rel_extent": 5,
    "moe_intermediate_size": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_layers_per_attn_res_block": 2,
    "eos_token_id": 3, "max_position_embeddings": 256,
}  # fmt: skip
GAMMA = 3
DRAFT = {
    "num_hidden_layers": 1,
    "block_size": GAMMA,
    "target_layer_ids": [0, 1],
    "mask_token_id": 5,
    "markov_rank": 6,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 24,
}
SHARPEN = 15.0  # LM-head scale: random weights give near-uniform logits; this gives a peaked, varied law
ANCHOR = 7  # every sampled sequence starts from this one token
TEMPERATURES = (0.6, 1.0)
SLOTS, ROUNDS = 4096, 25  # 25 x 4096 / 2 = 51,200 samples per temperature
BROKEN_ROUNDS = 2  # 8,192 samples at one temperature: each broken step's statistic is over 3x the bar there
CONSTRAINED_ROUNDS = 8  # 32,768 samples at one temperature through kept rounds
ALPHA = 1e-3  # the correct step passes at this level (fixed seeds: the test is deterministic)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative_step")
    (root / "config.json").write_text(json.dumps(CONFIG))
    path = write_checkpoint(root / "config.json", root / "ckpt", seed=4, experts="fp32", draft=DRAFT)
    model = load_causal_lm(path, jnp.float32)[1]
    model.lm_head.weight[...] = model.lm_head.weight[...] * SHARPEN
    return model


TARGET_LOGITS = {}  # id(model): (model, logits after ANCHOR, logits after each pair)


def target_logits(model) -> tuple[np.ndarray, np.ndarray]:
    """The target's logits after ANCHOR [V] and after each (ANCHOR, token) [V, V], in float64, from jitted
    whole-sequence forwards (computed once a model: every joint test reads them)."""
    if TARGET_LOGITS.get(id(model), (None,))[0] is not model:
        forward = logits_fn(model)
        first = np.asarray(forward(jnp.asarray([[ANCHOR]]))[0, -1], np.float64)
        pairs = jnp.asarray([[ANCHOR, token] for token in range(VOCAB)], jnp.int32)
        TARGET_LOGITS[id(model)] = model, first, np.asarray(forward(pairs)[:, -1], np.float64)
    return TARGET_LOGITS[id(model)][1:]


def exact_joint(model, temperature: float) -> np.ndarray:
    """P(y_1, y_2) [V, V] of target-only sampling after ANCHOR, in float64, from whole-sequence forwards."""
    first, second = target_logits(model)

    def law(logits: np.ndarray) -> np.ndarray:
        scaled = logits / temperature
        probs = np.exp(scaled - scaled.max(-1, keepdims=True))
        return probs / probs.sum(-1, keepdims=True)

    return law(first)[:, None] * law(second)


def engine_for(model) -> Engine:
    """Room for the anchor, two rounds and their verify passes in one page per slot; chunk = γ + 1. Its step
    is compiled with LLVM's optimisations (the suite turns them off, tests/conftest.py): 4096 slots make the
    sampling run-bound, and optimised code halves the test's time for a slightly slower compilation."""
    layout = CacheLayout(SLOTS, SLOTS, 1, GAMMA + 1)
    mesh = make_mesh("tp1", model.config)
    return Engine(model, layout, mesh, speculative="dspark", compiler_options=OPTIMIZED_STEPS)


class Sampling:
    def __init__(self, temperature: float, seed: int):
        self.temperature, self.seed = temperature, seed


def first_two(
    engine: Engine, rounds: int, temperatures: tuple[float, ...], constrained: bool = False
) -> dict[float, np.ndarray]:
    """The first two tokens [N, 2] each sampled sequence emits, by temperature. Every round restarts all
    slots from the anchor (reset) with fresh seeds; two speculative steps always emit at least two. constrained:
    every slot runs constrained rounds under masks that allow every token (the engine needs a row for each slot):
    a first round, which emits one token and keeps its next drafts, then a round that verifies those."""
    open_masks = np.full((GAMMA + 1, engine.mask_words), -1, np.int32)
    starting = {slot: (slot, False, open_masks) for slot in range(SLOTS)} if constrained else None
    continuing = {slot: (slot, True, open_masks) for slot in range(SLOTS)} if constrained else None
    table = np.arange(SLOTS, dtype=np.int32)[:, None]
    everyone = np.ones(SLOTS, bool)
    one = np.ones(SLOTS, np.int32)
    by_slot = np.asarray([temperatures[s % len(temperatures)] for s in range(SLOTS)])
    samples = []
    for round_ in range(rounds):
        sampling = [Sampling(by_slot[s], round_ * SLOTS + s) for s in range(SLOTS)]
        tokens = np.zeros((SLOTS, GAMMA + 1), np.int32)
        tokens[:, 0] = ANCHOR
        first = engine.step(
            engine.host_batch(
                tokens, one, sampling, table, reset=everyone, is_prompt=everyone, emit=everyone, speculate=everyone
            ),
            rounds=starting,
        )
        second = engine.step(
            engine.host_batch(
                np.zeros_like(tokens), one, sampling, table, feedback=everyone, emit=everyone, speculate=everyone
            ),
            rounds=continuing,
        )
        first, second = engine.fetch(first), engine.fetch(second)
        assert np.all((first.count >= 1) & (first.count <= GAMMA + 1))
        # the first step emits at least one token: the second is its next one, or the second step's first
        then = np.where(first.count >= 2, first.tokens[:, 1], second.tokens[:, 0])
        samples.append(np.stack([first.tokens[:, 0], then], axis=1))
    samples = np.concatenate(samples)
    temperature = np.tile(by_slot, rounds)
    return {t: samples[temperature == t] for t in temperatures}


def chi_square(samples: np.ndarray, joint: np.ndarray) -> tuple[float, float, int]:
    """(statistic, p-value, degrees of freedom); cells expecting fewer than 5 are pooled."""
    observed = np.bincount(samples[:, 0] * VOCAB + samples[:, 1], minlength=VOCAB * VOCAB)
    expected = joint.reshape(-1) * len(samples)
    small = expected < 5
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    statistic = float(np.sum((observed - expected) ** 2 / expected))
    dof = len(expected) - 1
    return statistic, float(stats.chi2.sf(statistic, dof)), dof


@pytest.mark.slow
def test_the_step_samples_the_targets_joint_law(model):
    samples = first_two(engine_for(model), ROUNDS, TEMPERATURES)
    for temperature in TEMPERATURES:
        joint = exact_joint(model, temperature)
        assert len(samples[temperature]) >= 50_000
        statistic, p_value, dof = chi_square(samples[temperature], joint)
        print(f"T {temperature}: chi2 = {statistic:.1f}, dof {dof}, p = {p_value:.3g}")
        assert p_value > ALPHA


@pytest.fixture
def a_row_a_slot(monkeypatch):
    """Engines built in the test give every slot a constrained round's row."""
    for module in (cache_module, engine_module):
        monkeypatch.setattr(module, "ROUND_ROWS", SLOTS)


def rolled_q(kept_rounds):
    """Kept rounds that verify their kept drafts against the q another row kept."""

    def broken(rounds, fresh, kept):
        return kept_rounds(rounds, fresh, (kept[0], jnp.roll(kept[1], 1, axis=0)))

    return broken


@pytest.mark.slow
def test_constrained_rounds_keep_the_targets_joint_law(model, monkeypatch, a_row_a_slot):
    """Rounds that verify the drafts and q the state kept from the step before (under masks that allow every token)
    emit the target's joint law; verifying them against another row's q fails the same test."""
    samples = first_two(engine_for(model), CONSTRAINED_ROUNDS, (1.0,), constrained=True)[1.0]
    statistic, p_value, dof = chi_square(samples, exact_joint(model, 1.0))
    print(f"kept rounds: chi2 = {statistic:.1f}, dof {dof}, p = {p_value:.3g}")
    assert p_value > ALPHA
    monkeypatch.setattr(step_module, "_kept_rounds", rolled_q(step_module._kept_rounds))
    engine_module.STEP_PROGRAMS.clear()  # the next engine traces the patched step
    samples = first_two(engine_for(model), BROKEN_ROUNDS, (1.0,), constrained=True)[1.0]
    statistic, _, dof = chi_square(samples, exact_joint(model, 1.0))
    print(f"another row's q: chi2 = {statistic:.1f}, dof {dof}")
    assert statistic > 3 * stats.chi2.isf(ALPHA, dof)


def wrong_q(sample_draft):
    """A draft that samples from its q but reports another (its logits at twice the temperature)."""

    def broken(logits, params, generated, greedy=False):
        tokens, _ = sample_draft(logits, params, generated, greedy)
        return tokens, vocab_probs(logits / 2, params)

    return broken


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "patch"),
    [
        ("rejection samples p, not the residual", ("residual", lambda p, q: p)),
        ("q is not what the draft sampled from", ("sample_draft", wrong_q(speculative.sample_draft))),
    ],
)
def test_broken_steps_fail_the_test(model, monkeypatch, name, patch):
    monkeypatch.setattr(speculative, *patch)  # a new engine traces its step afresh and sees the patch
    samples = first_two(engine_for(model), BROKEN_ROUNDS, (1.0,))[1.0]
    statistic, p_value, dof = chi_square(samples, exact_joint(model, 1.0))
    critical = stats.chi2.isf(ALPHA, dof)
    print(f"{name}: chi2 = {statistic:.1f}, dof {dof}, critical {critical:.1f}, p = {p_value:.3g}")
    assert statistic > 3 * critical


def requests() -> list[Request]:
    """Greedy requests, then sampled ones of which every other opts out of speculation."""
    rng = np.random.default_rng(2)
    return [
        Request(
            i,
            rng.integers(4, VOCAB, rng.integers(2, 12)).tolist(),
            max_tokens=int(rng.integers(8, 40)),
            temperature=0.0 if i < 4 else 0.8,
            seed=i,
            speculative=i < 4 or i % 2 == 0,
        )
        for i in range(10)
    ]


@pytest.fixture(scope="module")
def plain_outputs(model) -> dict:
    """The requests' tokens by id from plain decoding on one device (the scheduler test's plain engine's programs)."""
    return scheduler_outputs(model, "none", requests())[0]


def test_bad_speculation_settings_are_named(model):
    mesh = make_mesh("tp1", model.config)
    with pytest.raises(SpeculationError, match="chunk 3 is narrower than a verify pass"):
        Engine(model, CacheLayout(2, 2, 1, GAMMA), mesh, speculative="dspark")
    with pytest.raises(SpeculationError, match="one of none, dspark, dspark-greedy"):
        Engine(model, CacheLayout(2, 2, 1, 8), mesh, speculative="eagle")
    plain = load_causal_lm(TINY_TEXT / "hf", jnp.float32)
    with pytest.raises(NoDraftError, match="no DSpark draft"):
        Engine(plain[1], CacheLayout(2, 2, 1, 8), make_mesh("tp1", plain[1].config), speculative="dspark")
    engine = Engine(plain[1], CacheLayout(2, 2, 1, 8), make_mesh("tp1", plain[1].config))
    with pytest.raises(SpeculationError, match="without --speculative"):
        engine.step(engine.idle_batch(StepShape(2, 1, 0, True)))


def only(token: int) -> np.ndarray:
    """The mask words [1] allowing `token` alone."""
    return np.asarray([1 << token], np.int32)


@pytest.mark.slow
def test_a_constrained_round_verifies_the_drafts_it_kept(model):
    """Engine.step's constrained rounds: a first round verifies no draft, emits one token under its mask and drafts
    the next round (`Emitted.drafts`); a round whose masks allow only the drafts it kept, then one token, emits them
    all and that token, sampled or greedy; the slot beside it emits what it emits with no round next to it."""
    engine = scheduler_engine(model, "dspark")  # slots 0 and 1 run, the others idle
    rng = np.random.default_rng()
    table = np.arange(engine.slots, dtype=np.int32)[:, None].repeat(engine.max_pages, 1)  # a page each
    both, one = np.arange(engine.slots) < 2, (np.arange(engine.slots) < 2).astype(np.int32)
    tokens = np.full((engine.slots, GAMMA + 1), ANCHOR, np.int32)
    for temperature in (0.0, 0.9):
        sampling = [Sampling(temperature, int(rng.integers(1000))), Sampling(0.9, int(rng.integers(1000)))]
        sampling += [None] * (engine.slots - 2)
        first, last = (int(t) for t in rng.integers(0, VOCAB, 2))
        runs = []
        for constrained in (True, False):
            start = engine.host_batch(
                tokens, one, sampling, table, reset=both, is_prompt=both, emit=both, speculate=both
            )
            masks = np.full((GAMMA + 1, 1), -1, np.int32)
            masks[0] = only(first)
            out = engine.fetch(engine.step(start, rounds={0: (3, False, masks)} if constrained else None))
            drafts = out.drafts[0].tolist()
            kept = np.stack([only(t) for t in [*drafts, last]])
            then = engine.host_batch(
                np.zeros_like(tokens), one, sampling, table, feedback=both, emit=both, speculate=both
            )
            runs.append(
                (out, engine.fetch(engine.step(then, rounds={0: (3, True, kept)} if constrained else None)), drafts)
            )
        (out, then, drafts), (free_out, free_then, _) = runs
        assert out.count[0] == 1 and out.tokens[0, 0] == first and len(drafts) == GAMMA
        assert then.count[0] == GAMMA + 1 and then.tokens[0].tolist() == [*drafts, last]
        for a, b in ((out, free_out), (then, free_then)):
            assert a.tokens[1, : a.count[1]].tolist() == b.tokens[1, : b.count[1]].tolist()


def scheduler_engine(model, speculative: str) -> Engine:
    """4 slots, 5 pages of 128 tokens, 2 per sequence (the whole context): a small pool that forces preemptions.
    The file's engines of one-device steps take this form, so that they share its step programs
    (`engine_module.STEP_PROGRAMS`). Hundreds of steps of 4 slots: LLVM's optimisations would cost more to
    compile than they save in running."""
    return Engine(model, CacheLayout(4, 5, 2, 8), make_mesh("tp1", model.config), MAX_LOGPROBS, speculative)


def scheduler_outputs(model, speculative: str, requests: list[Request]) -> tuple[dict, dict, Stats, int]:
    """Run `requests` through a scheduler of `scheduler_engine`: (tokens by id, last delta by id, stats,
    compilations after warm-up)."""
    engine = scheduler_engine(model, speculative)
    scheduler = Scheduler(engine)
    scheduler.warm_up()
    compiled = engine.compilations
    scheduler.start()
    tokens, last, done = {}, {}, threading.Semaphore(0)

    def sink(request_id: str):
        tokens[request_id] = []

        def on_delta(delta: Delta) -> None:
            tokens[request_id].extend(delta.token_ids)
            assert len(delta.logprobs) == (len(delta.token_ids) if delta.logprobs or not delta.token_ids else 0)
            if delta.finish_reason is not None:
                last[request_id] = delta
                done.release()

        return on_delta

    for request in requests:
        scheduler.submit(request, sink(request.id))
    for _ in requests:
        assert done.acquire(timeout=300)
    stats = scheduler.stats()
    scheduler.stop()
    return tokens, last, stats, engine.compilations - compiled


@pytest.mark.slow
def test_the_scheduler_speculates_through_preemption(model):
    """Greedy and opted-out requests stream exactly what plain decoding gives, speculating ones their full
    length with an acceptance length, with preemptions, the context's end and no compilation after warm-up."""
    rng = np.random.default_rng(5)
    requests = []
    for i in range(8):
        prompt = tuple(rng.integers(4, VOCAB, 12 if i == 0 else rng.integers(2, 12)).tolist())
        requests.append(
            Request(
                f"r{i}",
                prompt,
                max_tokens=240 if i == 0 else int(rng.integers(60, 180)),
                ignore_eos=True,
                seed=i,
                temperature=0.0 if i % 3 == 0 else 0.9,
                speculative=i % 3 != 2,
                logprobs=2 if i % 2 else None,
            )
        )
    plain, _, _, _ = scheduler_outputs(model, "none", requests)
    speculated, last, stats, compiled = scheduler_outputs(model, "dspark", requests)
    assert compiled == 0 and stats.preemptions > 0 and stats.speculative_rounds > 0
    assert stats.running == stats.waiting == stats.pages_used == 0
    for request in requests:
        got, options = speculated[request.id], request
        assert len(got) == options.max_tokens and last[request.id].finish_reason == "length"
        if options.temperature == 0 or not options.speculative:
            assert got == plain[request.id], request.id
        assert (last[request.id].acceptance_length >= 1.0) == options.speculative


def test_generate_cli_names_a_checkpoint_without_draft(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt_token_ids": [1, 2]}\n')
    plain = TINY_TEXT / "hf"
    code = generate_main(
        [
            "--checkpoint",
            str(plain),
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "out.jsonl"),
            "--speculative",
            "dspark",
        ]
    )
    assert code == 2 and "has no DSpark draft" in capsys.readouterr().err


@pytest.mark.slow
def test_greedy_and_opted_out_requests_match_plain_decoding_on_a_mesh(model, plain_outputs):
    """Through `generate` on dp2tp2 (vocabulary, heads and experts split over `model`, slots and pages, the
    draft pool too, over `data`) with greedy drafting: greedy requests emit plain greedy decoding (one
    device, no speculation); sampled requests that opt out sample from the same noise as without
    speculation, next to speculating ones. (The scheduler test covers sampled drafting on one device.)"""
    mesh = make_mesh("dp2tp2", model.config)
    speculated = generate(model, requests(), 3, 8, mesh=mesh, speculative="dspark-greedy")
    for request, got in zip(requests(), speculated, strict=True):
        if request.temperature == 0 or not request.speculative:
            assert got["token_ids"] == plain_outputs[request.id]
        assert ("acceptance_length" in got) == (request.speculative and len(got["token_ids"]) > 1)
        assert 1.0 <= got.get("acceptance_length", 1.0) <= GAMMA + 1
