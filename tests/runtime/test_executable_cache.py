"""The executable cache on the tiny parity model's config in four layers (random weights: step programs that compile
in a third of twelve layers' time): a second engine over the same directory loads its step program
without lowering it and emits the same tokens bit for bit, with the state still donated; another program's key
misses; a corrupt or truncated entry is deleted and compiled again. Engines of one process share their programs
(`STEP_PROGRAMS`), which each test but that one's empties first: its engines stand for processes of their own.
One program (the decode step) keeps it fast."""

import logging
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from model_configs import four_layers
from paths import TINY_TEXT

from inkling_jax.cache import CacheLayout
from inkling_jax.checkpoint import load_causal_lm
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.runtime import engine as engine_module
from inkling_jax.runtime import executable_cache
from inkling_jax.runtime.engine import Engine, StepShape, shape_compiler_options
from inkling_jax.runtime.requests import MAX_LOGPROBS
from inkling_jax.sharding import make_mesh

SLOTS, PROMPT, NEW_TOKENS = 2, [3, 1, 4, 1, 5, 9], 4
ASKS = SimpleNamespace(logprobs=MAX_LOGPROBS)  # a slot's sampling that returns the top log-probabilities


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("four_layers")
    config = four_layers(TINY_TEXT / "hf" / "config.json", folder / "config.json")
    return load_causal_lm(write_checkpoint(config, folder / "checkpoint", experts="fp32", seed=1), np.float32)[1]


def make_engine(model, directory: Path | None, mesh: str = "tp1", num_top: int = MAX_LOGPROBS) -> Engine:
    return Engine(
        model, CacheLayout(SLOTS, 3, 32, 8), make_mesh(mesh, model.config), num_top=num_top, executable_cache=directory
    )


@pytest.fixture(autouse=True)
def one_engine_a_process():
    engine_module.STEP_PROGRAMS.clear()


def one_token_batch(engine: Engine, token: int, first: bool, prompt: bool, emit: bool):
    """Slot 0 takes one token; slot 1 idles."""
    tokens, counts = np.zeros((SLOTS, 1), np.int32), np.zeros(SLOTS, np.int32)
    tokens[0, 0], counts[0] = token, 1
    flags = {
        name: np.asarray([value] + [False] * (SLOTS - 1))
        for name, value in (("reset", first), ("is_prompt", prompt), ("emit", emit))
    }
    return engine.host_batch(tokens, counts, [ASKS] * SLOTS, np.zeros((SLOTS, engine.max_pages), np.int32), **flags)


def greedy(engine: Engine) -> tuple[list[int], np.ndarray, list[bool]]:
    """The prompt fed one token a step, then NEW_TOKENS greedy tokens: (tokens, their top log-probabilities, which
    of the state's leaves the first step deleted: those the program donates)."""
    state = jax.tree.leaves(engine.state)
    out = engine.step(one_token_batch(engine, PROMPT[0], True, True, False))
    donated = [leaf.is_deleted() for leaf in state]
    for i, token in enumerate(PROMPT[1:], 1):
        out = engine.step(one_token_batch(engine, token, False, True, i == len(PROMPT) - 1))
    tokens, logprobs = [], []
    for _ in range(NEW_TOKENS):
        out = engine.fetch(out)
        tokens.append(int(out.tokens[0, 0]))
        logprobs.append(out.top_logprobs[0, 0])
        out = engine.step(one_token_batch(engine, tokens[-1], False, False, True))
    return tokens, np.stack(logprobs), donated


def same(got: tuple, want: tuple) -> bool:
    return got[0] == want[0] and np.array_equal(got[1], want[1]) and got[2] == want[2]


@pytest.fixture(scope="module")
def first(model, tmp_path_factory) -> tuple[Path, tuple]:
    """(directory, greedy's result) of an engine that compiled its program into an empty cache."""
    directory = tmp_path_factory.mktemp("executables")
    engine = make_engine(model, directory)
    result = greedy(engine)
    assert engine.compilations == 1 and engine.programs_loaded == 0
    assert len(list(directory.glob("*.exe"))) == 1 and not list(directory.glob(".partial-*"))
    assert sum(result[2]) >= len(result[2]) - 1  # the decode state is donated (all but the page table)
    return directory, result


def no_lowering(*args, **kwargs):
    raise AssertionError("the step was lowered")


@pytest.mark.slow
def test_a_second_engine_loads_the_program_and_emits_the_same_tokens(model, first, monkeypatch):
    directory, want = first
    engine = make_engine(model, directory)
    monkeypatch.setattr(Engine, "_lower", no_lowering)
    assert same(greedy(engine), want)  # bit for bit, and donating the same state buffers
    assert engine.compilations == 1 and engine.programs_loaded == 1


@pytest.mark.slow
def test_engines_of_one_process_share_their_programs(model, monkeypatch):
    """A second engine over a model of the same form and mesh takes the first one's program without lowering it and
    emits the same tokens bit for bit (an engine of another program has another key: `test_another_program_misses`)."""
    want = greedy(make_engine(model, None))
    monkeypatch.setattr(Engine, "_lower", no_lowering)
    engine = make_engine(model, None)
    assert same(greedy(engine), want)
    assert engine.compilations == 1 and [set(t) for t in engine.program_times.values()] == [{"shared_s"}]


def test_the_process_keeps_the_programs_used_last():
    """The shared table holds at most its capacity: a program used again outlives those used before it."""
    keys = [f"step-{n}" for n in np.random.default_rng().permutation(1000)[:5]]
    programs = {key: object() for key in keys}
    table = executable_cache.ProgramTable(3)
    for key in keys[:3]:
        table.put(key, programs[key])
    assert table.get(keys[0]) is programs[keys[0]]
    for key in keys[3:]:  # each drops the least recently used: keys[1], then keys[2]
        table.put(key, programs[key])
    assert [table.get(key) for key in keys] == [programs[keys[0]], None, None, programs[keys[3]], programs[keys[4]]]
    assert len(table) == 3


@pytest.mark.slow
def test_another_program_misses(model, first):
    directory, _ = first
    base, other_top = make_engine(model, None), make_engine(model, None, num_top=3)
    tp2 = make_engine(model, None, "tp2")
    more_pages = Engine(model, CacheLayout(SLOTS, 4, 32, 8), make_mesh("tp1", model.config), num_top=MAX_LOGPROBS)
    cache = executable_cache.ExecutableCache(directory)

    def arguments(engine: Engine, shape: StepShape) -> tuple:
        return engine.arguments(engine.idle_batch(shape))[1]

    def key(engine: Engine, prefill: bool = False, speculative: bool = False, **changes) -> str:
        shape = engine.shape(prefill, speculative)
        options = {**engine.program_options(shape), **changes}
        return executable_cache.program_key(
            shape.label, engine.mesh, options, engine.graphdef, arguments(engine, shape)
        )

    stored = key(base)
    assert [path.name for path in directory.glob("*.exe")] == [stored]  # the first engine's key, recomputed
    fast_math = repr([("xla_cpu_enable_fast_math", True)])
    others = [
        key(base, prefill=True),
        key(base, speculative=True),
        key(base, greedy_draft=True),
        key(other_top),
        key(more_pages),
        key(tp2),
        key(base, compiler_options=fast_math),
    ]
    assert len({stored, *others}) == len(others) + 1
    assert repr(model.config) in repr(base.graphdef)  # the key hashes the graph: every config field is in it
    # an entry filed under another program's name is refused (and deleted), never run
    misfiled = directory / others[2]
    misfiled.write_bytes((directory / stored).read_bytes())
    assert cache.load(misfiled.name, arguments(base, base.shape(False, False)), list(base.mesh.devices.flat)) is None
    assert not misfiled.exists() and (directory / stored).exists()


@pytest.mark.slow
def test_a_corrupt_entry_is_deleted_compiled_again_and_stored(model, first, caplog, monkeypatch):
    directory, want = first
    (entry,) = directory.glob("*.exe")
    blob = bytearray(entry.read_bytes())
    blob[len(blob) // 2 : len(blob) // 2 + 64] = bytes(b ^ 0xFF for b in blob[len(blob) // 2 : len(blob) // 2 + 64])
    entry.write_bytes(blob)
    engine = make_engine(model, directory)
    with caplog.at_level(logging.WARNING, logger="inkling_jax.runtime.executable_cache"):
        assert same(greedy(engine), want)
    assert any("unusable (ValueError: checksum mismatch): deleted" in record.message for record in caplog.records)
    assert engine.compilations == 1 and engine.programs_loaded == 0
    engine_module.STEP_PROGRAMS.clear()  # a new process
    again = make_engine(model, directory)
    monkeypatch.setattr(Engine, "_lower", no_lowering)
    assert same(greedy(again), want) and again.programs_loaded == 1


@pytest.mark.slow
def test_a_truncated_entry_is_deleted(first, tmp_path, caplog):
    directory, _ = first
    (entry,) = directory.glob("*.exe")
    (tmp_path / entry.name).write_bytes(entry.read_bytes()[:1000])
    with caplog.at_level(logging.WARNING, logger="inkling_jax.runtime.executable_cache"):
        assert executable_cache.ExecutableCache(tmp_path).load(entry.name, (), jax.devices()[:1]) is None
    assert "truncated" in caplog.text and not (tmp_path / entry.name).exists()


def test_a_backend_that_cannot_serialize_turns_the_cache_off_with_one_warning(tmp_path, monkeypatch, caplog):
    def refuse(compiled):
        raise ValueError("Compilation does not support serialization")

    monkeypatch.setattr(executable_cache.serialize_executable, "serialize", refuse)
    monkeypatch.setattr(executable_cache, "_warned", [])
    compiled = jax.jit(lambda x: x + 1).lower(np.zeros(3, np.float32)).compile()
    caches = [executable_cache.ExecutableCache(tmp_path) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="inkling_jax.runtime.executable_cache"):
        assert not any(cache.store("entry.exe", compiled) for cache in caches)
    assert caplog.text.count("cannot serialize") == 1 and all(cache.off for cache in caches)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_step_programs_get_their_platforms_options(model, monkeypatch):
    """A plain TPU decode step keeps its gathers off SparseCore; every GPU shape keeps dots unmerged and its
    matmuls in cuBLAS, untuned, reading stacked weights in place, and runs its independent kernels side by side and
    its conditionals and loops in command buffers; TPU prefill and speculative shapes, and CPU, add nothing to what
    XLA compiles. The programs run between steps (resamples, prefix snapshots' saves and restores) take a plain
    decode step's options: on a GPU a conditional outside the command buffers would make the host wait for the
    step before."""
    decode, prefill, verify = StepShape(8, 1, 0, False), StepShape(64, 1, 4, False), StepShape(16, 8, 0, True)
    assert shape_compiler_options("tpu", decode) == {"xla_tpu_offload_gather_to_sparsecore": False}
    gpu = {
        "xla_gpu_dot_merger_threshold_mb": 0,
        "xla_gpu_autotune_level": 0,
        "xla_gpu_enable_triton_gemm": False,
        "xla_gpu_enable_dynamic_slice_fusion": True,
        "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,"
        "CONDITIONAL,WHILE",
    }
    assert shape_compiler_options("gpu", decode) == shape_compiler_options("gpu", prefill) == gpu
    assert shape_compiler_options("gpu", verify) == gpu
    assert shape_compiler_options("tpu", prefill) == shape_compiler_options("tpu", verify) == {}
    assert shape_compiler_options("cpu", decode) == {}
    assert engine_module.between_steps_options("gpu") == gpu and engine_module.between_steps_options("cpu") == {}
    assert engine_module.between_steps_options("tpu") == shape_compiler_options("tpu", decode)
    asked = []
    monkeypatch.setattr(engine_module, "shape_compiler_options", lambda *shape: asked.append(shape) or {})
    engine = Engine(model, CacheLayout(SLOTS, 3, 32, 8), make_mesh("tp1", model.config), snapshots=1)
    plain = (jax.default_backend(), StepShape(1, 1, 0, False))
    assert asked == [plain]  # the snapshots' save and restore
    asked.clear()
    engine.fetch(engine.step(one_token_batch(engine, 3, first=True, prompt=True, emit=True)))
    assert asked and set(asked) == {(jax.default_backend(), engine.shape(prefill=False, speculative=False))}
    asked.clear()
    monkeypatch.setattr(engine_module, "RESAMPLERS", engine_module.ProgramTable(4))
    engine.warm_up_resample()
    buckets = {engine._resample_rows(count) for count in (*engine_module.RESAMPLE_ROWS, engine.slots)}
    assert asked.count(plain) == len(buckets)


@pytest.mark.slow
def test_few_decoding_slots_run_a_program_of_few_tokens(model):
    """With more slots than FEW_TOKENS, a decode step of at most that many tokens runs a program of its own, and its
    slots emit what the same sequences emit from the full decode program beside other slots."""
    slots = engine_module.FEW_TOKENS + 4
    engine = Engine(model, CacheLayout(slots, slots, 32, 8), make_mesh("tp1", model.config), num_top=MAX_LOGPROBS)
    few = StepShape(engine_module.FEW_TOKENS, 1, 0, False)
    assert few in engine.shapes and engine.shape(False, False).tokens == slots
    table = np.zeros((slots, engine.max_pages), np.int32)
    table[:, 0] = np.arange(slots)
    prompts = np.random.default_rng(7).integers(0, model.config.unpadded_vocab_size, (3, 6), dtype=np.int32)

    def run(chunks: dict[int, np.ndarray], reset: set[int], prompt: set[int], emit: set[int]):
        tokens, counts = np.zeros((slots, 6), np.int32), np.zeros(slots, np.int32)
        for slot, chunk in chunks.items():
            tokens[slot, : len(chunk)], counts[slot] = chunk, len(chunk)
        flags = {
            name: np.isin(np.arange(slots), list(group))
            for name, group in (("reset", reset), ("is_prompt", prompt), ("emit", emit))
        }
        batch = engine.host_batch(tokens, counts, [ASKS] * slots, table, **flags)
        return batch.token_ids.shape[0], engine.fetch(engine.step(batch))

    firsts = []
    for base in (0, 3):  # the same three prompts in slots 0-2, then in slots 3-5
        chunks = {base + i: prompts[i] for i in range(3)}
        firsts.append(run(chunks, set(chunks), set(chunks), set(chunks))[1].tokens[base : base + 3, 0])
    np.testing.assert_array_equal(*firsts)
    size, alone = run({i: firsts[0][i : i + 1] for i in range(3)}, set(), set(), {0, 1, 2})
    assert size == few.tokens
    others = {slot: np.asarray([slot]) for slot in range(6, slots)}  # new one-token prompts beside them
    decoding = {3 + i: firsts[1][i : i + 1] for i in range(3)}
    size, beside = run(decoding | others, set(others), set(others), set(decoding))
    assert size == slots
    np.testing.assert_array_equal(alone.tokens[:3], beside.tokens[3:6])
    np.testing.assert_array_equal(alone.top_ids[:3], beside.top_ids[3:6])
    np.testing.assert_allclose(alone.top_logprobs[:3], beside.top_logprobs[3:6], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_warm_up_lowers_one_shape_at_a_time_most_tokens_first(model, monkeypatch, tmp_path):
    """Lowering holds the GIL, XLA's compile does not: the warm-up lowers the shapes one after the other, the one
    of most tokens first, and compiles each while the next lowers; every shape ends compiled and runs. Over a
    filled executable cache a warm-up lowers nothing and loads every shape."""
    slots = engine_module.FEW_TOKENS + 4

    def engine_with_recorded_lowering() -> tuple[Engine, list]:
        engine = Engine(
            model,
            CacheLayout(slots, slots, 32, 8),
            make_mesh("tp1", model.config),
            num_top=MAX_LOGPROBS,
            executable_cache=tmp_path,
        )
        lowering, events = [0], []
        lower = engine._lower

        def recorded(args, shape):
            lowering[0] += 1
            events.append((shape.tokens, lowering[0]))
            try:
                return lower(args, shape)
            finally:
                lowering[0] -= 1

        monkeypatch.setattr(engine, "_lower", recorded)
        engine.warm_up()
        return engine, events

    engine, events = engine_with_recorded_lowering()
    assert [tokens for tokens, _ in events] == sorted((shape.tokens for shape in engine.shapes), reverse=True)
    assert all(at_once == 1 for _, at_once in events) and len(events) == len(engine.shapes) == 3
    assert set(engine._programs) == set(engine.shapes) and engine.programs_loaded == 0
    engine_module.STEP_PROGRAMS.clear()  # a new process
    again, events = engine_with_recorded_lowering()
    assert events == [] and again.programs_loaded == 3 and set(again._programs) == set(again.shapes)
